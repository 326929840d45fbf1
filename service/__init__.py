"""The shardfeed service, one room per stage of a request, entry on top.

    server.py   ``shardfeed serve``: options -> ``ServiceConfig`` -> datasets, cache, cluster -> the app under uvicorn
    api/        the HTTP routes, one module per group, and what they share (``State``, admission)
    transform/  preprocessing: the served transforms, their process pool, the prepared cache, the
                transformed batch
    plans/      announced read orders: read-ahead along them, eviction by next use
    read/       the read path: batch streams, tar framing, the warm path, per-sample batching,
                the coalescer, fetches of missing blocks, range reads, the planner
    cluster/    replicas and sibling workers: ownership, health, membership, the host's sums
    datasets/   a served dataset: its index (in memory, on disk), layouts, the shard writer,
                the GetBatch catalogue and wire models
    cache/      the block cache on disk, its slabs, the RAM tier, siblings' slabs
    stores/     object storage behind one ``Store`` interface (file://, s3://), hedged reads
    observe/    Prometheus metrics and their recent history (the status page's figures)
    http/       the HTTP/1.1 protocol the server runs and the error answers
    config.py   every knob, with its default and why

A room imports only rooms listed below it here (``tests/service/test_rooms.py`` checks it),
the shared low modules ``shardfeed.tar``, ``shardfeed.retry`` and ``shardfeed.sizes``, and
``plans/`` the client's sampler (``shardfeed.client.sampling``: both compute one order). Nothing
here imports the dataset tools (``shardfeed.tools``) or the benchmarks.
"""
