"""``GET /v1/ml/moss[/{bucket}]``: AIStore's GetBatch, for the unchanged AIStore Python SDK.

A request (``moss.MossReq``) becomes one member per entry (``objects.Catalog`` locates
each: a plain object, a byte range, or a file inside a tar shard) and is served by the
same ``stream_batch`` over the coalescer as ``POST /v1/batch``: blocks, cache,
singleflight, admission control and metrics are shared. Only the naming differs:
``<bucket>/<objname>[/<archpath>]`` in request order, ``__404__/<name>`` for a missing
entry with ``coer``, since the SDK pairs members with entries by position.

Errors: the SDK shows the raw body and picks its error class from a ``<provider>://``
URL in it, so a missing object answers 404 ``aws://bucket/obj does not exist``. It
retries 5xx for about 90 s, so only a store outage is a 5xx; everything a retry cannot
fix is a 4xx. A range outside the object is a 416 even with ``coer``, as in AIStore.
Entries that one served dataset indexes (its loose objects, or files of its shards by
archpath) are read through that dataset: its cached blocks, its replica owners. Other
entries are cached under their bucket and key, and with replicas read by the replica
that got the request (no peer knows them).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import zlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

import numpy as np
from fastapi import APIRouter, Request
from pydantic import ValidationError
from starlette.responses import Response

from shardfeed.service.api.auth import tenant_of
from shardfeed.service.api.common import (
    TAR, AppState, answer_changed_once, describe, json_body, located_members, read_body, served_metrics,
    tar_stream_response,
)
from shardfeed.service.cache.names import dataset_id, shard_id
from shardfeed.service.datasets.dataset import Dataset
from shardfeed.service.datasets.index import Members
from shardfeed.service.datasets.moss import PROVIDERS, MossIn, MossOut, MossReq, MossResp
from shardfeed.service.datasets.objects import EntryMissing, Span
from shardfeed.service.http.errors import ApiError, InvalidRequest, StoreUnavailable
from shardfeed.service.read.framing import TarFraming
from shardfeed.service.read.stream import SampleFailed, stream_batch
from shardfeed.service.stores import AccessDenied, ObjectNotFound, StoreError
from shardfeed.service.stores.base import clean_path

router = APIRouter(tags=["getbatch"])

MAX_BUFFERED = 256 << 20
"""Most payload bytes of a multipart (``strm: false``) answer, which is built in memory
before it is sent (AIStore does the same); larger batches must stream."""


async def _gzip(groups: AsyncIterator[list]) -> AsyncIterator[list]:
    packer = zlib.compressobj(6, zlib.DEFLATED, 31)  # wbits 31: a gzip member
    async for parts in groups:
        out = b"".join([packer.compress(part) for part in parts])
        if out:
            yield [out]
    yield [packer.flush()]


async def _identity(groups: AsyncIterator[list]) -> AsyncIterator[list]:
    async for parts in groups:
        yield parts


@dataclass(frozen=True)
class Format:
    media_type: str
    extension: str
    encode: Callable[[AsyncIterator[list]], AsyncIterator[list]]
    """Re-encodes a batch stream: lists of parts (``stream.stream_batch``) in, lists out."""


FORMATS = {".tar": Format(TAR, ".tar", _identity), ".tgz": Format("application/gzip", ".tgz", _gzip),
           ".tar.gz": Format("application/gzip", ".tar.gz", _gzip)}
"""Output archive formats by ``mime``; AIStore's ``.zip`` and ``.tar.lz4`` get a 400."""


def output_format(mime: str) -> Format:
    """AIStore normalises by substring: ``tar.gz`` and ``TGZ`` are ``.tar.gz`` and ``.tgz``."""
    name = mime.strip().lower() or ".tar"
    if not name.startswith("."):
        name = "." + name
    if name not in FORMATS:
        raise ApiError(400, "unsupported_format", f"output format {mime!r} is not supported "
                                                  f"(supported: {', '.join(FORMATS)})")
    return FORMATS[name]


class NotFound(ApiError):
    def __init__(self, url: str):
        super().__init__(404, "not_found", f"{url} does not exist")


