"""Preprocessing: the served transforms run off the event loop, their ``prepare`` outputs cached.

    pool.py       ``TransformPool``: the processes that load every served transform and run its jobs,
                  each job's deadline, a dead process replaced and its job retried once
    registry.py   the served transforms by name (``--transform NAME=package.module:factory``)
    prepared.py   the prepared cache: ``prepare``'s packed arrays in the block cache
    batch.py      a transformed batch: samples read, prepared or taken from the cache, run in the pool
    arrow.py      its answer: an Arrow IPC stream, a row per sample, a column per output

May import every room below it: ``plans``, ``read``, ``cluster``, ``datasets``, ``cache``, ``stores``,
``observe``, ``http``, ``config``; and ``shardfeed.transforms``, which the client shares.
"""
