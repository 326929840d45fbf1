"""``python -m shardfeed.benchmarks.chaos`` in its short version: 24 s of load with every kind
of fault at least once, and not one sample wrong, lost or delivered twice. Also the proxy's
outage, which the chaos run uses to cut S3 off."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from shardfeed.benchmarks.chaos import KINDS
from shardfeed.benchmarks.s3proxy import start_proxy

pytestmark = pytest.mark.slow  # two replicas of two workers, two DataLoaders, SeaweedFS, for 24 s

SHORT = ("--duration", "24", "--samples", "1000", "--shard-size", "1MiB", "--worker-kill-every", "8",
         "--replica-kill-every", "20", "--s3-outage-every", "20", "--s3-outage-for", "4", "--enospc-every", "20",
         "--enospc-for", "3", "--cache-damage-every", "6", "--overwrite-every", "20")
"""Every kind strikes at least once in the 24 s (the first at a fraction of its period: the S3 outage at 7 s for
4 s, enospc at 11 s for 3 s, the replica kill at 15 s, the overwrite at 17 s; none later than 19 s)."""


@pytest.mark.timeout(420)
def test_a_short_run_of_every_fault_loses_no_sample_and_delivers_none_wrong_or_twice(tmp_path):
    figures = tmp_path / "chaos.json"
    done = subprocess.run([sys.executable, "-m", "shardfeed.benchmarks.chaos", *SHORT, "--json", str(figures)],
                          check=False, capture_output=True, text=True, timeout=400)
    report = f"{done.stdout}\n{done.stderr[-6000:]}"
    assert done.returncode == 0, report
    s = json.loads(figures.read_text())
    assert s["verified"] > 2 * s["samples"], report  # more than an epoch of each loader
    assert (s["wrong"], s["lost"], s["duplicate"]) == (0, 0, 0), report
    assert not s["dead"] and not s["hung"] and not s["crashed"] and s["up"] == [0, 1], report
    for kind in KINDS:
        if kind == "enospc" and s["skipped"]:  # no tmpfs could be mounted (not root, or not allowed here)
            assert s["skipped"][0].startswith("enospc:"), report
            continue
        assert s["faults"][kind]["count"] >= 1, (kind, report)
    assert "| fault | injected |" in done.stdout and "wrong samples 0, lost 0, duplicate 0" in done.stdout


def test_an_outage_resets_every_request_until_it_ends():
    with start_proxy("http://127.0.0.1:9") as proxy, httpx.Client(base_url=proxy.url, timeout=5) as http:
        http.post("/_proxy/outage", json={"down": True}).raise_for_status()
        for _ in range(2):  # a new connection, then again
            with pytest.raises(httpx.TransportError):
                http.get("/bucket/key")
        proxy.outage(False)
        assert http.get("/bucket/key").status_code == 502  # upstream asked again: nobody on port 9
        assert proxy.counts["fault:outage"] == 2
