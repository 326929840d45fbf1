"""Plans: a client announces the order it will read a dataset in; the service reads ahead
along it and evicts the block used farthest in the future (Belady) instead of LRU.

A plan is one reader's upcoming sample order. Kinds (how a client describes the order),
one module each, all ``Request`` model + ``order(request, samples) -> np.ndarray``:

    sampler   the sampler's parameters; the service computes the order with the client's
              own code (``shardfeed.client.sampling``), so both agree exactly
    indices   the order itself, sent in chunks

What the service does with the plans it holds (``registry.Plans``):

- learns each plan's position from the batches it serves (a batch whose samples lie at
  the plan's next positions moves it there);
- reads ahead of each position (``prefetch.Prefetcher``) within ``plan_ahead`` bytes;
- orders the cache's eviction candidates: blocks no plan reads again first (least
  recently used first), then the farthest next use first;
- tells the coalescer which missing blocks to fetch whole: only those whose samples the
  plans read before it would be evicted add up to half of it; for the others it reads
  just the samples' ranges (``ranges.py``) and caches nothing.

A plan may hold only a ``share`` of its reader's reads (a stream of a mixture: each
dataset of the mixture its own plan, 0.2 for a fifth of the mixture): its reader then
moves ``share`` positions per read, and the service compares plans' distances (horizon,
eviction, what to fetch whole, how far to read whole blocks ahead) in the reader's reads,
a position counting ``1 / share`` of them.

Without a plan the service behaves as before. Plans live in memory only, are bounded in
number (``max_plans``) and size (``max_plan_samples``), and expire ``plan_ttl`` seconds
after their last use: a client whose plan is gone registers it again.

With workers or replicas every process holds every plan: the one told relays it
(``api/plans.py``, ``peers.Cluster.relay``), and a restarted worker takes its siblings'
(``adopt.py``).

May import: ``read``, ``cluster``, ``datasets``, ``cache``, ``stores``, ``observe``, ``http``,
``config``, and the client's sampler (``shardfeed.client.sampling``).
"""

from __future__ import annotations

from types import ModuleType

from shardfeed.service.plans import indices, sampler

KINDS: dict[str, ModuleType] = {"sampler": sampler, "indices": indices}
"""Plan kinds by the name a request gives in ``kind``."""
