"""seed / pack / index end to end: the real CLI in subprocesses, against SeaweedFS and moto S3 (SigV4
checked) and file://."""

import io
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardfeed import cli
from shardfeed.process import free_port
from shardfeed.seeds.synthetic import member_bytes, parse_sizes, sample_bytes, sample_size
from shardfeed.service.datasets.index import load_index
from shardfeed.service.datasets.indexfile import INDEX_FILE, IndexFormatError
from shardfeed.service.datasets.tarscan import index_shards
from shardfeed.service.stores import ObjectNotFound

from common.cli import fails, members_through_index, ok, one_line_error, refusals, run, with_store
from common.s3 import EVERY_SERVER, new_bucket, point_aws_at

SEED_ARGS = ["--samples", "40", "--size", "1KiB-12KiB", "--shard-size", "160KiB", "--fields", "bin,cls,json",
             "--seed", "7"]


def list_paths(url: str) -> list[str]:
    async def go(store):
        try:
            return [o.path for o in await store.list()]
        except ObjectNotFound:  # a file:// root that was never created
            return []
    return run(with_store(url, go))


def extract(url: str, dest: Path) -> dict[tuple[str, str], bytes]:
    """Unpack every shard at ``url`` into ``dest`` with Python's tarfile; the files by (key, field)."""
    async def go(store):
        return [await store.read(p) for p in [o.path for o in await store.list() if o.path.endswith(".tar")]]
    files = {}
    for shard in run(with_store(url, go)):
        with tarfile.open(fileobj=io.BytesIO(shard)) as tar:
            for member in tar.getmembers():
                data = tar.extractfile(member).read()
                (dest / member.name).parent.mkdir(parents=True, exist_ok=True)
                (dest / member.name).write_bytes(data)
                key, _, field = member.name.partition(".")
                files[key, field] = data
    return files


@pytest.fixture(params=["file", *EVERY_SERVER])
def root(request, tmp_path, monkeypatch):
    """A function making dataset URLs: file:// ones, or on each S3 server (SeaweedFS, moto)."""
    if request.param == "file":
        return lambda name: f"file://{tmp_path}/{name}"
    server = request.getfixturevalue(request.param)
    point_aws_at(server, monkeypatch)
    bucket = new_bucket(server)
    return lambda name: f"s3://{bucket}/data/{name}"


@pytest.mark.slow
def test_seed_pack_index_round_trip(root, tmp_path):
    seeded = root("seeded")
    assert ok("seed", seeded, *SEED_ARGS).startswith("seeded 40 samples (120 members")
    index, members = members_through_index(seeded)
    assert len(index) == 40 and len(index.shards) > 2 and index.fields == ["bin", "cls", "json"]
    sizes = parse_sizes("1KiB-12KiB")
    assert members == {(f"{i:09d}", f): member_bytes(7, i, f, sizes) for i in range(40) for f in index.fields}

    # Re-indexing from the tar headers gives exactly the index seed wrote, from few reads.
    out = ok("index", seeded)
    assert run(with_store(seeded, load_index)).to_table().equals(index.to_table())
    if seeded.startswith("s3://"):
        requests = int(out.split(", ")[-2].split()[0])
        assert requests <= len(index.shards) + 1  # one window per shard plus the listing

    # seed -> files on disk (with a subdirectory) -> pack -> index.
    src = tmp_path / "src"
    files = extract(seeded, src)
    (src / "more" / "deeper").mkdir(parents=True)
    (src / "more" / "deeper" / "x1.seg.PNG").write_bytes(b"png" * 1000)
    (src / "more" / "deeper" / "x1.cls").write_bytes(b"3")
    (src / ".DS_Store").write_bytes(b"ignored")
    files["more/deeper/x1", "seg.png"], files["more/deeper/x1", "cls"] = b"png" * 1000, b"3"
    packed = root("packed")
    assert ok("pack", str(src), packed, "--shard-size", "100KiB").startswith("packed 41 samples")
    packed_index, packed_members = members_through_index(packed)
    assert packed_members == files
    assert packed_index.sample_fields(len(packed_index) - 1) == ["cls", "seg.png"]
    ok("index", packed)
    assert run(with_store(packed, load_index)).to_table().equals(packed_index.to_table())


