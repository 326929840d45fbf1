"""``shardfeed pack s3://... s3://...``: loose objects streamed into tar shards + index, S3 to S3
(moto), with multipart uploads; the real CLI in a subprocess, checked with Python's tarfile."""

from __future__ import annotations

import asyncio
import io
import random
import tarfile

import pytest

from shardfeed.service.stores import StoreError, open_store

from common.cli import fails, members_through_index, ok


@pytest.fixture
def loose(bucket, s3_env):
    """Objects ``raw/dir/NNNN.{bin,cls}`` (some ``.json``) of up to 1 MiB; ``{(key, field): bytes}``."""
    rng = random.Random(3)
    s3 = s3_env.client()
    source = {}
    for i in range(48):
        fields = {"bin": rng.randbytes(rng.randint(0, 1 << 20)), "cls": b"%d" % i}
        if i % 4 == 0:
            fields["json"] = b"{}"
        for field, data in fields.items():
            s3.put_object(Bucket=bucket, Key=f"raw/dir/{i:04d}.{field}", Body=data)
            source[(f"dir/{i:04d}", field)] = data
    return source


@pytest.mark.slow
def test_pack_s3_to_s3_round_trip_is_byte_exact_with_multipart_shards(loose, bucket, s3_env):
    out = ok("pack", f"s3://{bucket}/raw", f"s3://{bucket}/packed", "--shard-size", "11MiB", "--part-size", "5MiB")
    assert out.startswith("packed 48 samples")
    index, members = members_through_index(f"s3://{bucket}/packed")
    assert members == loose
    s3 = s3_env.client()
    shards = [o for o in s3.list_objects_v2(Bucket=bucket, Prefix="packed/")["Contents"] if o["Key"].endswith(".tar")]
    # Multipart objects have an ETag "<md5 of the part md5s>-<parts>".
    assert len(shards) >= 2 and any("-" in o["ETag"] for o in shards)
    for o in shards:  # every shard is a tar file Python reads on its own, members in index order
        data = s3.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            for m in tar.getmembers():
                key, _, field = m.name.partition(".")
                assert tar.extractfile(m).read() == loose[(key, field)]
    # A second pack to the same place is refused: it would invalidate the index.
    assert "already holds a dataset" in fails("pack", f"s3://{bucket}/raw", f"s3://{bucket}/packed")
    assert "lies inside the source" in fails("pack", f"s3://{bucket}/raw", f"s3://{bucket}/raw/packed")


def test_a_failed_multipart_upload_leaves_no_object_and_no_open_upload(bucket, s3_env):
    async def broken():
        yield b"x" * (6 << 20)  # one whole part goes up...
        yield b"y" * (1 << 20)
        raise OSError("source went away")  # ...then the source fails

    async def go():
        async with open_store(f"s3://{bucket}/p", part_size=5 << 20) as store:
            with pytest.raises(OSError, match="source went away"):
                await store.write_stream("shard-000000.tar", broken())
            with pytest.raises(StoreError):
                await store.head("shard-000000.tar")
    asyncio.run(go())
    assert s3_env.client().list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
