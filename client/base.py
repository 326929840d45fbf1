"""What the blocking and the asyncio client share: settings, requests, answers, verdicts.

The two clients (:mod:`.sync`, :mod:`.aio`) differ only in how they wait for the network;
what to send, what an answer means and whether to try again is decided here, and where
to send it in :mod:`.routing`. A batch request (:class:`PartRequest`) is the same for both
clients and for every output: sample dicts stream a tar; tensors and Arrow tables read a whole
answer, asked for as Arrow where the service offers it (:mod:`.layout`). A mixed batch read whole
sends each owner one request of its datasets' parts (:class:`PartsRequest`, :func:`grouped`).
"""

from __future__ import annotations

import email.utils
import io
import json
import operator
import os
import re
import ssl
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, TypeVar
from urllib.parse import quote

import httpx
import numpy as np

from shardfeed.arrowipc import MEDIA_TYPE
from shardfeed.retry import Backoff, next_wait

from shardfeed.transforms import Output, TransformError, output_columns

from .errors import ShardfeedConnectionError, ShardfeedError, ShardfeedHTTPError
from .layout import Columns
from .routing import Endpoints, Part, Router, Via, parse_urls
from .samples import BatchReader

T = TypeVar("T")

DEFAULT_BACKOFF = Backoff(attempts=6, base=0.1, cap=10.0)
"""Six tries over about 3 s of jittered waits; a ``Retry-After`` up to 10 s is honoured."""

_RETRY_STATUSES = frozenset({429, 502, 503, 504})
ROUTING_HEADER = "x-shardfeed-routing"
"""Batch answers carry the answering node's routing table version in this header."""
TRANSFORM_HEADER, OUTPUTS_HEADER = "x-shardfeed-transform", "x-shardfeed-outputs"
"""A transform's answer names it (``<name>;version=<version>``) and its outputs' dtypes and shapes (JSON)."""
TRANSFORMS_PATH = "/v1/transforms"
ERROR_BODY_LIMIT = 64 * 1024
"""Bytes of an error response read at most: it is a short JSON document, never a stream."""
BATCH_PATH = "/v1/batch"
TAR, ARROW = "tar", "arrow"
"""The batch answer's formats: a tar streams (sample dicts), Arrow states its layout first (whole answers)."""
REGISTER_POLL = 1.0
"""Seconds between asking again whether a dataset being indexed is served yet."""
PLAN_CHUNK = 100_000
"""Positions of an ``indices`` plan sent in one request. A longer plan is registered with its
first ``PLAN_CHUNK`` positions (``complete: false``) and extended a chunk at a time: at 11
bytes a position at most (a 10-digit index and its comma) a chunk stays well within the
service's 2 MiB body limit, which a whole plan passes from about 200,000 positions (413)."""


def as_indices(indices: Sequence[int]) -> list[int]:
    """Plain ints from any sequence of integers (numpy or torch scalars included)."""
    try:
        return [operator.index(i) for i in indices]
    except TypeError:
        raise TypeError(f"sample indices must be integers, got {indices!r:.80}") from None


class Pick(NamedTuple):
    """One dataset's samples in a batch of several datasets' (a mixture's, :mod:`.mixing`)."""

    dataset: str
    indices: list[int]
    positions: list[int]
    """Where each of ``indices`` goes in the batch."""
    fields: Sequence[str] | None = None
    stream: str | None = None
    """The stream these samples are of (the service counts what it serves by stream)."""


def transform_of(name: str | None, seed: int, epoch: int, fields: Sequence[str] | None) -> dict | None:
    """What a batch request asks a transform for (its ``"transform"``), ``None`` without one."""
    if name is None:
        return None
    if fields is not None:
        raise TypeError(f"fields do not apply with transform {name!r}: it reads the fields it declares")
    seed, epoch = operator.index(seed), operator.index(epoch)
    if seed < 0 or epoch < 0:
        raise ValueError(f"a transform's seed and epoch are integers >= 0, not {seed} and {epoch}")
    return {"name": name, "seed": seed, "epoch": epoch}