def test_index_of_shards_written_by_python_tarfile(root):
    url = root("foreign")
    shards = {
        "train/a.tar": [("s1/0001.jpg", b"j" * 3000), ("s1/0001.CLS", b"1"), ("s1/0001.seg.png", b"p" * 700),
                        ("s1/0002.jpg", b"k" * 10), ("s1/0002.cls", b"2"), ("README", b"no extension: skipped"),
                        ("y/" * 55 + "0009.TXT", b"PAX long name")],
        "train/b.tar": [("x/" * 60 + "long.jpg", b"L" * 5000), ("x/" * 60 + "long.cls", b"9"),
                        ("0003.jpg", b"")],
    }
    expected = []  # (key, field, shard, data offset, size) as tarfile sees them
    blobs = {}
    for shard, members in shards.items():
        buf = io.BytesIO()
        # PAX records for long names in one shard, GNU ././@LongLink members in the other.
        tar_format = tarfile.PAX_FORMAT if shard.endswith("a.tar") else tarfile.GNU_FORMAT
        with tarfile.open(fileobj=buf, mode="w", format=tar_format) as tar:
            directory = tarfile.TarInfo("s1")
            directory.type = tarfile.DIRTYPE
            tar.addfile(directory)  # not sample data: skipped
            for name, data in members:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        blobs[shard] = buf.getvalue()
        with tarfile.open(fileobj=io.BytesIO(blobs[shard])) as tar:
            for m in tar.getmembers():
                if m.isfile() and m.name != "README":
                    key, _, field = m.name.rpartition("/")[2].partition(".")
                    expected.append((m.name[:len(m.name) - len(m.name.rpartition("/")[2])] + key,
                                     field.lower(), shard, m.offset_data, m.size))

    async def upload(store):
        for path, data in blobs.items():
            await store.write(path, data)
    run(with_store(url, upload))

    assert ok("index", url).startswith("indexed 5 samples (9 members")
    index = run(with_store(url, load_index))
    m = index.lookup(np.arange(len(index)))
    got = [(index.key(int(s)), index.fields[f], index.shards[sh], int(o), int(z))
           for s, f, sh, o, z in zip(m.sample, m.field, m.shard, m.offset, m.size)]
    assert got == expected
    assert index.key(2) == "y/" * 55 + "0009" and index.sample_fields(2) == ["txt"]
    assert index.key(3) == "x/" * 60 + "long"
    assert index.sample_fields(0) == ["jpg", "cls", "seg.png"]


@pytest.mark.both_s3
def test_index_reads_headers_only_and_jumps_over_large_members(bucket):
    url = f"s3://{bucket}/big"
    ok("seed", url, "--samples", "12", "--size", "96KiB", "--shard-size", "600KiB", "--fields", "bin")

    async def go(store):
        shard_bytes = sum(o.size for o in await store.list())
        before = store.requests
        index = await index_shards(store, window=8 << 10, progress=False)
        return index, store.requests - before, store.bytes_read, shard_bytes

    index, requests, bytes_read, shard_bytes = run(with_store(url, go))
    assert len(index) == 12 and len(index.shards) == 2
    # One small read per member header plus one for each end-of-archive marker, plus the listing.
    assert requests == 12 + 2 + 1
    assert bytes_read < 0.15 * shard_bytes


@pytest.mark.parametrize("size, samples, most_requests, most_read", [
    ("1MiB", 12, 12 + 3 + 1, 0.10),  # a probe per member and per end-of-archive, plus the listing
    ("10KiB", 600, 8, 1.0),  # 3 shards: as many requests as the window-only scan made before the probe
])
def test_index_opens_each_shard_with_a_probe_and_grows_the_window_for_small_members(
        bucket, size, samples, most_requests, most_read):
    url = f"s3://{bucket}/{size}"
    ok("seed", url, "--samples", str(samples), "--size", size, "--shard-size", "5MiB" if size == "1MiB" else "3MiB",
       "--fields", "bin")

    async def go(store):
        shard_bytes = sum(o.size for o in await store.list())
        before = store.requests
        await index_shards(store, progress=False)
        return store.requests - before, store.bytes_read, shard_bytes

    requests, bytes_read, shard_bytes = run(with_store(url, go))
    assert requests <= most_requests and bytes_read <= most_read * shard_bytes


