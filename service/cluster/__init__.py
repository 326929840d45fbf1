"""The cluster: replicas and this host's workers, who owns which shard, and the host's sums.

    peers.py         ``Cluster``: rendezvous ownership (host, then worker), health, relays
    peerreader.py    ``PeerReader``: the link to one other node, its sub-batch reads
    membership.py    who the members are: the replicas' source, the sibling workers; ``build_cluster``
    sources.py       where the replicas are listed: ``--peers``, ``--peers-from file:|dns:|dns+srv:``, followed
    workers.py       ``serve --workers N``: the supervisor and its workers' sockets
    hostmetrics.py   the whole host's ``/metrics`` on the public port
    hoststats.py     the whole host's status figures on the public port
    keptcounters.py  a worker's counters kept in files across its restarts

May import: ``datasets``, ``cache``, ``stores``, ``observe``, ``http``, ``config``.
"""
