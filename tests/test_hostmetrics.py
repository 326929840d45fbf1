"""``service/hostmetrics.py``: workers' Prometheus figures summed into the host's, in process
(the wire, with a real ``serve --workers 2``, is in ``test_workers.py``)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from shardfeed.service.hostmetrics import summed
from shardfeed.service.metrics import Metrics


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