@dataclass
class Entry:
    """A validated entry: its bucket, provider name, object and member name in the answer."""

    bucket: str
    provider: str
    objname: str
    archpath: str
    name: str
    source: MossIn

    @property
    def url(self) -> str:
        where = f"{self.provider}://{self.bucket}/{self.objname}"
        return f"{where}/{self.archpath}" if self.archpath else where


def _entries(req: MossReq, bucket: str, provider: str, allowed) -> list[Entry]:
    out = []
    for i, item in enumerate(req.entries):
        name_of_bucket = item.bucket or bucket
        given = item.provider or provider
        if given.lower() not in PROVIDERS:
            raise ApiError(400, "unsupported_provider", f"in[{i}]: provider {given!r} is not served "
                                                        f"(shardfeed serves {', '.join(sorted(PROVIDERS)[1:])} "
                                                        "from its S3 endpoint)")
        prov = PROVIDERS[given.lower()]
        if not name_of_bucket:
            raise InvalidRequest(f"in[{i}]: no bucket (neither in the entry nor in the URL)")
        if name_of_bucket not in allowed:
            raise _not_allowed(prov, name_of_bucket)
        objname = item.objname
        try:
            valid = clean_path(objname) == objname and not objname.endswith("/")
        except StoreError:
            valid = False
        if not valid:
            raise InvalidRequest(f"in[{i}]: invalid object name {objname[:200]!r}")
        if item.start > 0 and item.length == 0:
            raise InvalidRequest(f"in[{i}]: a range from {item.start} needs a length (-1: to the end)")
        archpath = item.archpath.lstrip("/")
        name = objname if req.onob else f"{name_of_bucket}/{objname}"
        if archpath:
            name = f"{name}/{archpath}"
        out.append(Entry(name_of_bucket, prov, objname, archpath, name, item))
    return out


def _not_allowed(provider: str, bucket: str) -> ApiError:
    return ApiError(403, "bucket_not_served", f"bucket {provider}://{bucket[:255]} is not served here "
                                              f"(start the service with --bucket {bucket[:255]})")


def _ranged(entry: Entry, span: Span) -> Span:
    start, length = entry.source.start, entry.source.length
    if (start, length) == (0, 0):
        return span
    size = span.size - start if length == -1 else length
    if start >= span.size or size < 0 or start + size > span.size:
        raise ApiError(416, "range_not_satisfiable", f"{entry.url}: range start {start}, length {length} "
                                                     f"is outside its {span.size} bytes")
    return replace(span, offset=span.offset + start, size=size)


async def _place_fields(state, found: list) -> None:
    """Spans of the fields of a record layout (MDS, LitData), which the index knows by their
    record's extent, moved to the field's own (``read/fields.py``)."""
    records = [i for i, span in enumerate(found)
               if isinstance(span, Span) and span.row >= 0 and span.home[0].records is not None]
    for dataset in {id(found[i].home[0]): found[i].home[0] for i in records}.values():
        at = [i for i in records if found[i].home[0] is dataset]
        rows = np.array([found[i].row for i in at], np.int64)
        n = len(at)
        members = await located_members(state, dataset, Members(
            position=np.arange(n), sample=dataset.index.row_samples(rows), field=np.zeros(n, np.int32),
            shard=np.array([found[i].home[1] for i in at], np.int32),
            offset=np.array([found[i].offset for i in at], np.int64),
            size=np.array([found[i].size for i in at], np.int64), found=np.ones(n, bool), row=rows))
        for i, offset, size in zip(at, members.offset.tolist(), members.size.tolist()):
            found[i] = replace(found[i], offset=offset, size=size)


class EntryNames:
    """Member names of a GetBatch answer (``framing.SampleNames``' counterpart); remembers why
    each missing entry failed, for the multipart metadata."""

    shard_names = False  # an entry is named by its bucket and object, not as in its shard

    def __init__(self, entries: list[Entry], errors: dict[int, str]):
        self.entries = entries
        self.errors = errors

    def __call__(self, dataset: Dataset, first: int, samples: np.ndarray) -> "EntryNames":
        return self

    def member(self, position: int, field: int) -> str:
        return self.entries[position].name

    def missing(self, position: int, cause: BaseException | None) -> str:
        self.errors.setdefault(position, f"{self.entries[position].url}: {cause}")
        return f"__404__/{self.entries[position].name}"


