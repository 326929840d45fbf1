"""A restarted worker takes its siblings' plans, so it reads ahead and evicts by them at once.

Every process of a host holds every plan (``api/plans.py`` relays each registration), but a
worker that restarts comes back with none, and its shards would be read with LRU until the
readers register their next epoch. On start, a worker asks its siblings in turn for the
plans they hold (``GET /v1/internal/plans``, then each plan's order as int64s) and holds
the same ones, under the same ids and shares, from the same positions. Best effort: when no sibling
answers (they are all starting too) the worker starts with no plans, as a lone one does.
"""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
import numpy as np

from shardfeed.service.cluster.peers import Cluster
from shardfeed.service.config import ServiceConfig
from shardfeed.service.datasets.dataset import Dataset
from shardfeed.service.http.errors import ApiError
from shardfeed.service.plans.registry import Plans, check_order

log = logging.getLogger("shardfeed.plans")


async def adopt(cluster: Cluster, plans: Plans, datasets: dict[str, Dataset], config: ServiceConfig) -> int:
    """Hold the plans of the first sibling worker that answers; how many were taken."""
    for node in range(len(cluster.workers)):
        if node == cluster.me:
            continue
        try:
            return await _adopt_from(cluster, node, plans, datasets, config)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError, KeyError, TypeError) as err:
            log.debug("worker %s has no plans to give: %s", cluster.workers[node].id, err)
    return 0


async def _adopt_from(cluster: Cluster, node: int, plans: Plans, datasets: dict[str, Dataset],
                      config: ServiceConfig) -> int:
    reader = cluster.reader(node)
    timeout = aiohttp.ClientTimeout(total=cluster.timeout + config.max_plan_samples * 8 / 50e6)

    async def get(path: str) -> bytes:
        async with reader.session().get(f"{reader.base}{path}", ssl=reader.ssl, headers=cluster.headers,
                                        timeout=timeout) as resp:
            resp.raise_for_status()
            return await resp.read()

    listed = json.loads(await get("/v1/internal/plans"))
    taken = 0
    for entry in listed:
        dataset = datasets.get(entry["dataset"])
        if dataset is None or entry["id"] in {plan.id for plan in plans.live()}:
            continue
        order = np.frombuffer(await get(f"/v1/internal/plans/{entry['dataset']}/{entry['id']}/order"),
                              dtype="<i8").astype(np.int64)
        try:  # the checks a registration gets: the indices, then the plan's size and count
            check_order(dataset, order)
            plans.check_room(len(order))
            plan = await asyncio.to_thread(plans.build, dataset, entry["kind"], order, entry["ttl"],
                                           entry["complete"], entry["fields"], entry["id"], entry.get("owner"),
                                           entry["share"])
            plan.position = min(int(entry["position"]), len(order))
            plans.insert(plan)
        except ApiError as err:
            log.warning("plan %s of worker %s not taken: %s", entry["id"], cluster.workers[node].id, err.message)
            continue
        taken += 1
    if taken:
        log.info("took %d plans from worker %s", taken, cluster.workers[node].id)
    return taken
