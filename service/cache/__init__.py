"""The cache: shard bytes kept on this node in aligned, checksummed blocks.

    disk.py       ``BlockCache``: the bounded block cache on local disk (NVMe), crash-safe
    catalog.py    which blocks it holds and where: a few dozen bytes each in memory, records on disk
    slabs.py      where blocks live: slots in a few large files, one per slot size, checked on read
    names.py      ``BlockKey``: a block's dataset, shard version and number
    hints.py      where a worker's blocks are, published for its siblings in a shared file
    memtier.py    ``MemoryTier``: whole verified blocks in RAM in front of the disk
    siblings.py   sibling workers' blocks, read straight from their slabs

May import: ``stores``, ``observe``, ``http``, ``config``.
"""