class _Paths:
    """The part of an ``Index`` the coalescer reads: the shard (here: object) paths."""

    def __init__(self, shards: list[str]):
        self.shards = shards


GETBATCH_ID = dataset_id("getbatch:s3://")
"""Cache namespace of GetBatch reads: blocks of ``<bucket>/<key>`` objects."""


def _plan(spans: list[Span | None], buckets) -> tuple[Dataset, Members]:
    """One member per entry: over the served dataset that indexes all the entries, so they
    share its cached blocks and replica owners; else over a dataset made for this request
    whose shards are the entries' objects (GetBatch's own cache namespace)."""
    homes = {id(s.home[0]) if s.home else None for s in spans if s is not None}
    if len(homes) == 1 and None not in homes:
        dataset = next(s.home[0] for s in spans if s is not None)
        codes = [s.home[1] if s else -1 for s in spans]
    else:
        paths = sorted({s.path for s in spans if s is not None})
        code = {p: i for i, p in enumerate(paths)}
        extents = {s.path: s.extent for s in spans if s is not None}
        versions = {s.path: s.version for s in spans if s is not None}
        dataset = Dataset(name="getbatch", url="getbatch:s3://", store=buckets, index=_Paths(paths), id=GETBATCH_ID,
                          extents=np.array([extents[p] for p in paths], np.int64),
                          shard_ids=[shard_id(p, versions[p], extents[p]) for p in paths], shard_samples=1,
                          owned=False, versions=[versions[p] for p in paths])
        codes = [code[s.path] if s else -1 for s in spans]
    n = len(spans)
    return dataset, Members(position=np.arange(n, dtype=np.int64), sample=np.arange(n, dtype=np.int64),
                            field=np.zeros(n, np.int32), shard=np.array(codes, np.int32),
                            offset=np.array([s.offset if s else 0 for s in spans], np.int64),
                            size=np.array([s.size if s else 0 for s in spans], np.int64),
                            found=np.array([s is not None for s in spans], bool), row=np.full(n, -1, np.int64))


async def _locate(state, entries: list[Entry], coer: bool) -> tuple[list[Span | None], dict[int, str]]:
    catalog = state.catalog
    found: list[Span | BaseException | None] = [catalog.known(e.bucket, e.objname, e.archpath) for e in entries]

    async def look_up(entry: Entry) -> Span | BaseException:
        try:
            return await catalog.locate(entry.bucket, entry.objname, entry.archpath)
        except (EntryMissing, StoreError) as err:
            return err

    todo = [i for i, span in enumerate(found) if span is None]
    for i, result in zip(todo, await asyncio.gather(*(look_up(entries[i]) for i in todo))):
        found[i] = result
    await _place_fields(state, found)
    spans: list[Span | None] = []
    errors: dict[int, str] = {}
    for i, (entry, result) in enumerate(zip(entries, found)):
        if isinstance(result, Span):
            spans.append(_ranged(entry, result))
        elif isinstance(result, (EntryMissing, ObjectNotFound)):
            if not coer:
                raise NotFound(entry.url)
            errors[i] = f"{entry.url} does not exist"
            spans.append(None)
        elif isinstance(result, AccessDenied):
            raise ApiError(403, "access_denied", f"{entry.url}: {result}")
        else:
            raise StoreUnavailable(f"{entry.url}: {result}")
    return spans, errors


def _failed(entries: list[Entry]) -> Callable[[SampleFailed], ApiError]:
    def answer(err: SampleFailed) -> ApiError:
        if isinstance(err.cause, ObjectNotFound):  # gone since it was located: a retry will not help
            return NotFound(entries[err.sample].url)
        return StoreUnavailable(str(err))

    return answer


@router.get("/v1/ml/moss", openapi_extra=json_body(MossReq), response_class=Response,
            responses={200: {"content": {TAR: {}, "multipart/mixed": {}},
                             "description": "The entries as an archive in request order (strm), or "
                                            "multipart: MossResp JSON, then the archive."}})
async def getbatch(request: Request, state: AppState, provider: str = "") -> Response:
    return await _getbatch(request, state, "", provider)


@router.get("/v1/ml/moss/{bucket}", openapi_extra=json_body(MossReq), response_class=Response)
async def getbatch_bucket(request: Request, state: AppState, bucket: str, provider: str = "") -> Response:
    return await _getbatch(request, state, bucket, provider)


