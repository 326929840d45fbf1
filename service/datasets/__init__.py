"""Datasets: what a served dataset is, and every format it is read and written in.

    dataset.py    ``Dataset``: a store, an index and the per-shard facts the read path needs,
                  opened from one listing that names every shard's version
    served.py     the datasets a service serves: added and removed at runtime, reopened when
                  the store changes
    agreement.py  whether an opened index describes its shards (their members' tar headers)
    index.py      ``Index``: sample -> (shard, offset, size), compact arrays in memory
    indexfile.py  ``index.parquet``: the on-disk format and its checks, WebDataset naming;
                  ``IndexStats``, what is computed once over a whole index
    mapped.py     one copy of an index per host: memory-mapped from a file its workers share
    layouts.py    how objects under a root become an index (tar shards or loose objects; a
                  peer's shards: ``peerindex.py``)
    tarscan.py    the tar layout: an index from the shards' headers, read with ranged reads
    autoindex.py  tar shards without an index, indexed when they open (kept in the store or here)
    peerindex.py  a peer's dataset (an ``index.json``): its index from its shards' headers
    arrowfooter.py
                  LitData's Arrow-footer chunks: each value's own extent, from the footer
    mds.py        MosaicML Streaming's ``index.json`` (layout ``mds``)
    litdata.py    LitData's ``index.json`` (layout ``litdata``)
    records.py    the columns of a peer's records, and where a record's header puts each
    shards.py     the shard writer (``shardfeed pack``/``seed`` and the embedded default use it)
    objects.py    GetBatch's catalogue: plain objects by name, files in tar shards by path
    moss.py       GetBatch's wire models, as the AIStore SDK sends and reads them

The dataset tools (``shardfeed/tools``) import these; nothing here imports the tools.
May import: ``cache`` (block identities), ``stores``, ``observe``, ``http``, ``config``.
"""
