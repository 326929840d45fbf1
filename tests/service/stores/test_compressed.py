"""Raw shards served from compressed ones (``stores/compressed.py``), over S3, against datasets
the peers' own writers made: Streaming's ``MDSWriter`` with each of its codecs, LitData's
``BinaryWriter`` with zstd in both layouts. The truth is the peers' own decompression (and, for
LitData's framed chunks, the same items written uncompressed by LitData)."""

from __future__ import annotations

import asyncio
import json
import random
import re
from pathlib import Path

import numpy as np
import pytest

from shardfeed.benchmarks.loaders import import_streaming
from shardfeed.retry import Backoff
from shardfeed.service.stores import CorruptObject, ObjectChanged, ObjectInfo, ShortRead, open_store
from shardfeed.service.stores.compressed import FIRST_READ, Compressed, CompressedShards

# The peers' own writers make the datasets: mosaicml-streaming and litdata, installed --no-deps (test-only).
streaming = import_streaming()
if streaming is None:
    pytest.skip("mosaicml-streaming is not installed", allow_module_level=True)
litdata_writer = pytest.importorskip("litdata.streaming.writer", reason="litdata is not installed")

from litdata.streaming.compression import _COMPRESSORS as litdata_compressors  # noqa: E402
from streaming.base.compression import decompress as mds_decompress  # noqa: E402

MDS_CODECS = ["zstd", "zstd:7", "gz", "gz:1", "bz2", "br", "snappy"]
ITEMS_PER_CHUNK = 90  # LitData: the same chunks compressed or not


def run(coro):
    return asyncio.run(coro)


def sample(i: int) -> bytes:
    """Bytes that compress about 2:1, of sizes 0 to ~3 KiB."""
    rng = random.Random(i)
    return rng.randbytes(rng.randrange(1500)) + b"label %d " % i * rng.randrange(100)


def write_mds(out: Path, codec: str, samples: int = 400, size_limit: int = 96 << 10) -> None:
    with streaming.MDSWriter(out=str(out), columns={"x": "bytes", "y": "int", "s": "str"}, compression=codec,
                             size_limit=size_limit) as writer:
        for i in range(samples):
            writer.write({"x": sample(i), "y": i, "s": "s" * (i % 13)})


def write_litdata(out: Path, level: str | None) -> None:
    """LitData pytree chunks: framed zstd (``batch``), whole-file zstd (``chunk``) or none."""
    out.mkdir()
    options = {"compression": "zstd", "compression_level": level, "compression_batch_size": 16} if level else {}
    writer = litdata_writer.BinaryWriter(str(out), chunk_size=ITEMS_PER_CHUNK, **options)
    for i in range(300):
        # An array leaf keeps LitData's pytree chunks (rows of plain values become an Arrow footer).
        writer[i] = {"a": np.arange(i % 40, dtype=np.int32), "x": sample(i), "y": i}
    writer.done()
    writer.merge(1)


@pytest.fixture(scope="module")
def peers(tmp_path_factory) -> Path:
    """Every dataset, written once: ``mds-<codec>``, ``lit-batch``, ``lit-chunk``, ``lit-plain``."""
    root = tmp_path_factory.mktemp("peers")
    for codec in MDS_CODECS:
        write_mds(root / f"mds-{codec}", codec)
    for level in ("batch", "chunk", None):
        write_litdata(root / f"lit-{level or 'plain'}", level)
    return root