def test_synthetic_samples_are_deterministic_and_sized():
    assert sample_bytes(1, 5, 4000) == sample_bytes(1, 5, 4000) != sample_bytes(1, 6, 4000)
    assert sample_bytes(1, 5, 4000) != sample_bytes(2, 5, 4000)
    assert [len(sample_bytes(0, 3, n)) for n in (0, 5, 16, 17, 3 << 20)] == [0, 5, 16, 17, 3 << 20]
    sizes = [sample_size(0, i, parse_sizes("1KiB-100KiB")) for i in range(500)]
    assert min(sizes) >= 1024 and max(sizes) <= 102400 and len(set(sizes)) > 400
    assert parse_sizes("10KiB") == (10240, 10240)
    with pytest.raises(ValueError, match="low end is above"):
        parse_sizes("2KiB-1KiB")


@pytest.mark.slow
def test_digits_seed_writes_the_sklearn_images(tmp_path):
    from sklearn.datasets import load_digits

    assert cli.main(["--quiet", "seed", "--digits", str(tmp_path / "digits")]) == 0
    index, members = members_through_index(str(tmp_path / "digits"))
    digits = load_digits()
    assert len(index) == 1797 and index.fields == ["cls", "npy"] and len(index.shards) > 1
    image = np.load(io.BytesIO(members["000042", "npy"]))
    assert image.dtype == np.float32 and np.array_equal(image, digits.images[42])
    assert members["000042", "cls"] == str(digits.target[42]).encode()


def write_tar(members) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


BAD_SHARDS = [
    ({"a.tar": write_tar([("1.jpg", b"x")]), "b.tar": b"<html>not a tar</html>" * 40},
     "b.tar: not a tar file"),
    ({"a.tar": write_tar([("1.jpg", b"x" * 5000), ("1.cls", b"1")])[:3000]},
     "a.tar: truncated shard: member '1.jpg'"),
    ({"a.tar": write_tar([("1.jpg", b"x"), ("1.cls", b"1"), ("1.CLS", b"2")])},
     "a.tar: sample '1' has field 'cls' twice"),
    ({"notes.txt": b"no shards here"}, "no .tar shards found"),
    ({"a.tar": bytes(10240)}, "the shards hold no samples"),
]


def test_bad_shards_give_one_line_errors_and_no_index(root):
    urls = [root(f"bad{i}") for i in range(len(BAD_SHARDS))]
    for url, (shards, _) in zip(urls, BAD_SHARDS):
        async def upload(store, shards=shards):
            for path, data in shards.items():
                await store.write(path, data)
        run(with_store(url, upload))
    for url, (_, message), refused in zip(urls, BAD_SHARDS, refusals([["index", url] for url in urls])):
        assert message in one_line_error(refused), url
        assert INDEX_FILE not in list_paths(url)


@settings(max_examples=60, deadline=None)
@given(cut=st.integers(0, 9000), flip=st.integers(0, 9000), value=st.integers(0, 255))
def test_damaged_shards_raise_only_index_format_errors(tmp_path_factory, cut, flip, value):
    shard = bytearray(write_tar([("a/" * 60 + "1.jpg", b"x" * 3000), ("1.cls", b"1"), ("2.jpg", b"y" * 700)]))
    shard[flip % len(shard)] = value
    root = tmp_path_factory.mktemp("damaged")
    (root / "s.tar").write_bytes(bytes(shard[:cut]) if cut < len(shard) else bytes(shard))
    try:
        index = run(with_store(str(root), lambda store: index_shards(store, window=1024, progress=False)))
    except IndexFormatError as err:
        assert str(err).startswith(("s.tar: ", f"{root}: "))
    else:
        assert 1 <= len(index) <= 3


