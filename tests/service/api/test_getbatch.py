"""GetBatch (``/v1/ml/moss``) with the real AIStore Python SDK as the client, unchanged:
moto S3, the service as a subprocess, the SDK over a socket. Every expected byte comes
from the objects put into moto (and Python's tarfile for the shards)."""

from __future__ import annotations

import io
import random
import tarfile
from functools import partial

import httpx
import pytest
from aistore.sdk import Client
from aistore.sdk.errors import AISError, ErrObjNotFound

from shardfeed.process import free_port, start_all, start_service, stop_all

from common.datasets import make_dataset, s3_put
from common.service import metrics, wait_peers_up

pytestmark = pytest.mark.xdist_group("getbatch")  # one worker: its module services start once

BUCKET, OTHER, FORBIDDEN = "gb-main", "gb-other", "gb-forbidden"


def unindexed_shard(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.fixture(scope="module")
def objects(moto):
    """Plain objects in two buckets, a tar shard nobody indexed, and an indexed dataset."""
    rng = random.Random(12)
    s3 = moto.client()
    for name in (BUCKET, OTHER, FORBIDDEN):
        moto.create_bucket(name)
    source = {}
    for i in range(20):
        key = f"loose/{i:04d}.jpg"
        source[(BUCKET, key)] = rng.randbytes(rng.randint(0, 300_000))
        s3.put_object(Bucket=BUCKET, Key=key, Body=source[(BUCKET, key)])
    source[(OTHER, "x/y.bin")] = rng.randbytes(5000)
    s3.put_object(Bucket=OTHER, Key="x/y.bin", Body=source[(OTHER, "x/y.bin")])
    s3.put_object(Bucket=FORBIDDEN, Key="secret", Body=b"secret")
    members = {f"s/{i:03d}.{f}": rng.randbytes(rng.randint(1, 90_000)) for i in range(30) for f in ("a", "B")}
    members["x" * 150 + ".long"] = b"long-name-member"
    s3.put_object(Bucket=BUCKET, Key="raw/shard.tar", Body=unindexed_shard(members))
    indexed = make_dataset(s3_put(s3, BUCKET, "ds"), samples=60, per_shard=20)
    return source, members, indexed


@pytest.fixture(scope="module")
def service(objects, moto, tmp_path_factory):
    cache = tmp_path_factory.mktemp("getbatch") / "cache"
    with start_service({"ds": f"s3://{BUCKET}/ds"}, cache_dir=cache, env=moto.env(),
                       args=["--bucket", BUCKET, "--bucket", OTHER, "--block-size", "64KiB"]) as svc:
        yield svc


@pytest.fixture
def client(service):
    return Client(service.url)


def fetch(batch, **kw):
    return [(info, data) for info, data in batch.get(**kw)]


def test_plain_objects_come_back_byte_exact_in_request_order(client, objects):
    source = objects[0]
    bucket = client.bucket(BUCKET, provider="s3")
    keys = [f"loose/{i:04d}.jpg" for i in (3, 0, 19, 3, 7)]
    got = fetch(client.batch(keys, bucket=bucket))
    assert [(i.obj_name, i.bucket, i.provider, i.err_msg) for i, _ in got] == \
        [(k, BUCKET, "aws", None) for k in keys]
    assert [d for _, d in got] == [source[(BUCKET, k)] for k in keys]
    again = fetch(client.batch(keys, bucket=bucket))  # warm: from the block cache
    assert [d for _, d in again] == [source[(BUCKET, k)] for k in keys]


def test_files_inside_unindexed_and_indexed_shards_by_archpath(client, objects):
    source, members, indexed = objects
    batch = client.batch(bucket=client.bucket(BUCKET, provider="aws"))
    names = ["s/007.B", "s/000.a", "x" * 150 + ".long", "s/029.a"]
    for name in names:
        batch.add("raw/shard.tar", archpath=name)
    batch.add("ds/shards/part-0001.tar", archpath="sample000025.bin")
    batch.add("ds/shards/part-0002.tar", archpath="/sample000040.cls")
    got = fetch(batch)
    assert [d for _, d in got] == [members[n] for n in names] + [indexed[(25, "bin")], indexed[(40, "cls")]]
    assert [i.archpath for i, _ in got][:2] == ["s/007.B", "s/000.a"]


def test_ranges_of_objects_and_of_archived_files(client, objects):
    source, members, _ = objects
    obj = source[(BUCKET, "loose/0001.jpg")]
    batch = client.batch(bucket=client.bucket(BUCKET, provider="s3"))
    batch.add("loose/0001.jpg", start=10, length=100)
    batch.add("loose/0001.jpg", start=50, length=-1)
    batch.add("raw/shard.tar", archpath="s/003.a", start=1, length=5)
    got = fetch(batch)
    assert [d for _, d in got] == [obj[10:110], obj[50:], members["s/003.a"][1:6]]
    batch = client.batch(bucket=client.bucket(BUCKET, provider="s3"))
    batch.add("loose/0001.jpg", start=len(obj), length=1)
    with pytest.raises(AISError) as err:
        fetch(batch)
    assert err.value.status_code == 416


def test_a_missing_entry_with_and_without_coer(client, objects):
    source = objects[0]
    bucket = client.bucket(BUCKET, provider="s3")
    batch = client.batch(["loose/0002.jpg", "nope.jpg"], bucket=bucket, cont_on_err=True)
    batch.add("raw/shard.tar", archpath="no/such.member")
    got = fetch(batch)
    assert got[0][1] == source[(BUCKET, "loose/0002.jpg")] and got[0][0].err_msg is None
    assert [(i.obj_name, i.err_msg, d) for i, d in got[1:]] == [
        ("nope.jpg", "Batch entry failed on the server", b""),
        ("raw/shard.tar", "Batch entry failed on the server", b"")]
    with pytest.raises(ErrObjNotFound) as err:
        fetch(client.batch(["loose/0002.jpg", "nope.jpg"], bucket=bucket, cont_on_err=False))
    assert err.value.status_code == 404 and f"aws://{BUCKET}/nope.jpg does not exist" in err.value.message


def test_multipart_mode_gives_real_sizes_errors_and_opaque(client, objects):
    source, members, _ = objects
    batch = client.batch(bucket=client.bucket(BUCKET, provider="s3"), streaming_get=False)
    batch.add("loose/0005.jpg", opaque=b"\xfb\xff-id-1")
    batch.add("missing.bin")
    batch.add("raw/shard.tar", archpath="s/010.B", opaque=b"two")
    for decode_as_stream in (False, True):
        got = fetch(batch, decode_as_stream=decode_as_stream, clear_batch=False)
        (a, da), (b, db), (c, dc) = got
        assert (da, a.size, a.opaque, a.err_msg) == (source[(BUCKET, "loose/0005.jpg")],
                                                     len(source[(BUCKET, "loose/0005.jpg")]), b"\xfb\xff-id-1", None)
        assert (db, b.size, b.err_msg) == (b"", 0, f"aws://{BUCKET}/missing.bin does not exist")
        assert (dc, c.size, c.archpath, c.opaque) == (members["s/010.B"], len(members["s/010.B"]), "s/010.B", b"two")


def test_opaque_is_echoed_in_streaming_mode_and_onob_drops_the_bucket(client, objects, service):
    source = objects[0]
    batch = client.batch(bucket=client.bucket(BUCKET, provider="s3"), only_obj_name=True)
    batch.add("loose/0004.jpg", opaque=b"abc")
    (info, data), = fetch(batch)
    assert (info.opaque, data) == (b"abc", source[(BUCKET, "loose/0004.jpg")])
    body = {"in": [{"objname": "loose/0004.jpg", "bucket": BUCKET, "provider": "aws"},
                   {"objname": "raw/shard.tar", "bucket": BUCKET, "provider": "aws", "archpath": "s/001.a"},
                   {"objname": "gone", "bucket": BUCKET, "provider": "aws"}],
            "mime": ".tar", "coer": True, "strm": True}
    for onob, prefix in ((True, ""), (False, f"{BUCKET}/")):
        resp = httpx.request("GET", f"{service.url}/v1/ml/moss", json={**body, "onob": onob})
        with tarfile.open(fileobj=io.BytesIO(resp.content)) as tar:
            assert tar.getnames() == [f"{prefix}loose/0004.jpg", f"{prefix}raw/shard.tar/s/001.a",
                                      f"__404__/{prefix}gone"]


def test_two_buckets_in_one_batch_and_a_gzipped_archive(client, objects):
    source = objects[0]
    for fmt in (".tar", ".tgz", ".tar.gz"):
        batch = client.batch(bucket=client.bucket(BUCKET, provider="s3"), output_format=fmt)
        batch.add("loose/0009.jpg")
        batch.add("x/y.bin", bck=OTHER, provider="s3")
        got = fetch(batch)
        assert [(i.bucket, d) for i, d in got] == [(BUCKET, source[(BUCKET, "loose/0009.jpg")]),
                                                   (OTHER, source[(OTHER, "x/y.bin")])]


def test_a_bucket_not_allowed_is_a_4xx_and_never_read(client, service):
    for batch in (client.batch(["secret"], bucket=client.bucket(FORBIDDEN, provider="s3")),
                  client.batch(bucket=client.bucket(BUCKET, provider="s3")).add("secret", bck=FORBIDDEN,
                                                                                provider="aws")):
        with pytest.raises(AISError) as err:
            fetch(batch)
        assert err.value.status_code == 403 and f"aws://{FORBIDDEN}" in err.value.message
    assert b"secret" not in service.log().encode()


def test_an_empty_batch_a_zip_and_malformed_bodies_are_4xx(client, service):
    with pytest.raises(ValueError):  # the SDK refuses an empty batch before sending
        fetch(client.batch(bucket=client.bucket(BUCKET, provider="s3")))
    with pytest.raises(AISError) as err:
        fetch(client.batch(["loose/0001.jpg"], bucket=client.bucket(BUCKET, provider="s3"), output_format=".zip"))
    assert err.value.status_code == 400 and "not supported" in err.value.message
    for body in (b"", b"{", b'{"in": []}', b'{"in": [{"objname": ""}]}', b'{"in": "x"}',
                 b'{"in": [{"objname": "a/../b", "bucket": "gb-main"}]}',
                 b'{"in": [{"objname": "a", "bucket": "gb-main", "provider": "gcp"}]}',
                 b'{"in": [{"objname": "a", "bucket": "gb-main", "start": 5}]}',
                 b'{"in": [{"objname": "a"}]}'):
        resp = httpx.request("GET", f"{service.url}/v1/ml/moss", content=body,
                             headers={"Content-Type": "application/json"})
        assert 400 <= resp.status_code < 500, (body, resp.status_code, resp.text)
        assert set(resp.json()["error"]) == {"code", "message"}
    assert httpx.post(f"{service.url}/v1/ml/moss", json={"in": []}).status_code == 405


@pytest.mark.slow
def test_with_replicas_the_replica_asked_reads_the_entries_itself(objects, moto, tmp_path):
    source = objects[0]
    ports = [free_port() for _ in range(2)]
    peers = ",".join(f"{n}=http://127.0.0.1:{p}" for n, p in zip("ab", ports))
    services = start_all([partial(start_service, {"ds": f"s3://{BUCKET}/ds"}, cache_dir=tmp_path / f"cache-{i}",
                                  port=ports[i], env=moto.env(),
                                  args=["--node-id", "ab"[i], "--peers", peers, "--bucket", BUCKET]) for i in range(2)])
    try:
        wait_peers_up([s.url for s in services], 2, 10)
        client = Client(services[0].url)
        keys = [f"loose/{i:04d}.jpg" for i in range(20)]
        got = fetch(client.batch(keys, bucket=client.bucket(BUCKET, provider="s3")))
        assert [d for _, d in got] == [source[(BUCKET, k)] for k in keys]
        seen = metrics(services[0].url)
        assert seen.get("shardfeed_peer_requests_total", 0) == 0 == seen.get("shardfeed_peer_fallbacks_total", 0)
    finally:
        stop_all(services)


@pytest.mark.slow
def test_with_tokens_the_sdk_needs_its_token(objects, moto, tmp_path):
    source = objects[0]
    with start_service({}, cache_dir=tmp_path / "cache", env={**moto.env(), "SHARDFEED_TOKENS": "s3cret"},
                       args=["--bucket", BUCKET]) as svc:
        keys = ["loose/0001.jpg"]
        with pytest.raises(AISError) as err:
            fetch(Client(svc.url).batch(keys, bucket=Client(svc.url).bucket(BUCKET, provider="s3")))
        assert err.value.status_code == 401
        client = Client(svc.url, token="s3cret")
        assert [d for _, d in fetch(client.batch(keys, bucket=client.bucket(BUCKET, provider="s3")))] == \
            [source[(BUCKET, "loose/0001.jpg")]]


@pytest.mark.slow
def test_a_range_of_a_large_object_reads_its_blocks_not_a_window(objects, moto, tmp_path):
    # Served datasets the cache holds whole are fetched in 8 MiB windows (an epoch will want
    # the rest); a GetBatch request's objects are not, so a small range costs a block or two.
    data = random.Random(13).randbytes(4 << 20)
    moto.client().put_object(Bucket=BUCKET, Key="big/one.bin", Body=data)
    with start_service(cache_dir=tmp_path / "cache", env=moto.env(),
                       args=["--bucket", BUCKET, "--block-size", "64KiB"]) as svc:
        batch = Client(svc.url).batch(bucket=Client(svc.url).bucket(BUCKET, provider="s3"))
        batch.add("big/one.bin", start=1_000_000, length=100)
        assert [d for _, d in fetch(batch)] == [data[1_000_000:1_000_100]]
        assert metrics(svc.url)["shardfeed_store_bytes_total"] <= 2 * 65536