def shards_of(folder: Path) -> tuple[dict[str, Compressed], dict[str, bytes]]:
    """What the dataset's index.json says of its compressed shards (raw name -> ``Compressed``),
    and each raw shard's bytes as the peer itself makes them."""
    index = json.loads((folder / "index.json").read_text())
    shards, raw = {}, {}
    if "shards" in index:  # MDS
        for shard in index["shards"]:
            name, zipped = shard["raw_data"]["basename"], shard["zip_data"]["basename"]
            shards[name] = Compressed(zipped, shard["compression"], shard["raw_data"]["bytes"])
            raw[name] = mds_decompress(shard["compression"], (folder / zipped).read_bytes())
        return shards, raw
    codec, level = index["config"]["compression"], index["config"]["compression_level"]
    for chunk in index["chunks"]:
        name = chunk["filename"]
        if level == "batch":  # framed: its raw chunk is the one LitData writes uncompressed
            shards[name] = Compressed(name, codec, frames=True)
            raw[name] = (folder.parent / "lit-plain" / name).read_bytes()
        else:
            plain = re.sub(rf"\.{re.escape(codec)}\.bin$", ".bin", name)
            shards[plain] = Compressed(name, codec, chunk["chunk_bytes"])
            raw[plain] = litdata_compressors[codec].decompress((folder / name).read_bytes())
    return shards, raw


def s3(bucket: str, prefix: str):
    return open_store(f"s3://{bucket}/{prefix}", backoff=Backoff(attempts=3, base=0.01, cap=0.05))


async def upload(store, folder: Path) -> None:
    await asyncio.gather(*(store.write(p.name, p.read_bytes()) for p in sorted(folder.iterdir())))


def ranges(size: int, table: int, rng: random.Random) -> list[tuple[int, int]]:
    """Ranges of a raw shard of ``size`` bytes whose header is ``table`` bytes: its header, its
    ends, across the header's end, and anywhere."""
    out = [(0, 4), (0, table), (table - 3, 10), (size - 1, 1), (0, size), (size, 0), (5, 0)]
    for _ in range(12):
        start = rng.randrange(size)
        out.append((start, rng.randrange(size - start + 1)))
    return out


@pytest.mark.both_s3
@pytest.mark.parametrize("dataset", [f"mds-{codec}" for codec in MDS_CODECS] + ["lit-batch", "lit-chunk"])
def test_every_raw_range_is_the_peers_own_decompression(peers, bucket, dataset):
    shards, truth = shards_of(peers / dataset)
    assert len(shards) >= 2

    async def go():
        async with s3(bucket, dataset) as plain:
            await upload(plain, peers / dataset)
            store = CompressedShards(plain, shards)
            listed = {info.path: info for info in await store.list()}
            rng = random.Random(dataset)
            for raw, shard in shards.items():
                compressed = (await plain.head(shard.path)).etag
                assert listed[raw].etag == compressed and listed[shard.path].etag == compressed
                assert listed[raw].size == (len(truth[raw]) if shard.raw_size else listed[shard.path].size)
                assert await store.head(raw) == ObjectInfo(raw, len(truth[raw]), compressed)
                items = int.from_bytes(truth[raw][:4], "little")
                for offset, size in ranges(len(truth[raw]), 4 * (items + 2), rng):
                    got = await store.read_range(raw, offset, size, compressed)
                    assert got == truth[raw][offset:offset + size], (raw, offset, size)
                pieces = await store.read_pieces(raw, 3, len(truth[raw]) - 3, 4096, compressed)
                assert b"".join(pieces) == truth[raw][3:] and {len(p) for p in pieces[:-1]} <= {4096}
                assert await store.read(raw) == truth[raw]  # no version: the one there now
                with pytest.raises(ShortRead, match=re.escape(f"{raw}: wanted 2 bytes")):
                    await store.read_range(raw, len(truth[raw]) - 1, 2, compressed)
            assert await store.read("index.json") == (peers / dataset / "index.json").read_bytes()

    run(go())


def test_a_framed_chunk_reads_its_table_and_the_frames_a_range_needs(peers, bucket):
    shards, truth = shards_of(peers / "lit-batch")
    raw = next(iter(shards))
    table = 4 * (ITEMS_PER_CHUNK + 2)

    async def go():
        async with s3(bucket, "lit") as plain:
            await upload(plain, peers / "lit-batch")
            version = (await plain.head(raw)).etag
            size = (await plain.head(raw)).size
            store = CompressedShards(plain, shards)
            before = plain.bytes_read
            assert await store.read_range(raw, 0, table, version) == truth[raw][:table]
            assert plain.bytes_read - before == min(FIRST_READ, size)  # the frame table alone
            offsets = np.frombuffer(truth[raw], "<u4", ITEMS_PER_CHUNK + 1, 4)
            item = slice(int(offsets[40]), int(offsets[41]))  # in the third frame of 16 items
            before = plain.bytes_read
            assert await store.read_range(raw, item.start, item.stop - item.start, version) == truth[raw][item]
            assert 0 < plain.bytes_read - before < size / 4  # that frame only
            requests = plain.requests
            assert await store.read_range(raw, item.start, 1, version) == truth[raw][item][:1]
            assert plain.requests == requests  # held

    run(go())


