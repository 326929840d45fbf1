"""``python -m shardfeed.benchmarks.mixture``: its smoke run (SeaweedFS, services, Streaming where
installed), and the checks that make it exit 1, on epochs made by hand."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from shardfeed.benchmarks.common import Digests, WrongBytes
from shardfeed.benchmarks.mixture import Epoch, Seeded, WrongCount, check_counts, documented_counts, run_epoch, \
    stream_samples
from shardfeed.seeds.synthetic import member_bytes, sample_key

SIZES = (64, 64)


def test_the_streams_are_sized_so_that_an_epoch_is_whole_batches_of_64():
    assert stream_samples(6144, 3, 10) == [5120, 512, 512]
    assert stream_samples(6000, 3, 10) == [4960, 496, 496]  # 5952 = 93 batches
    assert stream_samples(6000, 2, 3) == [4464, 1488]  # 4 parts: 64 | 4 * 1488
    assert stream_samples(100, 3, 10) == [0, 0, 0]  # too few for one sample each: refused by main


def test_the_documented_counts_split_the_epoch_by_largest_remainder_ties_to_the_earlier_stream():
    assert documented_counts([0.5, 0.3, 0.2], 6144) == [3072, 1843, 1229]
    assert documented_counts([1, 1, 1], 64) == [22, 21, 21]
    assert documented_counts([2, 1], 7) == [5, 2]


def streams(*sizes: int) -> list[Seeded]:
    return [Seeded(name, seed, n, f"s3://bench/{name}") for seed, (name, n) in enumerate(zip("abc", sizes))]


def test_an_epoch_must_hold_each_streams_count_in_whole_passes():
    a, b = streams(4, 2)
    check_counts("shardfeed", [Epoch(1.0, 0.0, [[3, 0, 1], [0, 1, 1, 0, 1]])], [a, b], [3, 5])
    with pytest.raises(WrongCount, match="stream 'b' gave 4 samples, the mixture's count is 5"):
        check_counts("shardfeed", [Epoch(1.0, 0.0, [[3, 0, 1], [0, 1, 1, 0]])], [a, b], [3, 5])
    with pytest.raises(WrongCount, match="stream 'a' gave some samples 2 times, others 0: not whole passes over its 4"):
        check_counts("shardfeed", [Epoch(1.0, 0.0, [[3, 3, 1], [0, 1, 1, 0, 1]])], [a, b], [3, 5])


def sample(seed: int, i: int, stream: str) -> dict:
    return {"__key__": sample_key(i), "__index__": i, "__stream__": stream,
            **{f: member_bytes(seed, i, f, SIZES) for f in ("bin", "cls")}}


def test_every_sample_is_checked_against_its_own_streams_bytes():
    digests = [Digests(8, SIZES, ("bin", "cls"), seed) for seed in (0, 1)]
    epoch = run_epoch([[sample(0, 3, "a"), sample(1, 3, "b")], [sample(1, 7, "b")]], digests, ["a", "b"], keyed=True)
    assert epoch.seen == [[3], [3, 7]] and epoch.rate > 0
    with pytest.raises(WrongBytes, match="sample 3 bin: other bytes than were seeded"):  # b's index 3, said to be a's
        run_epoch([[sample(1, 3, "a")]], digests, ["a", "b"], keyed=True)
    with pytest.raises(WrongBytes, match="stream 'b': index 8, outside its 8 samples"):
        run_epoch([[sample(1, 8, "b")]], digests, ["a", "b"], keyed=True)


@pytest.mark.slow  # SeaweedFS, a service per loader and round, Streaming
@pytest.mark.timeout(200)
def test_the_mixture_benchmark_runs_both_parts_tiny_every_count_exact():
    out = subprocess.run([sys.executable, "-m", "shardfeed.benchmarks.mixture", "--samples", "768",
                          "--cache-samples", "768", "--size", "1KiB", "--rounds", "1", "--service-workers", "1"],
                         capture_output=True, text=True, timeout=190)
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"^documented \(client/mixing\.py\) +each +384 +230 +154 +768$", out.stdout, re.M), out.stdout
    for kind in ("shardfeed-samples", "shardfeed-tensors"):
        for when in ("cold", "warm"):
            assert re.search(rf"^{kind} +{when} +384 +230 +154 +768$", out.stdout, re.M), out.stdout
        assert re.search(rf"^target: {kind} >= 1\.5x Streaming cold and warm: (met|missed)$", out.stdout, re.M) or \
            "MosaicML Streaming is not installed" in out.stdout or re.search(r"streaming +failed", out.stdout)
    for when in ("cold", "warm"):
        row = re.search(rf"^mixture +{when} +(\d+\.\d\d) +(\d+\.\d\d) +([\d,]+) +(\d+\.\d\d)x$", out.stdout, re.M)
        assert row and float(row[1]) <= float(row[2]) and float(row[4]) > 0, out.stdout
    assert float(re.search(r"^mixture +cold +\d+\.\d\d +(\d+\.\d\d)", out.stdout, re.M)[1]) >= 0.9  # all it read
    assert re.search(r"^target: the mixture's S3 bytes <= 1\.2x its bytes every epoch: (met|missed) against its "
                     r"shards, (met|missed) against its samples read$", out.stdout, re.M), out.stdout
    refused = subprocess.run([sys.executable, "-m", "shardfeed.benchmarks.mixture", "--samples", "100"],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--samples 100: too few for 3 streams" in refused.stderr
