"""Datasets built for tests with Python's own ``tarfile``: an independent source of truth.

The shards are written with ``tarfile`` in WebDataset naming and the index rows are
taken from ``tarfile``'s own member offsets, so a test compares what shardfeed serves
against bytes that no shardfeed code produced.
"""

from __future__ import annotations

import asyncio
import io
import random
import tarfile
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa

from shardfeed.service.datasets.index import Index, parquet_bytes, write_index
from shardfeed.service.datasets.indexfile import SCHEMA
from shardfeed.service.datasets.tarscan import index_shards
from shardfeed.service.stores import open_store
from shardfeed.tar import member_spans


def make_dataset(put: Callable[[str, bytes], None], *, samples: int = 200, per_shard: int = 50,
                 sizes: tuple[int, int] = (100, 20_000), seed: int = 0,
                 extra_field_every: int = 7) -> dict[tuple[int, str], bytes]:
    """Write shards + index.parquet through ``put(path, data)``; return ``{(sample, field): bytes}``.

    Every sample has ``bin`` and ``cls``; every ``extra_field_every``-th also has ``json``,
    so requests for ``json`` hit samples that lack it.
    """
    rng = random.Random(seed)
    source: dict[tuple[int, str], bytes] = {}
    rows = {name: [] for name in SCHEMA.names}
    for first in range(0, samples, per_shard):
        shard = f"shards/part-{first // per_shard:04d}.tar"
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for i in range(first, min(first + per_shard, samples)):
                key = f"sample{i:06d}"
                fields = {"bin": rng.randbytes(rng.randint(*sizes)), "cls": str(i % 10).encode()}
                if i % extra_field_every == 0:
                    fields["json"] = b'{"i": %d}' % i
                for field, data in fields.items():
                    info = tarfile.TarInfo(f"{key}.{field}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
                    source[(i, field)] = data
        archive = buf.getvalue()
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            for member in tar.getmembers():
                key, field = member.name.split(".", 1)
                rows["sample"].append(int(key[6:]))
                rows["key"].append(key)
                rows["field"].append(field)
                rows["shard"].append(shard)
                rows["offset"].append(member.offset_data)
                rows["size"].append(member.size)
        put(shard, archive)
    put("index.parquet", parquet_bytes(pa.table(rows, schema=SCHEMA)))
    Index.from_table(pa.table(rows, schema=SCHEMA))  # the table must be valid
    return source


def bucket_dataset(server, bucket: str, prefix: str = "train", **options) -> tuple[str, dict[tuple[int, str], bytes]]:
    """A new bucket on the S3 server ``server`` holding a ``make_dataset(**options)`` under
    ``prefix``: the dataset's URL and its bytes."""
    server.create_bucket(bucket)
    return f"s3://{bucket}/{prefix}", make_dataset(s3_put(server.client(), bucket, prefix), **options)


def s3_put(client, bucket: str, prefix: str) -> Callable[[str, bytes], None]:
    return lambda path, data: client.put_object(Bucket=bucket, Key=f"{prefix}/{path}", Body=data)


def dir_put(root) -> Callable[[str, bytes], None]:
    def put(path: str, data: bytes) -> None:
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    return put


def flipped(shard: bytes, mask: int = 0x5A) -> bytes:
    """``shard`` replaced in place: every member's bytes XORed with ``mask``, every header as it
    was (a new version of the same layout, which the index still describes)."""
    out = bytearray(shard)
    for _, start, stop in member_spans(shard)[0]:
        out[start:stop] = bytes(b ^ mask for b in out[start:stop])
    return bytes(out)


def _odd_sample(i: int, rng: random.Random) -> tuple[str, dict[str, bytes]]:
    """A key (some far longer than ustar's 100 bytes) and its members (stored names)."""
    key = f"dir{i % 3}/{'long-' * 25 if i % 5 == 0 else ''}s{i:04d}"
    size = rng.choice([0, 1, 511, 512, 513, 9000, 70_000])  # 70 KB spans 64 KiB blocks
    members = {f"{key}.bin": rng.randbytes(size), f"{key}.CLS": str(i % 10).encode()}
    if i % 4 == 0:
        members[f"{key}.seg.png"] = rng.randbytes(300)
    return key, members


def tar_dataset(root: Path, shards: list[dict[str, bytes]], formats: list[int] | None = None) -> str:
    """Shards of ``{member name: bytes}`` written by ``tarfile`` (``formats[i]`` for shard i),
    indexed by shardfeed, in the directory ``root``: its URL."""
    root.mkdir(parents=True, exist_ok=True)
    formats = formats or [tarfile.PAX_FORMAT]
    for number, members in enumerate(shards):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=formats[number % len(formats)]) as tar:
            for name, data in members.items():
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        (root / f"shard-{number}.tar").write_bytes(buf.getvalue())

    async def index() -> None:
        async with open_store(root.as_uri()) as store:
            await write_index(store, await index_shards(store))

    asyncio.run(index())
    return root.as_uri()


def odd_tar_dataset(root: Path, samples: int) -> tuple[str, dict[tuple[int, str], tuple[str, bytes]]]:
    """Two shards of whatever tar files hold (written by ``tarfile``, indexed by shardfeed): PAX
    and GNU long names, empty members, sizes either side of a tar block, an upper-case field,
    a field only some samples have. The directory's URL, and ``{(sample, field): (name, bytes)}``
    (field names in lower case, as the service serves them)."""
    rng = random.Random(7)
    source: dict[tuple[int, str], tuple[str, bytes]] = {}
    shards: list[dict[str, bytes]] = [{}, {}]
    for i in range(samples):
        key, members = _odd_sample(i, rng)
        shards[i * 2 // samples].update(members)
        for name, data in members.items():
            field = name[len(key) + 1:].lower()
            source[(i, field)] = (f"{key}.{field}", data)
    return tar_dataset(root, shards, [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT]), source