def test_a_read_near_the_start_decodes_a_prefix_and_holds_nothing(tmp_path, bucket):
    write_mds(tmp_path / "big", "zstd", samples=4000, size_limit=4 << 20)
    shards, truth = shards_of(tmp_path / "big")
    raw, shard = next(iter(shards.items()))
    items = int.from_bytes(truth[raw][:4], "little")
    header = 4 * (items + 2)  # what the index's scan of a shard reads

    async def go():
        async with s3(bucket, "big") as plain:
            await upload(plain, tmp_path / "big")
            version = (await plain.head(shard.path)).etag
            zipped = (await plain.head(shard.path)).size
            assert zipped > 16 * FIRST_READ
            store = CompressedShards(plain, shards)
            assert await store.read_range(raw, 0, header, version) == truth[raw][:header]
            prefix = plain.bytes_read  # a zstd block (128 KiB raw) decodes only once it is all in
            assert prefix <= 4 * FIRST_READ and store.held.weight == 0
            far = len(truth[raw]) - 100
            assert await store.read_range(raw, far, 100, version) == truth[raw][far:]
            assert plain.bytes_read == prefix + zipped and store.held.weight == len(truth[raw])
            requests = plain.requests
            assert await store.read_range(raw, 0, header, version) == truth[raw][:header]  # held now
            assert plain.requests == requests

    run(go())


