"""The blocking client: ``Client(url).get_batch("train", [17, 4, 9])``."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing, suppress
from typing import TYPE_CHECKING, Any, TypeVar

import httpx
import numpy as np

from shardfeed.retry import retry_sync

from .base import (
    BATCH_PATH, ERROR_BODY_LIMIT, REGISTER_POLL, TRANSFORMS_PATH, BaseClient, PartRequest, PartsRefused, Pick,
    Registering, as_indices, checked, dataset_path, grouped, index_path, parse_json, parse_npy, placed, plan_chunks,
    plan_indices, plan_path, routing_path, sample_parser, sample_path, settled, transform_of, transport_error,
)
from .errors import ShardfeedError
from .routing import Via, merged
from .transport.sync import Pool, Response, Sent

if TYPE_CHECKING:
    import pyarrow as pa

    from .answers import Allocate, Regions
    from .tensors import Batch

T = TypeVar("T")
P = TypeVar("P")


def _in_turn(items: Sequence[P], work: Callable[[P], T], undo: Callable[[T], object]) -> list[T]:
    """``work(item)`` for each item in turn; if one fails, ``undo`` the results so far, then raise."""
    done: list[T] = []
    try:
        for item in items:
            done.append(work(item))
    except BaseException:
        for value in done:
            undo(value)
        raise
    return done


class Client(BaseClient):
    """Blocking client of a shardfeed service (keep-alive, retries, failover; see BaseClient).

    Safe to share between threads, and to hand to DataLoader worker processes. Batches
    travel over a lean HTTP/1.1 transport of their own (:mod:`.transport`), everything else
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

    def transforms(self) -> list[dict]:
        """``GET /v1/transforms``: the transforms the service runs, ``{"name", "spec", "version",
        "fields", "outputs"}`` each (``spec``, ``package.module:factory``, loads the same transform
        here: ``shardfeed.transforms.load``)."""
        return self._call("GET", TRANSFORMS_PATH, parse_json)["transforms"]

    def index_columns(self, dataset: str) -> list[str]:
        """``GET /v1/datasets/{name}/index``: the names of the columns :meth:`index_column` reads:
        ``key``, ``shard``, ``bytes`` and a ``bytes.<field>`` per field (not for MDS or LitData)."""
        return self._call("GET", index_path(dataset), parse_json)["columns"]

    def index_column(self, dataset: str, column: str) -> np.ndarray:
        """``GET /v1/datasets/{name}/index/{column}``: one column of the dataset's index, a value
        per sample in sample order, to choose a subset of samples by (a key list, a predicate):
        ``key`` (``S<longest key>``: UTF-8 bytes, ``np.char.decode`` makes them ``str``), ``shard``
        (int32, a position in :meth:`shard_names`), ``bytes`` (int64, the sample's fields summed),
        ``bytes.<field>`` (int64, 0 where the sample lacks the field). The array is a read-only view
        of the answer's bytes. ``ShardfeedHTTPError`` 404 ``unknown_column`` names the columns."""
        return self._call("GET", index_path(dataset, column), parse_npy)

    def shard_names(self, dataset: str) -> list[str]:
        """``GET /v1/datasets/{name}/index/shards``: the shards' paths in the dataset's root, in the
        order the ``shard`` column numbers them."""
        return self._call("GET", index_path(dataset, "shards"), parse_json)

    def register_dataset(self, name: str, url: str, *, on_progress: Callable[[dict], None] | None = None,
                         timeout: float | None = None) -> dict:
        """``POST /v1/datasets``: serve the dataset at ``url`` as ``name`` (tar shards without an
        index are indexed first: ``on_progress`` gets each 202's ``registering``, about once a
        second). The dataset's info once served; ``ShardfeedError`` 409 when ``name`` is taken
        by another URL, ``TimeoutError`` after ``timeout`` seconds (default: none)."""
        registering = Registering(name, url, on_progress, timeout)
        while (served := registering.served(self._call("POST", dataset_path(), registering.parse,
                                                       json=registering.body))) is None:
            time.sleep(REGISTER_POLL)
        return served

    def remove_dataset(self, name: str) -> None:
        """``DELETE /v1/datasets/{name}``: serve it no more."""
        self._call("DELETE", dataset_path(name), lambda r: None)

    def register_plan(self, dataset: str, plan: dict) -> dict:
        """``POST /v1/datasets/{name}/plans``: announce an upcoming order (see ``client/plans.py``);
        the plan as the service describes it. An ``indices`` plan's indices may be a numpy
        array; beyond ``PLAN_CHUNK`` positions they go in chunks (``extend_plan``), and a plan
        whose chunk fails is deleted before the error is raised."""
        first, chunks = plan_chunks(plan)
        answer = self._call("POST", plan_path(dataset), parse_json, json=first)
        try:
            for indices, complete in chunks:
                answer = self.extend_plan(dataset, answer["id"], indices, complete)
        except BaseException:
            with suppress(ShardfeedError):
                self.delete_plan(dataset, answer["id"])
            raise
        return answer

    def extend_plan(self, dataset: str, plan_id: str, indices: Sequence[int], complete: bool = True) -> dict:
        """``POST /v1/datasets/{name}/plans/{id}``: the next chunk of an ``indices`` plan registered
        with ``complete: false`` (a list or numpy array of up to ``PLAN_CHUNK`` positions, which
        fits the service's body limit); ``complete``: no chunk follows."""
        return self._call("POST", plan_path(dataset, plan_id), parse_json,
                          json={"indices": plan_indices(indices), "complete": complete})

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
        return self._call("GET", sample_path(dataset, index), sample_parser(dataset, index),
                          via=self._via(dataset, index))

    def get_batch(self, dataset: str, indices: Sequence[int], fields: Sequence[str] | None = None,
                  *, continue_on_error: bool = False, stream: str | None = None) -> list[dict]:
        """The samples at ``indices``, in that order, fetched with one ``POST /v1/batch``.

        ``fields`` limits the fields returned (default: all). With ``continue_on_error``
        a sample the service cannot serve comes back as
        ``{"__key__": None, "__index__": i, "__missing__": True}`` instead of failing
        the whole batch. ``stream`` names the stream of a mixture the batch belongs to (1 to
        64 of ``A-Z a-z 0-9 . _ : / -``): the service counts what it serves under that name too
        (``/v1/stats``' ``streams``, the ``shardfeed_stream_*`` metrics).
        """
        return list(self.iter_batch(dataset, indices, fields, continue_on_error=continue_on_error, stream=stream))

    def iter_batch(self, dataset: str, indices: Sequence[int], fields: Sequence[str] | None = None,
                   *, continue_on_error: bool = False, stream: str | None = None) -> Iterator[dict]:
        """Like :meth:`get_batch`, but yields each sample as soon as it has arrived.

        If the connection breaks mid-stream, the samples not yet yielded are asked for
        again (from another URL, if there are several); nothing is yielded twice. With
        routing (see :class:`~shardfeed.client.routing.Router`), each owner's part of the
        batch is sent to it at once, and the samples are yielded in the order asked.
        """
        requests = self._batch(dataset, indices, fields, continue_on_error, stream=stream)
        if len(requests) == 1:
            yield from self._stream(requests[0])
        else:
            yield from merged([r.part for r in requests], self._each_part(requests, lambda r: list(self._stream(r))))

    def get_batch_tensors(self, dataset: str, indices: Sequence[int], fields: Sequence[str] | None = None,
                          *, continue_on_error: bool = False, shared: bool = False,
                          stream: str | None = None, transform: str | None = None, seed: int = 0,
                          epoch: int = 0) -> Batch:
        """The samples at ``indices`` as one :class:`~.tensors.Batch`: every byte in one
        ``torch.uint8`` buffer (in shared memory with ``shared``, as a DataLoader worker wants
        it), read there straight from the socket; ``batch["jpg"][i]`` is a view of it. Needs
        torch. The arguments and errors are :meth:`get_batch`'s; a broken answer is asked for
        again whole (the buffer is the answer), routed parts at once, as :meth:`iter_batch` does.

        ``transform``: the name of a transform the service runs (:meth:`transforms`) on each
        sample, its augmentation seeded by ``(seed, epoch, index)`` (integers >= 0); the batch's
        fields are then its outputs, ``batch.outputs`` them typed (docs/transforms.md). No
        ``fields`` with it (it reads its own); with ``continue_on_error`` a sample it fails on is
        missing, else ``ShardfeedHTTPError`` 422 ``transform_failed`` names the sample.
        """
        from .tensors import allocator, batch_of

        requests = self._batch(dataset, indices, fields, continue_on_error, whole=True, stream=stream,
                               transform=transform_of(transform, seed, epoch, fields))
        return retry_sync(lambda: self._whole(requests, allocator(shared), batch_of), backoff=self.backoff,
                          retryable=self._verdict)

    def get_batch_arrow(self, dataset: str, indices: Sequence[int], fields: Sequence[str] | None = None,
                        *, continue_on_error: bool = False, shared: bool = False,
                        stream: str | None = None) -> pa.Table:
        """The samples at ``indices`` as a ``pyarrow.Table``, a row per sample in order: ``__key__``,
        ``__index__``, then a large_binary column per field; its columns are views of the one buffer
        the answer was read into (:mod:`.arrow`: a routed batch's are chunked, a zero-copy slice per
        run of rows from one part). Needs pyarrow. The arguments and errors are :meth:`get_batch`'s;
        a broken answer is asked for again whole, as :meth:`get_batch_tensors` does. ``shared``: read
        into a pooled shared-memory segment (needs torch), which a DataLoader worker then sends to
        the training process by name (:mod:`.arrowshared`)."""
        from .arrow import reading

        allocate, build = reading(shared)
        requests = self._batch(dataset, indices, fields, continue_on_error, whole=True, stream=stream)
        return retry_sync(lambda: self._whole(requests, allocate, build), backoff=self.backoff,
                          retryable=self._verdict)

    def get_mixed_batch(self, picks: Sequence[Pick], *, output: str = "samples", continue_on_error: bool = False,
                        shared: bool = False) -> list[dict] | Batch:
        """A batch of several datasets' samples (a mixture's, :mod:`.mixing`): each pick's samples
        at its positions of the batch, sent at once and merged as a routed batch's parts are.
        ``output``: ``"samples"``, the sample dicts of :meth:`get_batch`, a request per dataset (and
        per owner, with routing); ``"tensors"``, one :class:`~.tensors.Batch` as
        :meth:`get_batch_tensors` makes it (``shared`` as there), a dataset's missing fields
        ``ABSENT`` in the other datasets' rows, one request per owner carrying every dataset's part
        (a request per dataset from a service that predates parts)."""
        if output == "samples":
            requests = self._picked(picks, continue_on_error, whole=False)
            return merged([r.part for r in requests], self._each_part(requests, lambda r: list(self._stream(r))))
        if output != "tensors":
            raise ValueError(f"a mixed batch's output is 'samples' or 'tensors', not {output!r}")
        from .tensors import allocator, batch_of

        requests = self._picked(picks, continue_on_error, whole=True)
        return retry_sync(lambda: self._mixed(requests, allocator(shared), batch_of), backoff=self.backoff,
                          retryable=self._verdict)

    def load_routing(self, dataset: str) -> None:
        """Fetch ``dataset``'s routing table if one is due (the next batch would fetch it).

        DataLoader workers get copies of this client: loaded before they start, the table
        saves each of them a request (and an httpx session) at the start of every epoch.
        """
        if self.router.due(dataset):
            self.router.load(dataset, self._routing_table(dataset))

    def _routing_table(self, dataset: str) -> dict | None:
        """``dataset``'s routing table; ``None`` if it cannot be had (a service without routing)."""
        try:
            return self._call("GET", routing_path(dataset), parse_json, via=self._from_teller(dataset))
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

    # -- a batch: its requests, each part's answer read as samples or into a tensor buffer --

    def _batch(self, dataset: str, indices: Sequence[int], fields: Sequence[str] | None,
               continue_on_error: bool, whole: bool = False, stream: str | None = None,
               transform: dict | None = None) -> list[PartRequest]:
        indices = as_indices(indices)
        if indices:
            self.load_routing(dataset)
        return self._requests(dataset, indices, fields, continue_on_error, whole, stream, transform)

    def _picked(self, picks: Sequence[Pick], continue_on_error: bool, whole: bool) -> list[PartRequest]:
        """The requests of a mixed batch: each dataset's, their parts placed at the picks' positions."""
        return [request for pick in picks for request in placed(
            self._batch(pick.dataset, pick.indices, pick.fields, continue_on_error, whole, pick.stream), pick.positions)]

    def _open(self, request: PartRequest, exact_head: bool = False) -> Response:
        """Send one try of ``request``; its answer once the head arrived, no body byte read
        beyond what came with it (none with ``exact_head``)."""
        return self._answer(request, self._send(request), exact_head)

    def _send(self, request: PartRequest) -> Sent:
        """Send one try of ``request``, its answer not waited for."""
        pool = self._wire()  # first: a new pool starts the rotation at a random URL
        base, body = request.next_try()
        return pool.send(base, BATCH_PATH, body, self.headers, head_timeout=request.head_timeout)

    def _answer(self, request: PartRequest, sent: Sent, exact_head: bool = False) -> Response:
        """The answer to ``sent``, a try of ``request``, once its head arrived (see :meth:`_open`)."""
        response = sent.answer(exact_head)
        if response.status >= 400:
            with closing(response):
                error = request.error(response, response.read(ERROR_BODY_LIMIT))
            if request.refused(error):  # a service without the Arrow format: ask it for tar
                return self._open(request, exact_head)
            raise error
        request.answered(response.headers)
        return response

    def _stream(self, request: PartRequest) -> Iterator[dict]:
        """The samples of one request as they arrive, tried again as ``request.wait`` says."""
        while True:
            try:
                with closing(self._open(request)) as response:
                    for chunk in response.iter_bytes():
                        yield from request.reader.feed(chunk)
                    yield from request.reader.finish()
                    return
            except Exception as exc:
                time.sleep(request.wait(exc))

    def _whole(self, requests: list[PartRequest], allocate: Allocate,
               build: Callable[[list[PartRequest], Regions], T]) -> T:
        """One try of a batch read whole (tensors, Arrow): every part's request sent, then each
        answer's head read, then each answer read into its stretch of one buffer (``allocate``'s,
        sized from their heads); the batch is what ``build`` makes of them.

        All on this thread: the parts' owners answer at once, their answers waiting in the sockets
        while the one before is read. (Handing the parts to threads cost more CPU, in switches and
        the GIL, than reading them: 16.0 against 10.1 us per sample for two parts of 10 KiB samples.)"""
        from .answers import regions_for

        sent = _in_turn(requests, self._send, Sent.close)
        try:
            responses = _in_turn(list(zip(requests, sent)), lambda pair: self._answer(*pair, exact_head=True),
                                 Response.close)
        except BaseException:
            for each in sent:  # those whose answers were not read: an answered one has nothing to close
                each.close()
            raise
        try:
            regions = regions_for(responses, allocate)
            for response, region in zip(responses, regions.regions):
                response.read_into(region)
        finally:
            for response in responses:
                response.close()
        return build(requests, regions)

    def _mixed(self, requests: list[PartRequest], allocate: Allocate,
               build: Callable[[list[PartRequest], Regions], T]) -> T:
        """One try of a mixed batch read whole: its requests (one per dataset and owner) sent as
        one per owner (``grouped``); from a service that refuses parts, again at once as they are."""
        try:
            return self._whole(grouped(self, requests), allocate, build)
        except PartsRefused:
            return self._whole(requests, allocate, build)

    def _each_part(self, parts: Sequence[P], work: Callable[[P], T],
                   undo: Callable[[T], object] = lambda _: None) -> list[T]:
        """``work(part)`` for every part at once (the first on this thread, the others on the
        process's threads); if any fails, ``undo`` the others' results, then raise the first failure."""
        others = [self._part_threads().submit(work, part) for part in parts[1:]]
        outcomes: list[tuple[Any, BaseException | None]] = []
        for k in range(len(parts)):
            try:
                outcomes.append((work(parts[0]) if k == 0 else others[k - 1].result(), None))
            except BaseException as exc:
                outcomes.append((None, exc))
        return settled(outcomes, undo)

    def _part_threads(self) -> ThreadPoolExecutor:
        """This process's threads for the parts of routed batches: kept for the whole process
        (starting one per batch cost more than the batch's parsing)."""
        return self._own("_threads", os.getpid(), lambda: ThreadPoolExecutor(
            self.max_connections, thread_name_prefix="shardfeed-part"))

    # -- the other requests, over httpx --

    def _session(self) -> httpx.Client:
        return self._own("_http", os.getpid(), lambda: httpx.Client(**self._session_options()))

    def _wire(self) -> Pool:
        """This process's batch connections."""
        return self._own("_pool", os.getpid(), lambda: Pool(**self._pool_options()))

    def _via(self, dataset: str, index: int) -> Via:
        """Where a per-sample request goes: the sample's owner first (see ``Router``)."""
        self.load_routing(dataset)
        return self._to_owner(dataset, index)

    def _call(self, method: str, path: str, parse: Callable[[httpx.Response], T], json: Any = None,
              via: Via | None = None) -> T:
        """One request with retries; ``parse`` runs inside each try, so a short body is retried.
        ``via``: where the tries go (default: the client's rotation)."""
        return retry_sync(lambda: self._once(method, path, parse, json, via), backoff=self.backoff,
                          retryable=self._verdict)

    def _once(self, method: str, path: str, parse: Callable[[httpx.Response], T], json: Any,
              via: Via | None) -> T:
        http = self._session()  # first: a new session starts the rotation at a random URL
        base = (via or self.endpoints).pick()
        try:
            response = http.request(method, base + path, json=json)
        except httpx.TransportError as exc:
            raise transport_error(base, exc) from None
        return checked(response, base + path, parse)
