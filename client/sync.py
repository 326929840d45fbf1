"""The blocking client: ``Client(url).get_batch("train", [17, 4, 9])``."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

import httpx

from shardfeed.retry import retry_sync

from .errors import ShardfeedConnectionError, ShardfeedError
from .http import (
    ERROR_BODY_LIMIT, ROUTING_HEADER, BaseClient, Part, Via, announced_length, as_indices, batch_body, dataset_path,
    merge_order, parse_json, plan_path, routing_path, sample_path, status_error, transport_error,
)
from .samples import BatchReader
from .wire import Pool, Response

if TYPE_CHECKING:
    from .tensors import Batch

T = TypeVar("T")


class Client(BaseClient):
    """Blocking client of a shardfeed service (keep-alive, retries, failover; see BaseClient).

    Safe to share between threads, and to hand to DataLoader worker processes. Batches
    travel over a lean HTTP/1.1 transport of their own (:mod:`.wire`), everything else
    over httpx.
    """

    # This process's threads for the parts of routed batches, as (pid, executor): made on
    # first use in each process (see _own), never pickled.
    _threads: tuple[int, ThreadPoolExecutor] | None = None

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state.pop("_threads", None)
        return state

    def datasets(self) -> list:
        """``GET /v1/datasets``: the datasets the service serves."""
        return self._call("GET", dataset_path(), parse_json)

    def info(self, dataset: str) -> dict:
        """``GET /v1/datasets/{name}``: ``{"name", "url", "samples", "shards", "bytes", "fields"}``."""
        return self._call("GET", dataset_path(dataset), parse_json)

    def register_dataset(self, name: str, url: str, *, on_progress: Callable[[dict], None] | None = None,
                         timeout: float | None = None) -> dict:
        """``POST /v1/datasets``: serve the dataset at ``url`` as ``name`` (tar shards without an
        index are indexed first: ``on_progress`` gets each 202's ``registering``, about once a
        second). The dataset's info once served; ``ShardfeedError`` 409 when ``name`` is taken
        by another URL, ``TimeoutError`` after ``timeout`` seconds (default: none)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            answer = self._call("POST", dataset_path(), lambda r: (r.status_code, parse_json(r)),
                                json={"name": name, "url": url})
            if answer[0] != 202:
                return answer[1]["dataset"]
            if on_progress is not None:
                on_progress(answer[1]["registering"])
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"dataset {name!r} ({url}) not registered within {timeout:g} s")
            time.sleep(1.0)

    def remove_dataset(self, name: str) -> None:
        """``DELETE /v1/datasets/{name}``: serve it no more."""
        self._call("DELETE", dataset_path(name), lambda r: None)

    def register_plan(self, dataset: str, plan: dict) -> dict:
        """``POST /v1/datasets/{name}/plans``: announce an upcoming order (see ``client/plans.py``)."""
        return self._call("POST", plan_path(dataset), parse_json, json=plan)

    def plan(self, dataset: str, plan_id: str) -> dict:
        """``GET /v1/datasets/{name}/plans/{id}``: its length, position and time left."""
        return self._call("GET", plan_path(dataset, plan_id), parse_json)

    def delete_plan(self, dataset: str, plan_id: str) -> None:
        """``DELETE /v1/datasets/{name}/plans/{id}``."""
        self._call("DELETE", plan_path(dataset, plan_id), lambda r: None)

    def get_field(self, dataset: str, index: int, field: str) -> bytes:
        """The raw bytes of one field of sample ``index`` (sent to its owner, with routing)."""
        return self._call("GET", sample_path(dataset, index, field), lambda r: r.content,
                          via=self._via(dataset, index))

    def get(self, dataset: str, index: int, fields: Sequence[str] | None = None) -> dict:
        """Sample ``index`` as a dict ``{"__key__", "__index__", "<field>": bytes, ...}``.

        Without ``fields`` this is the per-sample ``GET``; with them, a batch of one.
        """
        if fields is not None:
            return self.get_batch(dataset, [index], fields)[0]

        def parse(response: httpx.Response) -> dict:
            reader = BatchReader(dataset, [index], url=str(response.url))
            return (reader.feed(response.content) + reader.finish())[0]

        return self._call("GET", sample_path(dataset, index), parse, via=self._via(dataset, index))

    def get_batch(self, dataset: str, indices: Sequence[int], fields: Sequence[str] | None = None,
                  *, continue_on_error: bool = False) -> list[dict]:
        """The samples at ``indices``, in that order, fetched with one ``POST /v1/batch``.

        ``fields`` limits the fields returned (default: all). With ``continue_on_error``
        a sample the service cannot serve comes back as
        ``{"__key__": None, "__index__": i, "__missing__": True}`` instead of failing
        the whole batch.
        """
        return list(self.iter_batch(dataset, indices, fields, continue_on_error=continue_on_error))

    def iter_batch(self, dataset: str, indices: Sequence[int], fields: Sequence[str] | None = None,
                   *, continue_on_error: bool = False) -> Iterator[dict]:
        """Like :meth:`get_batch`, but yields each sample as soon as it has arrived.

        If the connection breaks mid-stream, the samples not yet yielded are asked for
        again (from another URL, if there are several); nothing is yielded twice. With
        routing (see :class:`~shardfeed.client.http.Router`), each owner's part of the
        batch is sent to it at once, and the samples are yielded in the order asked.
        """
        indices = as_indices(indices)
        if not indices:
            return
        self.load_routing(dataset)
        parts = self.router.split(dataset, indices)
        if len(parts) == 1:
            yield from self._stream(dataset, indices, fields, continue_on_error, parts[0].owner)
            return
        answers = [self._part_threads().submit(lambda part=part: list(self._stream(
            dataset, part.indices, fields, continue_on_error, part.owner))) for part in parts[1:]]
        first = list(self._stream(dataset, parts[0].indices, fields, continue_on_error, parts[0].owner))
        for part, row in merge_order(parts):
            yield first[row] if part == 0 else answers[part - 1].result()[row]

    def get_batch_tensors(self, dataset: str, indices: Sequence[int], fields: Sequence[str] | None = None,
                          *, continue_on_error: bool = False, shared: bool = False) -> Batch:
        """The samples at ``indices`` as one :class:`~.tensors.Batch`: every byte in one
        ``torch.uint8`` buffer (in shared memory with ``shared``, as a DataLoader worker wants
        it), read there straight from the socket; ``batch["jpg"][i]`` is a view of it. Needs
        torch. The arguments and errors are :meth:`get_batch`'s; a broken answer is asked for
        again whole (the buffer is the answer), routed parts at once, as :meth:`iter_batch` does.
        """
        from .tensors import Batch, allocate

        indices = as_indices(indices)
        if not indices:
            return Batch.of(allocate(0, shared)[0], [[]], [0])
        self.load_routing(dataset)
        parts = self.router.split(dataset, indices)
        vias = [Via(self.endpoints, self.router, dataset, part.owner) for part in parts]
        return retry_sync(lambda: self._tensor_batch(dataset, parts, vias, fields, continue_on_error, shared),
                          backoff=self.backoff, retryable=self._verdict)

    def _tensor_batch(self, dataset: str, parts: list[Part], vias: list[Via], fields: Sequence[str] | None,
                      continue_on_error: bool, shared: bool) -> Batch:
        """One try of :meth:`get_batch_tensors`: every part's answer opened, then read into its
        stretch of one buffer, all parts at once."""
        from .tensors import GUESS, Batch, Regions

        readers = [BatchReader(dataset, part.indices, fields) for part in parts]
        responses = self._each_part(len(parts), lambda k: self._open_part(readers[k], vias[k], fields,
                                                                          continue_on_error), lambda r: r.close())
        try:
            regions = Regions([announced_length(r.headers, GUESS) for r in responses], shared)
            self._each_part(len(parts), lambda k: responses[k].read_into(regions.regions[k]))
        finally:
            for response in responses:
                response.close()
        samples = [reader.spans(region.data()) for reader, region in zip(readers, regions.regions)]
        buffer, lease, starts = regions.joined()
        return Batch.of(buffer, samples, starts.tolist(), merge_order(parts) if len(parts) > 1 else None, lease)

    def _each_part(self, n: int, work: Callable[[int], T], undo: Callable[[T], object] = lambda _: None) -> list[T]:
        """``work(k)`` for parts 0 to n-1 at once (part 0 on this thread); if any fails,
        ``undo`` each result of the others, then the first failure is raised."""
        if n == 1:
            return [work(0)]
        others = [self._part_threads().submit(work, k) for k in range(1, n)]
        outcomes: list[tuple[Any, BaseException | None]] = []
        for k in range(n):
            try:
                outcomes.append((work(0) if k == 0 else others[k - 1].result(), None))
            except BaseException as exc:
                outcomes.append((None, exc))
        failure = next((exc for _, exc in outcomes if exc is not None), None)
        if failure is not None:
            for value, exc in outcomes:
                if exc is None:
                    undo(value)
            raise failure
        return [value for value, _ in outcomes]

    def _open_part(self, reader: BatchReader, via: Via, fields: Sequence[str] | None,
                   continue_on_error: bool) -> Response:
        """Send one part's batch request; its answer once the head arrived, no body byte read."""
        base = via.pick()
        url = base + "/v1/batch"
        reader.restart(url)
        body = batch_body(reader.dataset, list(reader.indices), fields, continue_on_error)
        response = self._wire().post(base, "/v1/batch", body, self.headers, exact_head=True)
        if response.status >= 400:
            try:
                raise status_error(response.status, response.headers, response.read(ERROR_BODY_LIMIT), url)
            finally:
                response.close()
        self.router.saw(reader.dataset, response.headers.get(ROUTING_HEADER), base)
        return response

    def _part_threads(self) -> ThreadPoolExecutor:
        """This process's threads for the parts of routed batches: kept for the whole process
        (starting one per batch cost more than the batch's parsing)."""
        return self._own("_threads", os.getpid(), lambda: ThreadPoolExecutor(
            self.max_connections, thread_name_prefix="shardfeed-part"))

    def _stream(self, dataset: str, indices: list[int], fields: Sequence[str] | None, continue_on_error: bool,
                owner: str | None) -> Iterator[dict]:
        """The samples of one request, sent to ``owner`` first; see :meth:`iter_batch`."""
        reader = BatchReader(dataset, indices, fields)
        via = Via(self.endpoints, self.router, dataset, owner)
        while True:
            base, response, chunks, ready = retry_sync(
                lambda: self._open_batch(reader, fields, continue_on_error, via),
                backoff=self.backoff, retryable=self._verdict)
            try:
                yield from ready
                if chunks is None:
                    return
                try:
                    for chunk in chunks:
                        yield from reader.feed(chunk)
                    yield from reader.finish()
                    return
                except ShardfeedConnectionError as exc:
                    error = exc
                # The stream broke after delivering samples: ask for the rest at once.
                # Every round delivers at least one sample, so this loop is bounded.
                if not self._verdict(error):
                    raise error
            finally:
                response.close()

    def load_routing(self, dataset: str) -> None:
        """Fetch ``dataset``'s routing table if one is due (the next batch would fetch it).

        DataLoader workers get copies of this client: loaded before they start, the table
        saves each of them a request (and an httpx session) at the start of every epoch.
        """
        if self.router.due(dataset):
            self.router.load(dataset, self._routing_table(dataset))

    def _routing_table(self, dataset: str) -> dict | None:
        try:
            return self._call("GET", routing_path(dataset), parse_json,
                              via=Via(self.endpoints, self.router, dataset, self.router.teller(dataset)))
        except ShardfeedError:
            return None

    def close(self) -> None:
        """Close this process's connections (the client stays usable: it reconnects)."""
        pid = os.getpid()
        for attr in ("_http", "_pool"):
            if (held := self._disown(attr, pid)) is not None:
                held.close()
        if (threads := self._disown("_threads", pid)) is not None:
            threads.shutdown(wait=False)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _session(self) -> httpx.Client:
        return self._own("_http", os.getpid(), lambda: httpx.Client(**self._session_options()))

    def _wire(self) -> Pool:
        """This process's batch connections."""
        return self._own("_pool", os.getpid(), lambda: Pool(**self._pool_options()))

    def _via(self, dataset: str, index: int) -> Via:
        """Where a per-sample request goes: the sample's owner first (see ``Router``)."""
        self.load_routing(dataset)
        return Via(self.endpoints, self.router, dataset, self.router.owner(dataset, index))

    def _call(self, method: str, path: str, parse: Callable[[httpx.Response], T], json: Any = None,
              via: Via | None = None) -> T:
        """One request with retries; ``parse`` runs inside each try, so a short body is retried.
        ``via``: where the tries go (default: the client's rotation)."""
        return retry_sync(lambda: self._once(method, path, parse, json, via), backoff=self.backoff,
                          retryable=self._verdict)

    def _once(self, method: str, path: str, parse: Callable[[httpx.Response], T], json: Any = None,
              via: Via | None = None) -> T:
        http = self._session()  # first: a new session starts the rotation at a random URL
        base = self.endpoints.pick() if via is None else via.pick()
        url = base + path
        try:
            response = http.request(method, url, json=json)
        except httpx.TransportError as exc:
            raise transport_error(base, exc) from None
        if response.status_code >= 400:
            raise status_error(response.status_code, response.headers, response.content, url)
        return parse(response)

    def _open_batch(self, reader: BatchReader, fields: Sequence[str] | None, continue_on_error: bool,
                    via: Via) -> tuple[str, Response, Iterator[bytes] | None, list[dict]]:
        """Send the batch request for the samples not yet delivered; read until one arrives.

        Returns the base URL, the open response, its remaining chunks (``None`` when the
        response was read to the end) and the samples already complete.
        """
        pool = self._wire()
        base = via.pick()
        url = base + "/v1/batch"
        reader.restart(url)
        body = batch_body(reader.dataset, list(reader.remaining()), fields, continue_on_error)
        response = pool.post(base, "/v1/batch", body, self.headers)
        try:
            if response.status >= 400:
                raise status_error(response.status, response.headers, response.read(ERROR_BODY_LIMIT), url)
            self.router.saw(reader.dataset, response.headers.get(ROUTING_HEADER), base)
            chunks = response.iter_bytes()
            ready: list[dict] = []
            for chunk in chunks:
                ready += reader.feed(chunk)
                if ready:
                    return base, response, chunks, ready
            return base, response, None, reader.finish()
        except BaseException:
            response.close()
            raise