async def _getbatch(request: Request, state: AppState, bucket: str, provider: str) -> Response:
    config = state.config
    body = await read_body(request, config.max_body)
    if not body.strip():
        raise InvalidRequest("moss: empty input (the request body must be a JSON MossReq)")
    try:
        req = MossReq.model_validate_json(body)
    except ValidationError as err:
        raise InvalidRequest(describe(err.errors())) from None
    if not req.entries:
        raise InvalidRequest("moss: empty input")
    if len(req.entries) > config.max_batch:
        raise ApiError(413, "too_many_items", f"{len(req.entries)} entries requested; the limit is "
                                              f"{config.max_batch} per batch")
    fmt = output_format(req.mime)
    tenant_of(request.scope).check_buckets({item.bucket or bucket for item in req.entries} - {""})
    if bucket and bucket not in state.catalog.buckets.stores:
        raise _not_allowed(PROVIDERS.get(provider.lower(), provider or "ais"), bucket)
    entries = _entries(req, bucket, provider, state.catalog.buckets.stores)
    views: list[Dataset] = []

    async def answer() -> Response:
        spans, errors = await _locate(state, entries, req.coer)
        view, members = _plan(spans, state.catalog.buckets)
        views.append(view)
        names = EntryNames(entries, errors)
        indices = np.arange(len(entries), dtype=np.int64)

        def chunks() -> AsyncIterator[list]:
            return stream_batch(state.coalescer, view, members, indices, continue_on_error=req.coer,
                                group_bytes=config.group_bytes, prefetch=config.prefetch_groups,
                                on_served=served_metrics(state), framing=TarFraming(names))

        if req.strm:
            return await tar_stream_response(state, "getbatch", fmt.encode(chunks()), media_type=fmt.media_type,
                                             headers={}, what=f"getbatch entries={len(entries)}",
                                             failed=_failed(entries))
        return await _multipart(state, entries, members, fmt, chunks, names)

    async def refresh() -> None:
        """An object changed under the batch: ask the store again what the entries are."""
        for entry in entries:
            state.catalog.forget(entry.bucket, entry.objname)
        if views[-1].owned:  # the entries are shards of a served dataset: reopen it
            await state.datasets.reload(views[-1].name)

    return await answer_changed_once(answer, refresh)


async def _multipart(state, entries: list[Entry], members: Members, fmt: Format, chunks, names: EntryNames):
    """``strm: false``: a ``multipart/mixed`` answer, the ``MossResp`` JSON then the archive."""
    total = int(members.size.sum())
    if total > MAX_BUFFERED:
        raise ApiError(413, "too_large", f"{total} bytes requested; a multipart answer holds at most "
                                         f"{MAX_BUFFERED} (use streaming: strm true)")
    parts: list[bytes] = []

    async def collect() -> AsyncIterator[list]:
        async for group in fmt.encode(chunks()):
            parts.extend(group)
        yield []

    response = await tar_stream_response(state, "getbatch", collect(), media_type=fmt.media_type, headers={},
                                         what=f"getbatch entries={len(entries)} multipart",
                                         failed=_failed(entries))
    async for _ in response.body_iterator:  # runs the batch to its end, with admission and metrics
        pass
    sizes = members.size.tolist()
    out = [MossOut(objname=e.objname, bucket=e.bucket, provider=e.provider, archpath=e.archpath,
                   opaque=e.source.opaque, size=0 if i in names.errors else sizes[i],
                   err_msg=names.errors.get(i, "")) for i, e in enumerate(entries)]
    meta = MossResp(uuid=secrets.token_hex(8), out=out).model_dump(exclude_defaults=True)
    boundary = secrets.token_hex(30)
    body = b"".join([
        f"--{boundary}\r\nContent-Disposition: form-data; name=\"metadata\"\r\n\r\n".encode(),
        json.dumps(meta).encode(), b"\n",
        f"\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"archive\"; filename=\"batch{fmt.extension}\"\r\n"
        "Content-Type: application/octet-stream\r\n\r\n".encode(),
        *parts, f"\r\n--{boundary}--\r\n".encode()])
    return Response(body, media_type=f"multipart/mixed; boundary={boundary}")
