"""Observability: what one service process counts, and the recent history the status page shows.

    metrics.py  ``Metrics``: Prometheus counters and gauges of one process (a private registry)
    stats.py    ``StatsRecorder``: rates per second and latency percentiles over recent seconds
    activity.py ``Activity``: when the service last had a data request (``--idle-exit``)

May import: ``http``, ``config``.
"""