def test_readers_of_a_shard_share_one_read_and_the_held_shards_stay_within_budget(peers, bucket):
    shards, truth = shards_of(peers / "mds-zstd")
    budget = int(2.5 * max(map(len, truth.values())))

    async def go():
        async with s3(bucket, "mds") as plain:
            await upload(plain, peers / "mds-zstd")
            versions = {raw: (await plain.head(shard.path)).etag for raw, shard in shards.items()}
            store = CompressedShards(plain, shards, held_bytes=budget)
            first = next(iter(shards))
            size = len(truth[first])
            wanted = [(size // 2 + 9 * k, 1000) for k in range(8)]
            before = plain.requests
            got = await asyncio.gather(*(store.read_range(first, o, n, versions[first]) for o, n in wanted))
            assert got == [truth[first][o:o + n] for o, n in wanted]
            assert plain.requests - before == 1  # one whole read for eight readers
            for raw in shards:
                end = len(truth[raw])
                assert await store.read_range(raw, end - 100, 100, versions[raw]) == truth[raw][-100:]
                assert store.held.weight <= budget
            before = plain.requests
            await store.read_range(first, size - 100, 100, versions[first])
            assert plain.requests - before == 1  # the least recently used, dropped

    run(go())


def test_an_overwritten_shard_is_object_changed_and_then_read_at_its_new_version(peers, bucket):
    mds, mds_truth = shards_of(peers / "mds-gz")
    lit, lit_truth = shards_of(peers / "lit-batch")

    async def go():
        async with s3(bucket, "mixed") as plain:
            await upload(plain, peers / "mds-gz")
            await upload(plain, peers / "lit-batch")
            store = CompressedShards(plain, {**mds, **lit})
            (a, one), (_, two) = list(mds.items())[:2]
            (c, three), (d, four) = list(lit.items())[:2]
            old = {raw: (await plain.head(s.path)).etag for raw, s in [(a, one), (c, three)]}
            # Another shard's bytes under the same names.
            await plain.write(one.path, (peers / "mds-gz" / two.path).read_bytes())
            await plain.write(three.path, (peers / "lit-batch" / four.path).read_bytes())
            for raw in (a, c):
                with pytest.raises(ObjectChanged):
                    await store.read_range(raw, 0, 4, old[raw])
                with pytest.raises(ObjectChanged):
                    await store.read_range(raw, 5000, 100, old[raw])
            new = {info.path: info.etag for info in await store.list()}
            assert new[a] != old[a] and new[c] != old[c]
            assert await store.read_range(c, 0, 4000, new[c]) == lit_truth[d][:4000]
            # An MDS shard's index gives its raw size: another shard's bytes are found out.
            with pytest.raises(CorruptObject, match=f"{a}: {one.path} decompresses to .* its index says"):
                await store.read_range(a, len(mds_truth[a]) - 100, 100, new[a])

    run(go())


@pytest.mark.parametrize("codec", ["gz", "zstd", "bz2", "snappy"])
def test_corrupt_compressed_bytes_are_corrupt_object_naming_the_shard(peers, bucket, codec):
    shards, truth = shards_of(peers / f"mds-{codec}")
    raw, shard = next(iter(shards.items()))
    zipped = (peers / f"mds-{codec}" / shard.path).read_bytes()

    async def go():
        async with s3(bucket, codec) as plain:
            store = CompressedShards(plain, shards)
            cut = zipped[:len(zipped) // 2]
            flipped = bytearray(zipped)
            flipped[len(zipped) // 2] ^= 0xFF  # gzip's and bzip2's checksums see this; zstd and snappy need not
            for bad in [cut, b"not " + zipped] + ([bytes(flipped)] if codec in ("gz", "bz2") else []):
                await plain.write(shard.path, bad)
                with pytest.raises(CorruptObject, match=re.escape(f"{raw}: {shard.path}")):
                    await store.read_range(raw, len(truth[raw]) - 10, 10)
            await plain.write(shard.path, zipped)
            wrong = CompressedShards(plain, {raw: Compressed(shard.path, codec, shard.raw_size + 1)})
            with pytest.raises(CorruptObject, match="its index says"):
                await wrong.read_range(raw, 0, 100)

    run(go())


def test_a_framed_chunk_with_a_bad_table_or_frame_is_corrupt_object(peers, bucket):
    shards, truth = shards_of(peers / "lit-batch")
    raw = next(iter(shards))
    chunk = (peers / "lit-batch" / raw).read_bytes()

    async def go():
        async with s3(bucket, "bad") as plain:
            store = CompressedShards(plain, shards)
            for bad, says in [(b"LDFZ02" + chunk[6:], "no LDFZ01 magic"),
                              (chunk[:8] + b"\x02" + chunk[9:], "version 2 is not understood"),
                              (chunk[:40], "cut short"),
                              (chunk[:-30] + b"\xff" * 30, "frame 5 does not decompress")]:
                await plain.write(raw, bad)
                with pytest.raises(CorruptObject, match=re.escape(f"{raw}: {raw}") + ".*" + says):
                    await store.read_range(raw, len(truth[raw]) - 10, 10)

    run(go())


def test_other_paths_pass_through_and_raw_shards_are_never_written(tmp_path):
    async def go():
        async with open_store(tmp_path.as_uri()) as plain:
            store = CompressedShards(plain, {"a.mds": Compressed("a.mds.zstd", "zstd", 3)})
            await store.write("index.parquet", b"rows")
            assert await store.read_range("index.parquet", 1, 2) == b"ow"
            assert [info.path for info in await store.list()] == ["index.parquet"]
            with pytest.raises(Exception, match="a.mds: served from a.mds.zstd"):
                await store.write("a.mds", b"x")

    run(go())


def test_a_codec_the_peers_do_not_write_is_refused():
    with pytest.raises(ValueError, match="compression 'lz4' is not understood"):
        Compressed("a.mds.lz4", "lz4")
    with pytest.raises(ValueError, match="framed chunks are zstd"):
        Compressed("a.bin", "gz", frames=True)
