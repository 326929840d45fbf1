"""`shardfeed demo`, end to end: seed the digits, start the service, train, report."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # trains a model through the service; not in `make check`


def shardfeed(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardfeed", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=240)


def test_demo_trains_through_the_service_and_reports_throughput_latency_and_accuracy(tmp_path):
    done = shardfeed("demo", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert (tmp_path / ".shardfeed/datasets/digits/index.parquet").exists()
    assert len(re.findall(r"epoch \d: loss [\d.]+, 1437 samples in [\d.]+s \([\d,]+ samples/s\)", out)) == 2
    assert re.search(r"p50 [\d.]+ ms, p95 [\d.]+ ms, p99 [\d.]+ ms", out)
    assert "service: 46 batch requests for 46 training batches" in out  # one request per batch
    accuracy = float(re.search(r"test accuracy: ([\d.]+)%", out).group(1))
    assert accuracy > 90


def test_demo_refuses_bad_arguments_with_one_line(tmp_path):
    done = shardfeed("demo", "--epochs", "0", cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr.strip() == "shardfeed: error: --epochs must be at least 1"
