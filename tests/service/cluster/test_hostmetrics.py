"""``service/cluster/hostmetrics.py``: workers' Prometheus figures summed into the host's, in process
(the wire, with a real ``serve --workers 2``, is in ``test_workers.py``)."""

from __future__ import annotations

import signal
import subprocess
import sys

from prometheus_client.parser import text_string_to_metric_families

from shardfeed.service.cluster.hostmetrics import summed
from shardfeed.service.observe.metrics import Metrics


def samples(text: bytes) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text.decode()) for s in family.samples}


def test_counters_and_histograms_add_up_and_a_host_view_gauge_takes_the_lowest():
    workers = [Metrics() for _ in range(3)]
    for n, metrics in enumerate(workers, 1):
        metrics.samples.inc(10 * n)
        metrics.store_requests.inc(n)
        metrics.batch_latency.observe(0.002 * n)
        metrics.peer_requests.labels("w0", "worker", "ok").inc(n)
        metrics.cache_bytes.set(1000 * n)
        metrics.peers_up.set(4 - n)
    got = samples(summed(workers[0], [w.render().decode() for w in workers[1:]]))
    assert got[("shardfeed_samples_served_total", ())] == 60
    assert got[("shardfeed_peer_requests_total", (("kind", "worker"), ("peer", "w0"), ("status", "ok")))] == 6
    assert got[("shardfeed_batch_seconds_count", ())] == 3
    assert got[("shardfeed_batch_seconds_bucket", (("le", "0.0025"),))] == 1  # 0.002 only
    assert got[("shardfeed_batch_seconds_bucket", (("le", "0.01"),))] == 3
    assert got[("shardfeed_cache_bytes", ())] == 6000
    assert got[("shardfeed_peers_up", ())] == 1
    assert got[("shardfeed_coalescing_factor", ())] == 10  # 60 samples over 6 store reads, not a sum of factors
    assert (got[("shardfeed_workers", ())], got[("shardfeed_workers_reporting", ())]) == (3, 3)


def test_a_silent_or_unreadable_sibling_is_left_out_and_counted_as_such():
    own, other = Metrics(), Metrics()
    own.samples.inc(5)
    other.samples.inc(7)
    got = samples(summed(own, [other.render().decode(), None, "not {prometheus text"]))
    assert got[("shardfeed_samples_served_total", ())] == 12
    assert (got[("shardfeed_workers", ())], got[("shardfeed_workers_reporting", ())]) == (4, 2)



WORKER = """
import os, signal
from pathlib import Path
from shardfeed.service.cluster.keptcounters import keep_counters, restore_series
from shardfeed.service.observe.metrics import Metrics
keep_counters(Path(DIRECTORY))
metrics = Metrics()
restore_series(metrics, Path(DIRECTORY))
print(metrics.render().decode(), flush=True)
CODE
os.kill(os.getpid(), signal.SIGKILL)
"""


def run_worker(directory, code: str = "") -> bytes:
    """A process that keeps its counters in ``directory`` as a worker does, runs ``code`` on
    its ``metrics`` and is SIGKILLed (nothing flushed on the way out); its metrics as it started."""
    script = WORKER.replace("DIRECTORY", repr(str(directory))).replace("CODE", code)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()
    return done.stdout


def test_a_killed_workers_counters_are_kept_and_its_successor_counts_on_with_every_series(tmp_path):
    kept = tmp_path / "w1.counters"
    run_worker(kept, "metrics.samples.inc(7); metrics.batch_latency.observe(0.002)\n"
                     "metrics.peer_requests.labels('w0', 'worker', 'ok').inc(3); metrics.cache_bytes.set(500)")
    own = Metrics()
    own.samples.inc(5)
    own.cache_bytes.set(100)
    # Silent (down) or unreadable: its counters come from its files, its gauges are left out.
    for text in (None, "not {prometheus text"):
        got = samples(summed(own, [text], [kept]))
        assert got[("shardfeed_samples_served_total", ())] == 12
        assert got[("shardfeed_peer_requests_total", (("kind", "worker"), ("peer", "w0"), ("status", "ok")))] == 3
        assert got[("shardfeed_batch_seconds_bucket", (("le", "0.0025"),))] == 1
        assert got[("shardfeed_batch_seconds_count", ())] == 1
        assert got[("shardfeed_cache_bytes", ())] == 100
        assert (got[("shardfeed_workers", ())], got[("shardfeed_workers_reporting", ())]) == (2, 1)
    # The successor starts where it was killed, labeled series included, before it uses them;
    # its gauges start afresh.
    started = samples(run_worker(kept, "metrics.samples.inc(1)"))
    assert started[("shardfeed_samples_served_total", ())] == 7
    assert started[("shardfeed_peer_requests_total", (("kind", "worker"), ("peer", "w0"), ("status", "ok")))] == 3
    assert started[("shardfeed_batch_seconds_count", ())] == 1
    assert started[("shardfeed_cache_bytes", ())] == 0
    assert samples(summed(own, [None], [kept]))[("shardfeed_samples_served_total", ())] == 13
    # A directory that holds no counters (a worker that never started) adds nothing.
    assert samples(summed(own, [None], [tmp_path / "none"]))[("shardfeed_samples_served_total", ())] == 5
    # A damaged file is left out, not a failed scrape.
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "counter_worker.db").write_bytes((64).to_bytes(4, "little") + bytes(4) + b"\xff" * 56)
    assert samples(summed(own, [None], [damaged]))[("shardfeed_samples_served_total", ())] == 5
