"""`shardfeed bench --quick` end to end, so the harness cannot rot: SeaweedFS (the default S3
server), the latency proxy, the service, the client, the DataLoader and the minimal HTTP server,
for real."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys

import pytest

from shardfeed.benchmarks.report import SCENARIOS

KIB10, MIB1 = 10 << 10, 1 << 20


def bench(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardfeed", "bench", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=150)


@pytest.mark.timeout(180)
def test_quick_bench_measures_every_scenario_at_every_point_with_sane_figures(tmp_path):
    done = bench("--quick", "--out", "out", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "samples/s" in done.stdout and "targets:" in done.stdout  # progress lines, table, targets
    out = tmp_path / "out"
    document = json.loads((out / "results.json").read_text())
    rows = document["results"]
    assert document["config"]["quick"] is True
    assert document["config"]["s3"] == "seaweedfs server (loopback)"
    assert document["machine"]["cores"] >= 1

    points = {(r["s3_latency_ms"], r["sample_size"]) for r in rows}
    assert points == {(0.0, KIB10), (20.0, KIB10), (0.0, MIB1), (20.0, MIB1)}
    for latency, size in points:
        got = {r["scenario"] for r in rows if (r["s3_latency_ms"], r["sample_size"]) == (latency, size)}
        assert got == set(SCENARIOS), (latency, size)

    for r in rows:
        where = (r["scenario"], r["s3_latency_ms"], r["sample_size"], r["batch_size"])
        assert r["samples"] > 0 and r["samples_per_s"] > 0, where
        assert r["mb_per_s"] == pytest.approx(r["samples_per_s"] * r["sample_size"] / 1e6, rel=0.02), where
        assert r["ratio"] > 0, where
        if r["batch_p50_ms"] is not None:
            assert 0 <= r["batch_p50_ms"] <= r["batch_p95_ms"] <= r["batch_p99_ms"], where
        if r["scenario"] not in ("dataloader",):
            assert 0 < r["sample_p50_ms"] <= r["sample_p99_ms"], where
        if r["scenario"] == "individual-gets":
            assert (r["s3_requests_per_1000"], r["s3_bytes_per_byte"], r["ratio"]) == (1000, 1, 1), where
        if r["scenario"] in ("shardfeed-cold", "per-sample"):
            # An empty cache: every byte comes from S3 once, in far fewer requests than samples.
            assert 0 < r["s3_requests_per_1000"] < 1000, where
            assert 1 <= r["s3_bytes_per_byte"] < 1.5, where
        if r["scenario"] in ("shardfeed-warm", "dataloader"):
            assert r["s3_requests"] == 0, where  # all from the cache
        if r["scenario"] == "shardfeed-warm" and r["sample_size"] == KIB10:
            assert r["ratio"] > 2, where  # the point of the service, with a wide margin for a busy machine

    assert {g["target"] for g in document["targets"]}  # evaluated, "not measured" where the quick matrix lacks them
    assert (out / "throughput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| S3 +ms | size | batch | scenario |" in (out / "results.md").read_text()
    # The HTML report: the same table, and the plot inside it, so the run is one file to open.
    page = (out / "results.html").read_text()
    embedded = re.search(r'<img [^>]*src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert embedded and base64.b64decode(embedded[1]) == (out / "throughput.png").read_bytes()
    assert page.count("<tr>") == 1 + len(document["targets"]) + 1 + len(rows)  # header + row per target, per result
    assert not re.search(r'(src|href)="(?!data:)', page)  # nothing fetched from elsewhere


def test_bench_refuses_bad_arguments_with_one_line(tmp_path):
    done = bench("--workers", "0", cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr.strip() == "shardfeed: error: --workers must be between 1 and 256, not 0"
    done = bench("--sizes", "10KiB,lots", cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr.strip().startswith("shardfeed: error: invalid --sizes '10KiB,lots'")
    done = bench("--s3", "minio", cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr.strip() == "shardfeed: error: --s3 must be seaweedfs, moto or an http(s) URL, not 'minio'"


@pytest.mark.timeout(150)
def test_status_page_benchmark_runs_and_prints_its_figures(tmp_path):
    done = subprocess.run([sys.executable, "-m", "shardfeed.benchmarks.status_page", "--samples", "500",
                           "--seconds", "1", "--rounds", "1", "--pages", "5", "--calls", "50", "--cpu-seconds", "1"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"median of 1 rounds of 1 s: [\d,]+ samples/s without pages, [\d,]+ with 5 \(\d+ /v1/stats "
                     r"calls/s\): [-+]\d+\.\d%", done.stdout), done.stdout
    per_call = re.search(r"CPU per call: (-?\d+\.\d+) ms as the page polls \(\?since=\), (-?\d+\.\d+) ms for a "
                         r"first load \((\d+) points of history\); 50 calls each", done.stdout)
    assert per_call and int(per_call[3]) > 0, done.stdout
    assert "the pages cost" in done.stdout
