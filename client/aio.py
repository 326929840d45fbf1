"""The asyncio client: ``await AsyncClient(url).get_batch("train", [17, 4, 9])``.

The twin of :mod:`.sync`, method for method (tensors included); what to send, where, and
what answers mean is shared in :mod:`.base`, :mod:`.routing` and :mod:`.samples`, so the
two differ only in how they wait. Batches travel over the batch transport's asyncio
driver (:mod:`.transport.aio`); everything else over httpx.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import closing, suppress
from typing import TYPE_CHECKING, Any, TypeVar

import httpx
import numpy as np

from shardfeed.retry import retry_async

from .base import (
    BATCH_PATH, ERROR_BODY_LIMIT, REGISTER_POLL, TRANSFORMS_PATH, BaseClient, PartRequest, PartsRefused, Pick,
    Registering, as_indices, checked, dataset_path, grouped, index_path, parse_json, parse_npy, placed, plan_chunks,
    plan_indices, plan_path, routing_path, sample_parser, sample_path, settled, transform_of, transport_error,
)
from .errors import ShardfeedError
from .routing import Via, merged
from .transport.aio import AsyncPool, AsyncResponse

T = TypeVar("T")
P = TypeVar("P")

if TYPE_CHECKING:
    import pyarrow as pa

    from .answers import Allocate, Regions
    from .tensors import Batch


class AsyncClient(BaseClient):
    """Asyncio client of a shardfeed service (keep-alive, retries, failover; see BaseClient).

    Every method of :class:`~shardfeed.client.Client`, as a coroutine (``iter_batch`` an async
    iterator), with the same arguments, answers and errors. Its connections belong to the
    event loop that opened them: using the client from another loop (or another process)
    opens new ones.
    """

    async def datasets(self) -> list:
        """``GET /v1/datasets`` (see :meth:`Client.datasets <.sync.Client.datasets>`)."""
        return await self._call("GET", dataset_path(), parse_json)

    async def info(self, dataset: str) -> dict:
        """``GET /v1/datasets/{name}`` (see ``Client.info``)."""
        return await self._call("GET", dataset_path(dataset), parse_json)

    async def transforms(self) -> list[dict]:
        """``GET /v1/transforms`` (see ``Client.transforms``)."""
        return (await self._call("GET", TRANSFORMS_PATH, parse_json))["transforms"]

    async def index_columns(self, dataset: str) -> list[str]:
        """``GET /v1/datasets/{name}/index``: its columns' names (see ``Client.index_columns``)."""
        return (await self._call("GET", index_path(dataset), parse_json))["columns"]

    async def index_column(self, dataset: str, column: str) -> np.ndarray:
        """``GET /v1/datasets/{name}/index/{column}``: one column of the index, a value per sample
        (see ``Client.index_column``)."""
        return await self._call("GET", index_path(dataset, column), parse_npy)

    async def shard_names(self, dataset: str) -> list[str]:
        """``GET /v1/datasets/{name}/index/shards``: the ``shard`` column's shards (see ``Client.shard_names``)."""
        return await self._call("GET", index_path(dataset, "shards"), parse_json)

    async def register_dataset(self, name: str, url: str, *, on_progress: Callable[[dict], None] | None = None,
                               timeout: float | None = None) -> dict:
        """``POST /v1/datasets`` until the dataset is served (see ``Client.register_dataset``)."""
        registering = Registering(name, url, on_progress, timeout)
        while True:
            answer = await self._call("POST", dataset_path(), registering.parse, json=registering.body)
            if (served := registering.served(answer)) is not None:
                return served
            await asyncio.sleep(REGISTER_POLL)

    async def remove_dataset(self, name: str) -> None:
        """``DELETE /v1/datasets/{name}`` (see ``Client.remove_dataset``)."""
        await self._call("DELETE", dataset_path(name), lambda r: None)

    async def register_plan(self, dataset: str, plan: dict) -> dict:
        """``POST /v1/datasets/{name}/plans``, a long ``indices`` plan in chunks (see ``Client.register_plan``)."""
        first, chunks = plan_chunks(plan)
        answer = await self._call("POST", plan_path(dataset), parse_json, json=first)
        try:
            for indices, complete in chunks:
                answer = await self.extend_plan(dataset, answer["id"], indices, complete)
        except BaseException:
            with suppress(ShardfeedError):
                await self.delete_plan(dataset, answer["id"])
            raise
        return answer

    async def extend_plan(self, dataset: str, plan_id: str, indices: Sequence[int], complete: bool = True) -> dict:
        """``POST /v1/datasets/{name}/plans/{id}``: the next chunk of a plan (see ``Client.extend_plan``)."""
        return await self._call("POST", plan_path(dataset, plan_id), parse_json,
                                json={"indices": plan_indices(indices), "complete": complete})

    async def plan(self, dataset: str, plan_id: str) -> dict:
        """``GET /v1/datasets/{name}/plans/{id}`` (see ``Client.plan``)."""
        return await self._call("GET", plan_path(dataset, plan_id), parse_json)

    async def delete_plan(self, dataset: str, plan_id: str) -> None:
        """``DELETE /v1/datasets/{name}/plans/{id}``."""
        await self._call("DELETE", plan_path(dataset, plan_id), lambda r: None)

    async def get_field(self, dataset: str, index: int, field: str) -> bytes:
        """The raw bytes of one field of sample ``index`` (sent to its owner, with routing)."""
        via = await self._via(dataset, index)
        return await self._call("GET", sample_path(dataset, index, field), lambda r: r.content, via=via)

    async def get(self, dataset: str, index: int, fields: Sequence[str] | None = None) -> dict:
        """Sample ``index`` as a dict (see ``Client.get``)."""
        if fields is not None:
            return (await self.get_batch(dataset, [index], fields))[0]
        via = await self._via(dataset, index)
        return await self._call("GET", sample_path(dataset, index), sample_parser(dataset, index), via=via)

    async def get_batch(self, dataset: str, indices: Sequence[int], fields: Sequence[str] | None = None,
                        *, continue_on_error: bool = False, stream: str | None = None) -> list[dict]:
        """The samples at ``indices``, in order, in one request (see ``Client.get_batch``)."""
        return [s async for s in self.iter_batch(dataset, indices, fields, continue_on_error=continue_on_error,
                                                 stream=stream)]

    async def iter_batch(self, dataset: str, indices: Sequence[int], fields: Sequence[str] | None = None,
                         *, continue_on_error: bool = False, stream: str | None = None) -> AsyncIterator[dict]:
        """Yield the samples at ``indices`` as they arrive (see ``Client.iter_batch``)."""
        requests = await self._batch(dataset, indices, fields, continue_on_error, stream=stream)
        if len(requests) == 1:
            async for sample in self._stream(requests[0]):
                yield sample
            return
        for sample in merged([r.part for r in requests], await self._each_part(requests, self._collect)):
            yield sample

    async def get_batch_tensors(self, dataset: str, indices: Sequence[int], fields: Sequence[str] | None = None,
                                *, continue_on_error: bool = False, shared: bool = False,
                                stream: str | None = None, transform: str | None = None, seed: int = 0,
                                epoch: int = 0) -> Batch:
        """The samples at ``indices`` as one :class:`~.tensors.Batch` (see
        ``Client.get_batch_tensors``, ``transform`` included). Asyncio's streams read into a buffer of their own, so
        each piece of the answer is copied into the batch's buffer once as it arrives."""
        from .tensors import allocator, batch_of

        requests = await self._batch(dataset, indices, fields, continue_on_error, whole=True, stream=stream,
                                     transform=transform_of(transform, seed, epoch, fields))
        return await retry_async(lambda: self._whole(requests, allocator(shared), batch_of), backoff=self.backoff,
                                 retryable=self._verdict)

    async def get_mixed_batch(self, picks: Sequence[Pick], *, output: str = "samples",
                              continue_on_error: bool = False, shared: bool = False) -> list[dict] | Batch:
        """A batch of several datasets' samples, each pick's at its positions (see ``Client.get_mixed_batch``)."""
        if output not in ("samples", "tensors"):
            raise ValueError(f"a mixed batch's output is 'samples' or 'tensors', not {output!r}")
        requests = [request for pick in picks for request in placed(
            await self._batch(pick.dataset, pick.indices, pick.fields, continue_on_error, output == "tensors",
                              pick.stream), pick.positions)]
        if output == "samples":
            return merged([r.part for r in requests], await self._each_part(requests, self._collect))
        from .tensors import allocator, batch_of

        return await retry_async(lambda: self._mixed(requests, allocator(shared), batch_of), backoff=self.backoff,
                                 retryable=self._verdict)

    async def get_batch_arrow(self, dataset: str, indices: Sequence[int], fields: Sequence[str] | None = None,
                              *, continue_on_error: bool = False, shared: bool = False,
                              stream: str | None = None) -> pa.Table:
        """The samples at ``indices`` as a ``pyarrow.Table`` over the buffer read (see
        ``Client.get_batch_arrow``)."""
        from .arrow import reading

        allocate, build = reading(shared)
        requests = await self._batch(dataset, indices, fields, continue_on_error, whole=True, stream=stream)
        return await retry_async(lambda: self._whole(requests, allocate, build), backoff=self.backoff,
                                 retryable=self._verdict)

    async def load_routing(self, dataset: str) -> None:
        """Fetch ``dataset``'s routing table if one is due (see ``Client.load_routing``)."""
        if self.router.due(dataset):
            self.router.load(dataset, await self._routing_table(dataset))

    async def _routing_table(self, dataset: str) -> dict | None:
        """``dataset``'s routing table; ``None`` if it cannot be had (a service without routing)."""
        try:
            return await self._call("GET", routing_path(dataset), parse_json, via=self._from_teller(dataset))
        except ShardfeedError:
            return None

    async def aclose(self) -> None:
        """Close the connections of this process and loop (the client stays usable)."""
        owner = self._loop_owner()
        if (http := self._disown("_http", owner)) is not None:
            await http.aclose()
        if (pool := self._disown("_pool", owner)) is not None:
            pool.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- a batch: its requests, each part's answer read as samples or into a tensor buffer --

    async def _batch(self, dataset: str, indices: Sequence[int], fields: Sequence[str] | None,
                     continue_on_error: bool, whole: bool = False, stream: str | None = None,
                     transform: dict | None = None) -> list[PartRequest]:
        indices = as_indices(indices)
        if indices:
            await self.load_routing(dataset)
        return self._requests(dataset, indices, fields, continue_on_error, whole, stream, transform)

    async def _open(self, request: PartRequest) -> AsyncResponse:
        """Send one try of ``request``; its answer once the head arrived (``Client._open``)."""
        pool = self._wire()  # first: a new pool starts the rotation at a random URL
        base, body = request.next_try()
        response = await pool.post(base, BATCH_PATH, body, self.headers, head_timeout=request.head_timeout)
        if response.status >= 400:
            with closing(response):
                error = request.error(response, await response.read(ERROR_BODY_LIMIT))
            if request.refused(error):  # a service without the Arrow format: ask it for tar
                return await self._open(request)
            raise error
        request.answered(response.headers)
        return response

    async def _stream(self, request: PartRequest) -> AsyncIterator[dict]:
        """The samples of one request as they arrive (see ``Client._stream``)."""
        while True:
            try:
                with closing(await self._open(request)) as response:
                    async for chunk in response.aiter_bytes():
                        for sample in request.reader.feed(chunk):
                            yield sample
                    for sample in request.reader.finish():
                        yield sample
                    return
            except Exception as exc:
                await asyncio.sleep(request.wait(exc))

    async def _collect(self, request: PartRequest) -> list[dict]:
        return [s async for s in self._stream(request)]

    async def _whole(self, requests: list[PartRequest], allocate: Allocate,
                     build: Callable[[list[PartRequest], Regions], T]) -> T:
        """One try of a batch read whole (see ``Client._whole``)."""
        from .answers import regions_for

        responses = await self._each_part(requests, self._open, AsyncResponse.close)
        try:
            regions = regions_for(responses, allocate)
            await self._each_part(list(zip(responses, regions.regions)), lambda pair: pair[0].read_into(pair[1]))
        finally:
            for response in responses:
                response.close()
        return build(requests, regions)

    async def _mixed(self, requests: list[PartRequest], allocate: Allocate,
                     build: Callable[[list[PartRequest], Regions], T]) -> T:
        """One try of a mixed batch read whole, a request per owner (see ``Client._mixed``)."""
        try:
            return await self._whole(grouped(self, requests), allocate, build)
        except PartsRefused:
            return await self._whole(requests, allocate, build)

    async def _each_part(self, parts: Sequence[P], work: Callable[[P], Awaitable[T]],
                         undo: Callable[[T], object] = lambda _: None) -> list[T]:
        """``work(part)`` for every part at once, as tasks; if any fails, or this task is
        cancelled, ``undo`` the others' results, then raise (see ``Client._each_part``)."""
        tasks = [asyncio.ensure_future(work(part)) for part in parts]
        if not tasks:
            return []
        stop: BaseException | None = None
        try:
            await asyncio.wait(tasks)
        except BaseException as exc:  # cancelled: so are the parts, once they have ended
            stop = exc
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks)
        outcomes = [_outcome(task) for task in tasks]
        return settled(outcomes if stop is None else [(None, stop), *outcomes], undo)

    # -- the other requests, over httpx --

    @staticmethod
    def _loop_owner() -> tuple:
        return os.getpid(), asyncio.get_running_loop()

    def _session(self) -> httpx.AsyncClient:
        return self._own("_http", self._loop_owner(), lambda: httpx.AsyncClient(**self._session_options()))

    def _wire(self) -> AsyncPool:
        """This process's and event loop's batch connections."""
        return self._own("_pool", self._loop_owner(), lambda: AsyncPool(**self._pool_options()))

    async def _via(self, dataset: str, index: int) -> Via:
        """Where a per-sample request goes (see ``Client._via``)."""
        await self.load_routing(dataset)
        return self._to_owner(dataset, index)

    async def _call(self, method: str, path: str, parse: Callable[[httpx.Response], T], json: Any = None,
                    via: Via | None = None) -> T:
        """One request with retries (see ``Client._call``)."""
        return await retry_async(lambda: self._once(method, path, parse, json, via), backoff=self.backoff,
                                 retryable=self._verdict)

    async def _once(self, method: str, path: str, parse: Callable[[httpx.Response], T], json: Any,
                    via: Via | None) -> T:
        http = self._session()  # first: a new session starts the rotation at a random URL
        base = (via or self.endpoints).pick()
        try:
            response = await http.request(method, base + path, json=json)
        except httpx.TransportError as exc:
            raise transport_error(base, exc) from None
        return checked(response, base + path, parse)


def _outcome(task: asyncio.Future) -> tuple[Any, BaseException | None]:
    """An ended task's ``(result, failure)``."""
    if task.cancelled():
        return None, asyncio.CancelledError()
    return (None, task.exception()) if task.exception() is not None else (task.result(), None)