def test_bad_pack_sources_give_one_line_errors_and_write_nothing(tmp_path):
    # The source is checked before the destination is touched, so one kind of destination suffices.
    root = lambda name: str(tmp_path / name)  # noqa: E731
    empty, dup, noext = tmp_path / "empty", tmp_path / "dup", tmp_path / "noext"
    for d in (empty, dup / "sub", noext):
        d.mkdir(parents=True)
    (dup / "sub" / "0001.jpg").write_bytes(b"a")
    (dup / "sub" / "0001.JPG").write_bytes(b"b")
    (noext / "0001").write_bytes(b"a")
    errors = [one_line_error(refused) for refused in refusals([
        ["pack", str(empty), root("p1")], ["pack", str(tmp_path / "nope"), root("p2")],
        ["pack", str(dup), root("p3")], ["pack", str(noext), root("p4")]])]
    assert f"source directory '{empty}' has no files to pack" in errors[0]
    assert f"source directory '{tmp_path / 'nope'}' does not exist" in errors[1]
    assert "0001.jpg: duplicate field 'jpg' (also 0001.JPG) in sample '0001'" in errors[2]
    assert "0001: no extension" in errors[3]
    for name in ("p1", "p2", "p3", "p4"):
        assert list_paths(root(name)) == []


def test_seed_refuses_to_overwrite_a_dataset(tmp_path):
    url = str(tmp_path / "d")
    ok("seed", url, "--samples", "3", "--size", "1KiB")
    assert "already holds a dataset (index.parquet)" in fails("seed", url, "--samples", "3", "--size", "1KiB")


@pytest.mark.slow
def test_index_of_a_peers_dataset_says_it_is_served_as_it_is(tmp_path):
    from common.peerdatasets import mds_dataset

    root = mds_dataset(tmp_path / "mds", samples=6).root
    error = fails("index", str(root))
    assert "holds a MosaicML Streaming or LitData dataset (index.json)" in error and "in place" in error
    assert not (root / INDEX_FILE).exists()


def test_store_problems_give_one_line_errors(s3_env, bucket):
    assert "bucket 'no-such-bucket' does not exist" in fails("seed", "s3://no-such-bucket/x", "--samples", "2")
    assert "access denied" in fails("index", f"s3://{bucket}/x", env={"AWS_SECRET_ACCESS_KEY": "wrong"})
    unreachable = fails("seed", f"s3://{bucket}/x", "--samples", "2",
                        env={"AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"})
    assert "cannot connect to S3 endpoint" in unreachable
    assert "unsupported URL scheme" in fails("index", "gs://bucket/x")


def test_bad_arguments_give_one_line_errors(tmp_path):
    seed = ["seed", str(tmp_path / "d")]
    errors = [one_line_error(refused) for refused in refusals([
        [*seed, "--samples", "2", "--size", "10XB"], [*seed, "--samples", "2", "--fields", "bin,png"], seed])]
    assert "invalid size '10XB'" in errors[0]
    assert "unknown synthetic field 'png'" in errors[1]
    assert "--samples is required" in errors[2]
    assert not (tmp_path / "d").exists()


def test_server_commands_without_server_packages_fail_in_one_line():
    code = ("import sys; sys.modules['pyarrow'] = None\n"
            "from shardfeed.cli import main; sys.exit(main(['index', 'x']))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == ("shardfeed: error: command 'index' needs a missing Python package "
                                     "'pyarrow': pip install 'shardfeed[server]'")


def test_commands_whose_module_is_absent_are_reported_not_available(monkeypatch, capsys):
    monkeypatch.setitem(cli.COMMANDS, "later", ("shardfeed.service.not_written_yet", "coming soon"))
    assert cli.main(["later"]) == 2
    assert capsys.readouterr().err.strip() == ("shardfeed: error: command 'later' is not available in this "
                                               "installation (no module shardfeed.service.not_written_yet)")
