"""The shard writer: samples laid out as uncompressed tar shards plus ``index.parquet``.

``write_shards`` is the one shard writer (``shardfeed pack``, ``shardfeed seed`` and the
embedded default dataset use it): it streams samples into shards of about
``shard_size``, never splitting a sample, uploads each as it is laid out (S3: in parts,
so memory stays at about one upload part), and writes the index last, so an
interrupted run leaves no index that points at missing data. It lives beside the index
format it writes; the service itself never writes shards.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Iterable

import pyarrow as pa
from tqdm import tqdm

from shardfeed.service.datasets.index import Index, write_index
from shardfeed.service.datasets.indexfile import INDEX_FILE, SCHEMA, IndexFormatError, split_member_name
from shardfeed.service.stores import ObjectNotFound, Store
from shardfeed.tar import END_OF_ARCHIVE, member_header, padding

Sample = tuple[str, list[tuple[str, bytes]]]
"""``(key, [(field, data), ...])``: one sample, members in the order they are written."""

DEFAULT_SHARD_SIZE = 64 << 20


def shard_name(n: int) -> str:
    return f"shard-{n:06d}.tar"


class _ShardWriter:
    """Lays samples out as tar shards, one shard at a time, as a stream of chunks: a shard
    never holds more than its store's upload part in memory (``Store.write_stream``)."""

    def __init__(self, samples: AsyncIterator[Sample], shard_size: int, bar: tqdm):
        self._samples = samples
        self._shard_size = shard_size
        self._bar = bar
        self._held: Sample | None = None  # the sample that did not fit in the previous shard
        self.next_sample = 0

    async def next_shard(self) -> bool:
        """Whether any sample is left for another shard."""
        if self._held is None:
            self._held = await anext(self._samples, None)
        return self._held is not None

    async def chunks(self, name: str, rows: dict[str, list]) -> AsyncIterator[bytes]:
        """The bytes of shard ``name``; its index rows are appended to ``rows`` as they go out."""
        length = 0
        while True:
            sample = self._held or await anext(self._samples, None)
            self._held = None
            if sample is None:
                break
            key, members = sample
            if not members:
                raise ValueError(f"sample {key!r} has no members")
            for field, _ in members:
                if split_member_name(f"{key}.{field}") != (key, field):  # re-indexing must give it back
                    raise ValueError(f"cannot name a member {key!r} + {field!r} in WebDataset style "
                                     "(no dot in the key's file name, lowercase field)")
            headers = [member_header(f"{key}.{field}", len(data)) for field, data in members]
            need = sum(len(h) + len(d) + padding(len(d)) for h, (_, d) in zip(headers, members))
            if length and length + need + len(END_OF_ARCHIVE) > self._shard_size:
                self._held = sample  # never split a sample: it opens the next shard
                break
            parts = []
            for header, (field, data) in zip(headers, members):
                length += len(header)
                for column, value in (("sample", self.next_sample), ("key", key), ("field", field),
                                      ("shard", name), ("offset", length), ("size", len(data))):
                    rows[column].append(value)
                parts += (header, data, bytes(padding(len(data))))
                length += len(data) + padding(len(data))
            self.next_sample += 1
            self._bar.update(sum(len(d) for _, d in members))
            yield b"".join(parts)
        yield END_OF_ARCHIVE


async def _in_thread(samples: Iterable[Sample]) -> AsyncIterator[Sample]:
    """A blocking iterator (files on disk, generated data) pulled in a worker thread."""
    it = iter(samples)
    while (sample := await asyncio.to_thread(next, it, None)) is not None:
        yield sample


async def refuse_existing(store: Store) -> None:
    """Writing shards over a dataset would silently invalidate its index: refuse instead."""
    try:
        await store.head(INDEX_FILE)
    except ObjectNotFound:
        return
    raise FileExistsError(f"{store.url} already holds a dataset ({INDEX_FILE}); choose an empty destination")


async def write_shards(store: Store, samples: Iterable[Sample] | AsyncIterable[Sample], *,
                       shard_size: int = DEFAULT_SHARD_SIZE, total_bytes: int | None = None, desc: str = "write",
                       progress: bool = True) -> Index:
    """Write ``samples`` as ``shard-000000.tar``, ... plus ``index.parquet`` (last), and return the index.

    shard_size: target shard size in bytes; a shard holds whole samples only, so one
    sample larger than this gets a shard of its own.
    total_bytes: payload bytes expected, for the progress bar.
    progress: show a tqdm bar (payload bytes) on stderr when it is a terminal.
    A plain iterator of ``samples`` is consumed in a worker thread, so it may do blocking I/O.
    Refuses (``FileExistsError``) a destination that already has an ``index.parquet``.
    """
    if shard_size < 1:
        raise ValueError(f"shard size must be positive, not {shard_size}")
    await refuse_existing(store)
    source = samples if isinstance(samples, AsyncIterable) else _in_thread(samples)
    tables = []
    with tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc=desc,
              disable=None if progress else True) as bar:
        writer = _ShardWriter(aiter(source), shard_size, bar)
        while await writer.next_shard():
            rows: dict[str, list] = {c: [] for c in SCHEMA.names}
            await store.write_stream(shard_name(len(tables)), writer.chunks(shard_name(len(tables)), rows))
            tables.append(pa.table(rows, schema=SCHEMA))
    if not tables:
        raise IndexFormatError(f"{store.url}: no samples to write")
    index = await asyncio.to_thread(lambda: Index.from_table(pa.concat_tables(tables)))
    await write_index(store, index)
    return index
