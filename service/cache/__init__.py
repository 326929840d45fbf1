"""The cache: shard bytes kept on this node in aligned, checksummed blocks.

    disk.py       ``BlockCache``: the bounded block cache on local disk (NVMe), crash-safe
    catalog.py    which blocks it holds: a few dozen bytes each in memory, records on disk
    names.py      ``BlockKey`` and block file names (dataset and shard versions digested)
    blockfile.py  one block file: its format, the one way of writing it and of reading it
    memtier.py    ``MemoryTier``: whole verified blocks in RAM in front of the disk
    siblings.py   sibling workers' block files, read straight from their directories

May import: ``stores``, ``observe``, ``http``, ``config``.
"""
