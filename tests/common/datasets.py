"""Datasets built for tests with Python's own ``tarfile``: an independent source of truth.

The shards are written with ``tarfile`` in WebDataset naming and the index rows are
taken from ``tarfile``'s own member offsets, so a test compares what shardfeed serves
against bytes that no shardfeed code produced.
"""

from __future__ import annotations

import io
import random
import tarfile
from collections.abc import Callable

import pyarrow as pa

from shardfeed.service.datasets.index import Index, parquet_bytes
from shardfeed.service.datasets.indexfile import SCHEMA


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