def declared_outputs(headers: Mapping[str, str], url: str) -> dict[str, Output]:
    """The outputs a transform's answer declares in its head (``OUTPUTS_HEADER``)."""
    try:
        return {name: Output(o["dtype"], tuple(o["shape"])) for name, o in json.loads(headers[OUTPUTS_HEADER]).items()}
    except KeyError:
        raise ShardfeedError(f"malformed batch response from {url}: a transform's answer without "
                             f"{OUTPUTS_HEADER}") from None
    except (ValueError, TypeError, AttributeError, TransformError) as err:
        raise ShardfeedError(f"malformed batch response from {url}: its {OUTPUTS_HEADER} is not "
                             f"{{name: {{dtype, shape}}}} ({err})") from None


def outputs_of(requests: Sequence[PartRequest | PartsRequest]) -> dict[str, Output] | None:
    """The outputs of a transformed batch (``None`` for another), as its parts' answers declared them:
    every part's answer must be of one version of the transform (replicas mid-upgrade are not mixed)."""
    if not requests or requests[0].declared is None:
        return None
    named = {r.transformed_by for r in requests}
    if len(named) > 1:
        raise ShardfeedError(f"the parts of a transformed batch were answered by {sorted(named)}: "
                             "not one version of the transform")
    return requests[0].declared


def placed(requests: list[PartRequest], positions: list[int]) -> list[PartRequest]:
    """A pick's requests, their parts' positions moved to the pick's ``positions`` in the mixed batch."""
    for request in requests:
        request.part = request.part._replace(positions=[positions[p] for p in request.part.positions])
    return requests


def plan_indices(indices: Sequence[int]) -> list[int]:
    """A plan's indices as plain ints: a numpy array (or tensor) by its ``tolist``, any other
    sequence as ``as_indices``."""
    tolist = getattr(indices, "tolist", None)
    return tolist() if tolist is not None else as_indices(indices)


def plain_plan(plan: dict) -> dict:
    """``plan`` (a body of ``POST /v1/datasets/{name}/plans``) with its indices, if any, as plain ints."""
    return {**plan, "indices": plan_indices(plan["indices"])} if "indices" in plan else plan


def plan_chunks(plan: dict) -> tuple[dict, list[tuple[Sequence[int], bool]]]:
    """``plan`` as the body that registers it and the chunks that extend it, ``(indices,
    complete)`` each: an ``indices`` plan longer than ``PLAN_CHUNK`` positions is registered
    incomplete with its first chunk, and only its last chunk is complete (if the plan is)."""
    indices = plan.get("indices")
    if plan.get("kind") != "indices" or indices is None or len(indices) <= PLAN_CHUNK:
        return plain_plan(plan), []
    complete = plan.get("complete", True)
    cuts = range(PLAN_CHUNK, len(indices), PLAN_CHUNK)
    first = {**plan, "indices": plan_indices(indices[:PLAN_CHUNK]), "complete": False}
    return first, [(indices[cut:cut + PLAN_CHUNK], complete and cut + PLAN_CHUNK >= len(indices)) for cut in cuts]


