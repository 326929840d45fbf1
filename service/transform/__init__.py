"""Preprocessing in the service: the operator's transforms, run in a process pool.

    registry    the served transforms (``serve --transform NAME=MODULE:FACTORY``), loaded and described
    pool        the process pool that runs them (``TransformPool``), bounded, with a deadline per sample
    prepared    ``prepare``'s outputs, cached in the block cache under keys of their own
    batch       the transformed batch (``POST /v1/batch`` with ``"transform"``): cache, reads, pool, answer
    arrow       its answer: an Arrow IPC stream, a row per sample, a column per output

May import ``read``, ``datasets``, ``cache``, ``stores``, ``observe``, ``http`` and ``config``, and
the shared ``shardfeed.transforms`` and ``shardfeed.arrowipc``.
"""
