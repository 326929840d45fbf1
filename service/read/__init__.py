"""The read path: from the members a request wants to the bytes it sends, in order.

    stream.py     a batch as one stream: groups read ahead while the oldest is sent
    framing.py    tar framing of a batch: names, headers, the shards' own ranges, padding
    arrow.py      Arrow framing of a batch: a record batch per group, its metadata from the sizes
    warm.py       the warm path: a group's blocks all held in RAM, and where each member lies
    fields.py     where a record's fields lie (MDS, LitData), learnt from its header once
    samples.py    per-sample GETs gathered into batches
    coalescer.py  every read of member bytes: RAM, disk, sibling files, owners, the store
    fetcher.py    fetches of missing blocks (singleflight, merged, bounded) into the cache
    ranges.py     members read as exact ranges, without their blocks (plans decide)
    slots.py      who reads from the store next: needed reads before reads ahead, tenants in turn
    planner.py    members -> block pieces -> merged store reads (pure functions)

May import: ``cluster``, ``datasets``, ``cache``, ``stores``, ``observe``, ``http``, ``config``.
"""
