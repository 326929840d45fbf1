"""What the benchmarks share: the seeded dataset (written by the CLI's own ``shardfeed seed``),
the load note each run prints, a fixed-width table, and each sample's digest.

A benchmark that reports samples/s or bytes checks every sample it counts, in every epoch
it reports: ``Digests`` holds an xxh3 of each seeded member, computed before the clock
starts, so the check on the clock is one hash of bytes the reader already holds. Positions
are checked against the request (the ``n``-th answer is the ``n``-th index asked), with the
key the dataset holds for that index, never with ``__index__``, which the client copies from
the request.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from xxhash import xxh3_64_intdigest

from shardfeed.s3server import S3_SERVERS, S3Server, default_server, start_s3
from shardfeed.seeds.synthetic import member_bytes, sample_key
from shardfeed.tar import iter_members

BENCH_DATA = "s3://bench/data"
"""Where ``seeded_s3`` puts the benchmarks' dataset."""


class WrongBytes(AssertionError):
    """A sample came back other than it was seeded: the run's figures count nothing."""


def seed_by_cli(url: str, samples: int, size: str | None = None, *, shard_size: str | None = None,
                fields: Sequence[str] | str = (), seed: int | None = None, jpegs: bool = False,
                env: Mapping[str, str] | None = None) -> None:
    """``shardfeed seed`` the synthetic dataset at ``url`` (in a subprocess: the CLI's own path);
    with ``jpegs``, the synthetic JPEGs (``seed --jpegs``: no ``size`` or ``fields``)."""
    fields = fields if isinstance(fields, str) else ",".join(fields)
    options = [*(["--size", size] if size else []), *(["--jpegs"] if jpegs else []),
               *(["--shard-size", shard_size] if shard_size else []), *(["--fields", fields] if fields else []),
               *(["--seed", str(seed)] if seed is not None else [])]
    subprocess.run([sys.executable, "-m", "shardfeed", "-q", "seed", url, "--samples", str(samples), *options],
                   check=True, env={**os.environ, **(env or {})})


def benchmark_parser(doc: str, module: str) -> argparse.ArgumentParser:
    """A benchmark's parser: ``python -m <module>`` in its usage, its docstring as the help, as written."""
    return argparse.ArgumentParser(prog=f"python -m {module}", description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def dataset_arguments(parser: argparse.ArgumentParser, *, samples: int, batch: int | None = None) -> None:
    """``--samples`` and ``--size`` of the synthetic dataset a benchmark seeds, and with
    ``batch`` its ``--batch`` (samples per request)."""
    parser.add_argument("--samples", type=int, default=samples)
    parser.add_argument("--size", default="10KiB")
    if batch is not None:
        parser.add_argument("--batch", type=int, default=batch)


def seeded_s3_arguments(parser: argparse.ArgumentParser, *, samples: int, shard_size: str,
                        s3_help: str = "the S3 server to start on loopback (default here: %(default)s)") -> None:
    """The options of a benchmark that runs on ``seeded_s3``: ``--samples``, ``--size``,
    ``--shard-size`` of its synthetic dataset and ``--s3``, the server it starts."""
    dataset_arguments(parser, samples=samples)
    parser.add_argument("--shard-size", default=shard_size)
    parser.add_argument("--s3", choices=S3_SERVERS, default=default_server(), help=s3_help)


@contextmanager
def seeded_s3(kind: str, samples: int, size: str, shard_size: str, fields: str | None = None) -> Iterator[S3Server]:
    """An S3 server ``kind`` holding ``samples`` synthetic samples at ``BENCH_DATA``, in a
    bucket ``bench`` that the caller may use too; stopped on exit."""
    server = start_s3(kind)
    try:
        server.create_bucket("bench")
        seed_by_cli(BENCH_DATA, samples, size, shard_size=shard_size, fields=fields or (), env=server.env())
        yield server
    finally:
        server.stop()


def upload(server: S3Server, directory: Path, url: str, threads: int = 16) -> None:
    """Every file in ``directory`` to ``url`` (``s3://bucket/prefix``) on ``server``, ``threads``
    at a time (a dataset of many small shards is mostly round trips)."""
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    s3 = server.client()

    def put(path: Path) -> None:
        s3.put_object(Bucket=bucket, Key=f"{prefix}/{path.name}", Body=path.read_bytes())

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(put, sorted(directory.iterdir())))


def load_note() -> str:
    """The machine's state beside a figure: rates on a shared machine move with it."""
    return f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores"