class BaseClient:
    """Settings, endpoints and the per-process HTTP session shared by both clients.

    The HTTP session (a connection pool) is created lazily by the process and event loop
    that first use it, and never pickled, so a client can be handed to DataLoader workers
    started by ``fork``, ``spawn`` or ``forkserver``: each opens its own connections.
    """

    # This process's (and event loop's) httpx session and batch connections, each as
    # (owner, object): made on first use by each (see _own), never pickled.
    _http: tuple[Any, Any] | None = None
    _pool: tuple[Any, Any] | None = None

    def __init__(
        self,
        url: str | Sequence[str],
        *,
        token: str | None = None,
        timeout: float = 60.0,
        connect_timeout: float = 5.0,
        progress_timeout: float = 10.0,
        backoff: Backoff = DEFAULT_BACKOFF,
        down_for: float = 5.0,
        max_connections: int = 16,
        verify: bool | str = True,
        route: bool = True,
        batch_format: str = "arrow",
    ):
        """
        Args:
            url: service base URL (``http://host:8080``), a comma-separated list of them,
                or a list. Requests rotate over the URLs; one that refuses connections is
                skipped for ``down_for`` seconds while the others take its load.
            token: bearer token sent as ``Authorization``; defaults to ``$SHARDFEED_TOKEN``.
            timeout: seconds to wait for any read or write on a connection (not for a
                whole batch: a large batch may stream for longer, as long as bytes flow).
            connect_timeout: seconds to wait for a connection to open.
            progress_timeout: seconds a batch's answer may go without a byte (its head awaited
                included; at most ``timeout``) before the batch, or its routed part, is asked
                again, of the next URL: a batch stuck behind a store read that went silent or a
                worker that died is re-asked in seconds, not after ``timeout``.
            backoff: retry policy for 429, 502-504, 409 ``dataset_changed``, connection failures
                and broken streams.
            down_for: seconds a URL that refused a connection stays out of the rotation.
            max_connections: connection pool size per process (keep-alive connections).
            verify: for ``https://`` URLs, check the server's certificate (True), against a
                CA bundle file (a path, e.g. the service's self-signed certificate), or not
                at all (False).
            route: send each part of a batch straight to the replica or worker that owns
                its shards, from the service's routing table (see :class:`Router`);
                False sends every batch whole to the next URL of the rotation.
            batch_format: the format the tensor and Arrow outputs ask a batch in: ``"arrow"``
                (its layout sent before its bytes: nothing parsed per member; a service that
                refuses it is asked for ``"tar"`` from then on) or ``"tar"`` (parsed member by
                member, as before the Arrow format; an Arrow table is then a copy). The
                bytes output always reads tar.
        """
        self.urls = parse_urls(url)
        if timeout <= 0 or connect_timeout <= 0 or progress_timeout <= 0:
            raise ValueError("timeout, connect_timeout and progress_timeout must be positive")
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, not {max_connections}")
        token = token if token is not None else os.environ.get("SHARDFEED_TOKEN") or None
        self.headers = {"Accept-Encoding": "identity"}
        if token:
            self.headers["Authorization"] = f"Bearer {token}"
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.progress_timeout = progress_timeout
        self.backoff = backoff
        self.max_connections = max_connections
        self.verify = verify
        self.endpoints = Endpoints(self.urls, down_for)
        self.router = Router(enabled=route)
        if batch_format not in (ARROW, TAR):
            raise ValueError(f"batch_format must be {ARROW!r} or {TAR!r}, not {batch_format!r}")
        self.arrow = batch_format == ARROW
        """Whether whole answers are asked for as Arrow (``batch_format``): False too once a service
        refused the format (one predating it), so this client asks it, and the others, for tar
        from then on."""
        self.parts = True
        """Whether a mixed batch read whole goes to each owner as one request of several datasets'
        parts (:class:`PartsRequest`): False once a service refused parts (one predating them), so
        this client asks one request per dataset from then on."""
        self._session_lock = threading.Lock()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.pop("_http", None)  # sessions hold sockets: each process opens its own
        state.pop("_pool", None)
        del state["_session_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._session_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({','.join(self.urls)!r})"

    def _session_options(self) -> dict:
        return dict(
            headers=self.headers,
            timeout=httpx.Timeout(self.timeout, connect=self.connect_timeout),
            limits=httpx.Limits(max_connections=self.max_connections,
                                max_keepalive_connections=self.max_connections),
            # Proxy settings in the environment are meant for the internet, not for the
            # training cluster's own service.
            trust_env=False,
            verify=ssl.create_default_context(cafile=self.verify) if isinstance(self.verify, str) else self.verify,
        )

    def _pool_options(self) -> dict:
        """The arguments of the batch transport's pool (:mod:`.transport`)."""
        return dict(timeout=self.timeout, connect_timeout=self.connect_timeout, progress_timeout=self.progress_timeout,
                    max_connections=self.max_connections, verify=self.verify)

    def _own(self, attr: str, owner: Any, make: Callable[[], T]) -> T:
        """The object of ``owner`` (a pid, or a pid and event loop) held in ``attr`` as
        ``(owner, object)``, made on first use, as the httpx session is (a child after
        ``fork`` or another event loop makes its own)."""
        held = getattr(self, attr)
        if held is None or held[0] != owner:
            with self._session_lock:
                held = getattr(self, attr)
                if held is None or held[0] != owner:
                    held = (owner, make())
                    setattr(self, attr, held)
                    self.endpoints.scatter()  # a new session starts the rotation at a random URL
        return held[1]

    def _disown(self, attr: str, owner: Any) -> Any:
        """Forget the object held in ``attr``; it, if ``owner`` made it (the caller closes it),
        else ``None`` (another process's or loop's, not ours to close)."""
        held = getattr(self, attr)
        setattr(self, attr, None)
        return held[1] if held is not None and held[0] == owner else None

    def _verdict(self, exc: Exception) -> bool | float | None:
        """The retry predicate: give up, back off, or wait a given time (see shardfeed.retry)."""
        if isinstance(exc, ShardfeedHTTPError):
            # dataset_changed: the service reopened the dataset; the batch again reads one version.
            if exc.status not in _RETRY_STATUSES and exc.code != "dataset_changed":
                return None
            return exc.retry_after if exc.retry_after is not None else True
        if isinstance(exc, ShardfeedConnectionError):
            if exc.connect:
                self.endpoints.mark_down(exc.url)
                if self.endpoints.any_up():
                    return 0.0  # fail over to another URL at once
            return True
        return None

    def _requests(self, dataset: str, indices: list[int], fields: Sequence[str] | None,
                  continue_on_error: bool, whole: bool, stream: str | None = None,
                  transform: dict | None = None) -> list[PartRequest]:
        """A batch as its requests, one per owner of its samples (one, without routing; none
        for no indices), each naming ``stream`` (and ``transform``, :func:`transform_of`). The
        routing table is loaded first, if due (the twins' ``load_routing``). ``whole``: each
        answer is read whole (and asked for as Arrow, see ``arrow``)."""
        return [PartRequest(self, dataset, part, fields, continue_on_error, whole, stream, transform)
                for part in (self.router.split(dataset, indices) if indices else [])]

    def _to_owner(self, dataset: str, index: int) -> Via:
        """Where a per-sample request goes: the sample's owner first (see :class:`Router`)."""
        return Via(self.endpoints, self.router, dataset, self.router.owner(dataset, index))

    def _from_teller(self, dataset: str) -> Via:
        """Where a routing table is fetched: from the node that named a newer version first."""
        return Via(self.endpoints, self.router, dataset, self.router.teller(dataset))


class PartRequest:
    """One ``POST /v1/batch``: the samples of one part of a batch, sent to its owner first.

    What each try sends (the samples not yet delivered, :attr:`reader` counting them; all of
    them when ``whole``, as the tensor output's buffer is one answer), what its answer's head
    means and how long to wait after a failed try are decided here, for both clients; they
    only send it and read the body, as samples or into one buffer. A whole answer is asked for
    in ``format`` Arrow while the client's ``arrow`` holds; it is read as the format its head
    names (:meth:`columns`), so a node that answers tar regardless is read right too. Every try
    names the batch's ``stream`` (a mixture's), under which the node that answers counts it.
    A request of a ``transform`` (its ``"transform"``: name, seed, epoch) is Arrow only, and its
    answer's head declares the outputs (:attr:`declared`) its columns must be.
    """

    def __init__(self, client: BaseClient, dataset: str, part: Part, fields: Sequence[str] | None,
                 continue_on_error: bool, whole: bool = False, stream: str | None = None,
                 transform: dict | None = None):
        self.part = part
        self.fields = fields
        self.continue_on_error = continue_on_error
        self.stream = stream
        self.whole = whole
        self.transform = transform
        self.format = ARROW if whole and (client.arrow or transform is not None) else TAR
        self.answer_format = TAR
        """The format of the last answer, as its head names it."""
        self.declared: dict[str, Output] | None = None
        """A transform's outputs, as the last answer's head declared them."""
        self.transformed_by: str | None = None
        """The transform and version the last answer names (``TRANSFORM_HEADER``)."""
        self.head_timeout = client.timeout if transform is not None else None
        """Seconds its answer's head may take (``None``: the client's ``progress_timeout``): a
        transformed batch is computed whole before its first byte, for as long as its transform takes."""
        self.reader = BatchReader(dataset, part.indices, fields)
        self._client = client
        self.via = Via(client.endpoints, client.router, dataset, part.owner)
        self.router = client.router
        self.base = ""
        self._backoff = client.backoff
        self._verdict = client._verdict
        self._failures = 0  # tries failed since the last that delivered a sample
        self._delivered = 0  # samples delivered when a try last failed

    def next_try(self) -> tuple[str, bytes]:
        """The base URL of the next try and its body, asking for the samples not yet delivered."""
        self.base = self.via.pick()
        self.reader.restart(self.base + BATCH_PATH, self.whole)
        reader = self.reader
        return self.base, batch_body(reader.dataset, list(reader.remaining()), self.fields, self.continue_on_error,
                                     self.format, self.stream, self.transform)

    def error(self, response: Any, body: bytes) -> ShardfeedHTTPError:
        """Our error for an answer with an error status (either transport's), ``body`` its start."""
        return status_error(response.status, response.headers, body, self.reader.url)

    def refused(self, error: ShardfeedHTTPError) -> bool:
        """Whether ``error`` is the node refusing the Arrow format this request asked for (a
        service predating it): then this request, and the client's from now on, ask for tar,
        this one of the same node at once. A transform's answer has no tar: its refusal stands."""
        if self.format != ARROW or self.transform is not None or error.status != 400 \
                or error.code != "unsupported_format":
            return False
        self.format = TAR
        self._client.arrow = False
        self.via.again(self.base)
        return True

    def answered(self, headers: Mapping[str, str]) -> None:
        """An answer's head arrived: note the routing version the node named, and its format."""
        self.router.saw(self.reader.dataset, headers.get(ROUTING_HEADER), self.base)
        media = headers.get("content-type", "").split(";")[0].strip().lower()
        self.answer_format = ARROW if media == MEDIA_TYPE else TAR
        if self.transform is not None:
            self.declared = declared_outputs(headers, self.reader.url)
            self.transformed_by = headers.get(TRANSFORM_HEADER)

    def columns(self, body: memoryview) -> Columns:
        """The layout of the whole answer held in ``body``, read as the format its head named;
        raises as a cut or malformed answer does (:class:`ShardfeedConnectionError`: ask again).
        A transform's answer is Arrow, its fields the declared outputs' columns
        (:func:`shardfeed.transforms.output_columns`)."""
        if self.answer_format == ARROW:
            columns = Columns.of_arrow(body, self.part.indices, self.reader.url)
        elif self.transform is None:
            return Columns.of_samples(self.reader.spans(body))
        else:
            raise ShardfeedError(f"malformed batch response from {self.reader.url}: a transform's answer "
                                 f"other than as Arrow")
        if self.declared is not None and list(columns.offsets) != output_columns(self.declared):
            raise ShardfeedError(f"malformed batch response from {self.reader.url}: its fields are "
                                 f"{list(columns.offsets)}, its declared outputs' {output_columns(self.declared)}")
        return columns

    def wait(self, exc: Exception) -> float:
        """Seconds to wait before the next try after ``exc`` failed one; ``exc`` is raised when
        there is none. A stream that broke after delivering samples is asked for the rest at
        once, its tries counted afresh (every round delivers a sample, so this ends); anything
        else is for the client's retry policy (``backoff``, ``_verdict``)."""
        if isinstance(exc, ShardfeedConnectionError) and self.reader.delivered > self._delivered:
            self._delivered, self._failures = self.reader.delivered, 0
            return 0.0
        wait = next_wait(exc, self._failures, self._backoff, self._verdict)
        if wait is None:
            raise exc
        self._failures += 1
        return wait


MAX_PARTS = 64
"""Parts one request carries at most (the service's bound); an owner of more gets several requests."""


class PartsRefused(ShardfeedHTTPError):
    """A service predating ``parts`` refused a request of several parts (400 ``invalid_request``
    naming them): the batch is asked again at once, one request per dataset."""


class PartsRequest:
    """One ``POST /v1/batch`` of several datasets' parts (a mixed batch's, all of one owner): the
    ``requests`` of each dataset, sent together as ``parts``. It answers the interface
    :class:`PartRequest` gives the whole outputs (``next_try``, ``error``, ``refused``, ``answered``,
    ``columns``, ``part``), so a batch reads it as it reads a plain one; its answer is each part's
    Arrow stream in turn, read into its columns and joined in part order (:meth:`Columns.of_arrows
    <.layout.Columns.of_arrows>`). Its tries go where its first request's would (they share their owner)."""

    def __init__(self, client: BaseClient, requests: list[PartRequest]):
        self.requests = requests
        self._client = client
        self.base = ""
        self.url = ""
        self.declared = self.transformed_by = None  # a mixed batch runs no transform (:func:`outputs_of`)
        self.head_timeout = None
        self.arrow = False
        """Whether the last answer's head named Arrow (a request of parts is answered as nothing else)."""
        parts = [r.part for r in requests]
        self.part = Part(parts[0].owner, [p for part in parts for p in part.positions],
                         [i for part in parts for i in part.indices])
        """The positions and indices of every request's part, in turn."""

    def next_try(self) -> tuple[str, bytes]:
        """The base URL of the next try and its body, asking for every part whole."""
        self.base = self.requests[0].via.pick()
        self.url = self.base + BATCH_PATH
        for request in self.requests:
            request.reader.restart(self.url, whole=True)
        return self.base, parts_body(self.requests)

    def error(self, response: Any, body: bytes) -> ShardfeedHTTPError:
        """Our error for an answer with an error status: :class:`PartsRefused` for a node predating
        parts (it names the field it does not know, as pydantic's ``extra`` check does)."""
        error = status_error(response.status, response.headers, body, self.url)
        if error.status == 400 and error.code == "invalid_request" and re.search(r"\bparts\b", error.message):
            return PartsRefused(error.status, error.code, error.message, error.url, error.retry_after)
        return error

    def refused(self, error: ShardfeedHTTPError) -> bool:
        """False: parts are Arrow only, never asked for again as tar. A refusal of parts (a node
        predating them, :class:`PartsRefused`) turns them off in the client, its datasets' requests
        going to the same node next; the batch raises it and is asked again, a request per dataset."""
        if isinstance(error, PartsRefused):
            self._client.parts = False
            for request in self.requests:
                request.via.again(self.base)
        return False

    def answered(self, headers: Mapping[str, str]) -> None:
        """An answer's head arrived: note the routing version the node named for each part's dataset
        (one per part, comma-separated)."""
        versions = [v.strip() or None for v in headers.get(ROUTING_HEADER, "").split(",")]
        for request, version in zip(self.requests, versions + [None] * len(self.requests)):
            request.router.saw(request.reader.dataset, version, self.base)
        media = headers.get("content-type", "").split(";")[0].strip().lower()
        self.arrow = media == MEDIA_TYPE

    def columns(self, body: memoryview) -> Columns:
        """The layout of the whole answer held in ``body``: each part's Arrow stream in turn, its
        rows in part order (as :attr:`part` lists them)."""
        if not self.arrow:
            raise ShardfeedError(f"malformed batch response from {self.url}: a request of parts answered "
                                 f"other than as Arrow")
        return Columns.of_arrows(body, [r.part.indices for r in self.requests], self.url)


def grouped(client: BaseClient, requests: list[PartRequest]) -> list[PartRequest | PartsRequest]:
    """A mixed batch's requests read whole (one per dataset and owner) as one request per owner
    (several when it has more than ``MAX_PARTS``), owners in the order they first come; an owner of
    one keeps its plain request. Unchanged while the client asks for tar or its service refused parts."""
    if not (client.parts and client.arrow):
        return list(requests)
    owners: dict[str | None, list[PartRequest]] = {}
    for request in requests:
        owners.setdefault(request.part.owner, []).append(request)
    chunks = [mine[at:at + MAX_PARTS] for mine in owners.values() for at in range(0, len(mine), MAX_PARTS)]
    return [chunk[0] if len(chunk) == 1 else PartsRequest(client, chunk) for chunk in chunks]


class Registering:
    """``POST /v1/datasets`` until the dataset is served: a 202 says it is being indexed."""

    def __init__(self, name: str, url: str, on_progress: Callable[[dict], None] | None, timeout: float | None):
        self.name = name
        self.url = url
        self.body = {"name": name, "url": url}
        self.on_progress = on_progress
        self.timeout = timeout
        self.deadline = None if timeout is None else time.monotonic() + timeout

    @staticmethod
    def parse(response: httpx.Response) -> tuple[int, dict]:
        return response.status_code, parse_json(response)

    def served(self, answer: tuple[int, dict]) -> dict | None:
        """The dataset's info once served; ``None`` to ask again after ``REGISTER_POLL`` s."""
        status, doc = answer
        if status != 202:
            return doc["dataset"]
        if self.on_progress is not None:
            self.on_progress(doc["registering"])
        if self.deadline is not None and time.monotonic() >= self.deadline:
            raise TimeoutError(f"dataset {self.name!r} ({self.url}) not registered within {self.timeout:g} s")
        return None


def sample_parser(dataset: str, index: int) -> Callable[[httpx.Response], dict]:
    """How the per-sample ``GET``'s answer (a tar of the sample's members) reads as a sample."""
    def parse(response: httpx.Response) -> dict:
        reader = BatchReader(dataset, [index], url=str(response.url))
        return (reader.feed(response.content) + reader.finish())[0]
    return parse


def checked(response: httpx.Response, url: str, parse: Callable[[httpx.Response], T]) -> T:
    """``parse(response)``, or our error for an error status."""
    if response.status_code >= 400:
        raise status_error(response.status_code, response.headers, response.content, url)
    return parse(response)


def settled(outcomes: list[tuple[Any, BaseException | None]], undo: Callable[[Any], object]) -> list:
    """The results of a batch's parts, each ``(value, failure)``, once every part has ended:
    if any failed, the others' values are undone (their answers closed), the first failure raised."""
    failure = next((exc for _, exc in outcomes if exc is not None), None)
    if failure is not None:
        for value, exc in outcomes:
            if exc is None:
                undo(value)
        raise failure
    return [value for value, _ in outcomes]


def routing_path(dataset: str) -> str:
    """Path of ``GET /v1/datasets/{name}/routing``."""
    return f"/v1/datasets/{quote(dataset, safe='')}/routing"


def sample_path(dataset: str, index: int, field: str | None = None) -> str:
    """Path of the per-sample routes: ``/v1/datasets/{name}/samples/{i}[/{field}]``."""
    path = f"/v1/datasets/{quote(dataset, safe='')}/samples/{operator.index(index)}"
    return path if field is None else f"{path}/{quote(field, safe='')}"


def dataset_path(dataset: str | None = None) -> str:
    """Path of ``GET /v1/datasets`` or of one dataset's description."""
    return "/v1/datasets" if dataset is None else f"/v1/datasets/{quote(dataset, safe='')}"


def index_path(dataset: str, column: str | None = None) -> str:
    """Path of ``GET /v1/datasets/{name}/index`` or of one of its columns."""
    path = f"{dataset_path(dataset)}/index"
    return path if column is None else f"{path}/{quote(column, safe='')}"


def plan_path(dataset: str, plan_id: str | None = None) -> str:
    path = f"{dataset_path(dataset)}/plans"
    return path if plan_id is None else f"{path}/{quote(plan_id, safe='')}"


def batch_body(dataset: str, indices: list[int], fields: Sequence[str] | None,
               continue_on_error: bool, format: str = TAR, stream: str | None = None,
               transform: dict | None = None) -> bytes:
    """JSON body of ``POST /v1/batch``, encoded (``"transform"`` only with one)."""
    body = {**_part(dataset, indices, fields, stream), "format": format, "continue_on_error": continue_on_error}
    if transform is not None:
        body["transform"] = transform
    return json.dumps(body, separators=(",", ":")).encode()


def parts_body(requests: Sequence[PartRequest]) -> bytes:
    """JSON body of ``POST /v1/batch`` asking for each request's part whole, as ``parts`` (Arrow only)."""
    parts = [_part(r.reader.dataset, r.part.indices, r.fields, r.stream) for r in requests]
    body = {"parts": parts, "format": ARROW, "continue_on_error": requests[0].continue_on_error}
    return json.dumps(body, separators=(",", ":")).encode()


def _part(dataset: str, indices: list[int], fields: Sequence[str] | None, stream: str | None) -> dict[str, Any]:
    """What a batch asks of one dataset: without ``fields`` or ``stream`` when there are none (a
    service that predates ``stream`` refuses the field)."""
    part: dict[str, Any] = {"dataset": dataset, "indices": indices}
    if fields is not None:
        part["fields"] = list(fields)
    if stream is not None:
        part["stream"] = stream
    return part


def transport_error(url: str, exc: httpx.HTTPError) -> ShardfeedConnectionError:
    """Our error for an httpx transport failure (refused, timed out, reset mid-stream)."""
    connect = isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout))
    reason = str(exc) or type(exc).__name__
    return ShardfeedConnectionError(url, f"{type(exc).__name__}: {reason}", connect=connect)


