"""The asyncio client: ``await AsyncClient(url).get_batch("train", [17, 4, 9])``.

The twin of :mod:`.sync`, line for line; what to send and what answers mean is shared
in :mod:`.http` and :mod:`.samples`. Batches travel over the lean HTTP/1.1 transport the
blocking client uses, in its asyncio form (:mod:`.aiowire`); everything else over httpx.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TypeVar

import httpx

from shardfeed.retry import retry_async

from .aiowire import AsyncPool, AsyncResponse
from .errors import ShardfeedConnectionError, ShardfeedError
from .http import (
    ERROR_BODY_LIMIT, ROUTING_HEADER, BaseClient, Via, as_indices, batch_body, dataset_path, merge_order,
    parse_json, routing_path, sample_path, status_error, transport_error,
)
from .samples import BatchReader

T = TypeVar("T")


class AsyncClient(BaseClient):
    """Asyncio client of a shardfeed service (keep-alive, retries, failover; see BaseClient).

    Its connections belong to the event loop that opened them: using the client from
    another loop (or another process) opens new ones. Batches travel over a lean HTTP/1.1
    transport of their own (:mod:`.aiowire`), everything else over httpx.
    """

    async def datasets(self) -> list:
        """``GET /v1/datasets``: the datasets the service serves."""
        return await self._call("GET", dataset_path(), parse_json)

    async def info(self, dataset: str) -> dict:
        """``GET /v1/datasets/{name}``: ``{"name", "url", "samples", "shards", "bytes", "fields"}``."""
        return await self._call("GET", dataset_path(dataset), parse_json)

    async def get_field(self, dataset: str, index: int, field: str) -> bytes:
        """The raw bytes of one field of sample ``index`` (sent to its owner, with routing)."""
        return await self._call("GET", sample_path(dataset, index, field), lambda r: r.content,
                                via=await self._via(dataset, index))

    async def get(self, dataset: str, index: int, fields: Sequence[str] | None = None) -> dict:
        """Sample ``index`` as a dict (see :meth:`shardfeed.client.Client.get`)."""
        if fields is not None:
            return (await self.get_batch(dataset, [index], fields))[0]

        def parse(response: httpx.Response) -> dict:
            reader = BatchReader(dataset, [index], url=str(response.url))
            return (reader.feed(response.content) + reader.finish())[0]

        return await self._call("GET", sample_path(dataset, index), parse, via=await self._via(dataset, index))

    async def get_batch(self, dataset: str, indices: Sequence[int], fields: Sequence[str] | None = None,
                        *, continue_on_error: bool = False) -> list[dict]:
        """The samples at ``indices``, in order, in one request (see ``Client.get_batch``)."""
        return [s async for s in self.iter_batch(dataset, indices, fields,
                                                 continue_on_error=continue_on_error)]

    async def iter_batch(self, dataset: str, indices: Sequence[int], fields: Sequence[str] | None = None,
                         *, continue_on_error: bool = False) -> AsyncIterator[dict]:
        """Yield the samples at ``indices`` as they arrive (see ``Client.iter_batch``)."""
        indices = as_indices(indices)
        if not indices:
            return
        if self.router.due(dataset):
            self.router.load(dataset, await self._routing_table(dataset))
        parts = self.router.split(dataset, indices)
        if len(parts) == 1:
            async for sample in self._stream(dataset, indices, fields, continue_on_error, parts[0].owner):
                yield sample
            return
        answers = [asyncio.ensure_future(self._collect(dataset, part.indices, fields, continue_on_error, part.owner))
                   for part in parts]
        try:
            for part, row in merge_order(parts):
                yield (await answers[part])[row]
        finally:
            for answer in answers:
                answer.cancel()
            await asyncio.gather(*answers, return_exceptions=True)

    async def _collect(self, dataset: str, indices: list[int], fields: Sequence[str] | None,
                       continue_on_error: bool, owner: str | None) -> list[dict]:
        return [s async for s in self._stream(dataset, indices, fields, continue_on_error, owner)]

    async def _stream(self, dataset: str, indices: list[int], fields: Sequence[str] | None,
                      continue_on_error: bool, owner: str | None) -> AsyncIterator[dict]:
        """The samples of one request, sent to ``owner`` first (see ``Client._stream``)."""
        reader = BatchReader(dataset, indices, fields)
        via = Via(self.endpoints, self.router, dataset, owner)
        while True:
            base, response, chunks, ready = await retry_async(
                lambda: self._open_batch(reader, fields, continue_on_error, via),
                backoff=self.backoff, retryable=self._verdict)
            try:
                for sample in ready:
                    yield sample
                if chunks is None:
                    return
                try:
                    async for chunk in chunks:
                        for sample in reader.feed(chunk):
                            yield sample
                    for sample in reader.finish():
                        yield sample
                    return
                except ShardfeedConnectionError as exc:
                    error = exc
                # The stream broke after delivering samples: ask for the rest at once.
                if not self._verdict(error):
                    raise error
            finally:
                response.close()

    async def _routing_table(self, dataset: str) -> dict | None:
        try:
            return await self._call("GET", routing_path(dataset), parse_json,
                                    Via(self.endpoints, self.router, dataset, self.router.teller(dataset)))
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
        if self.router.due(dataset):
            self.router.load(dataset, await self._routing_table(dataset))
        return Via(self.endpoints, self.router, dataset, self.router.owner(dataset, index))

    async def _call(self, method: str, path: str, parse: Callable[[httpx.Response], T], via: Via | None = None) -> T:
        return await retry_async(lambda: self._once(method, path, parse, via), backoff=self.backoff,
                                 retryable=self._verdict)

    async def _once(self, method: str, path: str, parse: Callable[[httpx.Response], T], via: Via | None = None) -> T:
        http = self._session()  # first: a new session starts the rotation at a random URL
        base = self.endpoints.pick() if via is None else via.pick()
        url = base + path
        try:
            response = await http.request(method, url)
        except httpx.TransportError as exc:
            raise transport_error(base, exc) from None
        if response.status_code >= 400:
            raise status_error(response.status_code, response.headers, response.content, url)
        return parse(response)

    async def _open_batch(self, reader: BatchReader, fields: Sequence[str] | None, continue_on_error: bool,
                          via: Via) -> tuple[str, AsyncResponse, AsyncIterator[bytes] | None, list[dict]]:
        """Send the batch request for the samples not yet delivered; read until one arrives
        (see ``Client._open_batch``)."""
        pool = self._wire()
        base = via.pick()
        url = base + "/v1/batch"
        reader.restart(url)
        body = batch_body(reader.dataset, list(reader.remaining()), fields, continue_on_error)
        response = await pool.post(base, "/v1/batch", body, self.headers)
        try:
            if response.status >= 400:
                raise status_error(response.status, response.headers, await response.read(ERROR_BODY_LIMIT), url)
            self.router.saw(reader.dataset, response.headers.get(ROUTING_HEADER), base)
            chunks = response.aiter_bytes()
            ready: list[dict] = []
            async for chunk in chunks:
                ready += reader.feed(chunk)
                if ready:
                    return base, response, chunks, ready
            return base, response, None, reader.finish()
        except BaseException:
            response.close()
            raise