def table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A fixed-width table: the first column left-aligned, the others right-aligned, each as
    wide as its widest cell."""
    cells = [list(header)] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[n]) for row in cells) for n in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) if n == 0 else c.rjust(w) for n, (c, w) in enumerate(zip(row, widths)))
                     for row in cells)


def binary_values(column) -> Iterator[memoryview | None]:
    """The values of an Arrow binary column (a ``ChunkedArray``), as views of its buffers."""
    import pyarrow as pa

    for chunk in column.chunks:
        _, offsets, data = chunk.buffers()
        width = 8 if pa.types.is_large_binary(chunk.type) else 4
        at = memoryview(offsets).cast("q" if width == 8 else "i")[chunk.offset:chunk.offset + len(chunk) + 1]
        view = memoryview(data if data is not None else b"")
        for n, valid in enumerate(chunk.is_valid().to_pylist()):
            yield view[at[n]:at[n + 1]] if valid else None


class Digests:
    """An xxh3 of each member of the synthetic dataset ``seed``, made before the clock starts."""

    def __init__(self, samples: int, sizes: tuple[int, int], fields: Sequence[str] = ("bin",), seed: int = 0):
        self.samples, self.fields = samples, tuple(fields)
        self._digests = {f: [xxh3_64_intdigest(member_bytes(seed, i, f, sizes)) for i in range(samples)]
                         for f in self.fields}

    def check(self, i: int, field: str, data) -> None:
        """``data`` (bytes, a contiguous buffer or a CPU tensor's view) must be member ``field`` of sample ``i``."""
        if data is None:
            raise WrongBytes(f"sample {i} {field}: missing")
        if hasattr(data, "numpy"):
            data = data.numpy()  # a tensor's bytes, uncopied
        if xxh3_64_intdigest(data) != self._digests[field][i]:
            raise WrongBytes(f"sample {i} {field}: other bytes than were seeded")

    def verifier(self, field: str = "bin") -> Callable[[int, object], None]:
        """``verify(i, data)``: ``check`` of one field, for code that checks one member at a time."""
        return lambda i, data: self.check(i, field, data)

    def check_sample(self, i: int, sample: Mapping, fields: Sequence[str] | None = None) -> None:
        """A client's sample dict, asked for as index ``i``: its key and each field's bytes."""
        if sample.get("__key__") != sample_key(i):
            raise WrongBytes(f"index {i}: key {sample.get('__key__')!r}, the dataset holds {sample_key(i)!r}")
        for field in fields or self.fields:
            self.check(i, field, sample[field])

    def check_indexed(self, sample: Mapping, fields: Sequence[str] | None = None) -> int:
        """A sample from a loader whose order the caller does not see (a shuffled DataLoader),
        checked as the index the loader asked for (the client copies it into ``__index__``);
        the caller checks that an epoch holds each index once. The index."""
        i = int(sample["__index__"])
        self.check_sample(i, sample, fields)
        return i

    def check_batch(self, asked: Sequence[int], samples: Sequence[Mapping], fields: Sequence[str] | None = None) -> int:
        """A batch's samples against the indices asked, position by position; how many."""
        if len(samples) != len(asked):
            raise WrongBytes(f"asked for {len(asked)} samples, got {len(samples)}")
        for i, sample in zip(asked, samples):
            self.check_sample(int(i), sample, fields)
        return len(samples)

    def check_arrow(self, asked: Sequence[int], body: bytes) -> int:
        """A ``POST /v1/batch`` answer in ``"format": "arrow"`` as it came: row ``n`` is sample
        ``asked[n]``, with its key and each field's seeded bytes (read in place); how many samples."""
        import pyarrow as pa

        table = pa.ipc.open_stream(pa.py_buffer(body)).read_all()
        if table.column("__index__").to_pylist() != [int(i) for i in asked]:
            raise WrongBytes(f"asked for {len(asked)} samples, got {table.num_rows} rows, not in the order asked")
        for i, key in zip(asked, table.column("__key__").to_pylist()):
            if key != sample_key(int(i)):
                raise WrongBytes(f"index {i}: key {key!r}, the dataset holds {sample_key(int(i))!r}")
        for field in self.fields:
            for i, data in zip(asked, binary_values(table.column(field))):
                self.check(int(i), field, data)
        return len(asked)

    def check_tar(self, asked: Sequence[int], body: bytes) -> int:
        """A ``POST /v1/batch`` answer as it came (a tar): members ``n * F`` to ``n * F + F - 1``
        (``F`` fields) are sample ``asked[n]``'s, one per field, each with its seeded bytes;
        how many samples."""
        members, width = list(iter_members(body)), len(self.fields)
        if len(members) != width * len(asked):
            raise WrongBytes(f"asked for {len(asked)} samples of {width} fields, got {len(members)} members")
        for n, i in enumerate(asked):
            group = members[n * width:(n + 1) * width]
            names = {name for name, _ in group}
            if names != {f"{sample_key(i)}.{field}" for field in self.fields}:
                raise WrongBytes(f"index {i}: members {sorted(names)}, the dataset holds key {sample_key(i)!r}")
            for name, data in group:
                self.check(int(i), name.rpartition(".")[2], data)
        return len(asked)