def status_error(status: int, headers: Mapping[str, str], body: bytes, url: str) -> ShardfeedHTTPError:
    """Our error for an error status, with the service's ``{"error": {code, message}}``."""
    code, message = httpx.codes.get_reason_phrase(status).lower().replace(" ", "_") or "error", ""
    try:
        error = httpx.Response(status, content=body[:ERROR_BODY_LIMIT]).json()["error"]
        code, message = str(error["code"]), str(error["message"])
    except Exception:  # not our JSON (a proxy's page, a truncated body): show the start of it
        message = body[:200].decode("utf-8", "replace").strip() or "(no message)"
    return ShardfeedHTTPError(status, code, message, url, retry_after(headers.get("retry-after")))


def retry_after(value: str | None) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds or an HTTP date)."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


NPY_HEADERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
"""How each ``.npy`` format version's header is read (the service writes 1.0)."""


def parse_npy(response: httpx.Response) -> np.ndarray:
    """The one-dimensional ``.npy`` body of a successful response as an array over the body's own
    bytes (read-only: ``.copy()`` it to write to it), not a copy of them."""
    body = response.content
    try:
        head = io.BytesIO(body)
        shape, _, dtype = NPY_HEADERS[np.lib.format.read_magic(head)](head)
        values = np.frombuffer(body, dtype, offset=head.tell())
    except (ValueError, KeyError) as err:
        raise ShardfeedError(f"malformed response from {response.url}: not a .npy column ({err})") from None
    if shape != values.shape:
        raise ShardfeedError(f"malformed response from {response.url}: {values.shape[0]} values of {dtype}, "
                             f"its header says {shape}")
    return values


def parse_json(response: httpx.Response) -> Any:
    """The JSON body of a successful response."""
    try:
        return response.json()
    except ValueError:
        raise ShardfeedError(f"malformed response from {response.url}: body is not JSON") from None
