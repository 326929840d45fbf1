"""The index's per-sample columns through the client over loopback: what choosing a subset of a
large dataset costs before its predicate runs (issue 41).

    python -m shardfeed.benchmarks.index_columns [--samples 1e7] [--columns shard,bytes,bytes.bin,key]
                                                 [--rounds 3]

A synthetic index of ``--samples`` samples (``scale.synthetic_index``: two fields, 10-byte keys,
10,000 samples a shard, no shards written) is served by ``shardfeed serve`` from a local
``index.parquet``; ``Client.index_column`` fetches each column ``--rounds`` times. Per column:
its bytes on the wire, the median seconds of a fetch, and that per 10^7 samples. Every value
fetched is checked against the synthetic index's own definition. Then a mixture stream's subset is
built from a predicate over the fetched ``shard`` column (``mixing.pool_of``: every other shard),
the build timed apart from the fetch, and checked.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from shardfeed.benchmarks.common import benchmark_parser, table
from shardfeed.benchmarks.scale import KEY_DIGITS, MEMBER_BYTES, SHARD_SAMPLES, synthetic_index
from shardfeed.client import Client
from shardfeed.client.mixing import IndexColumns, pool_of
from shardfeed.process import start_service
from shardfeed.service.datasets.index import parquet_bytes
from shardfeed.service.datasets.indexfile import INDEX_FILE


def expected(column: str, samples: int) -> np.ndarray:
    """The column as ``synthetic_index`` defines it."""
    if column == "key":
        return np.char.zfill(np.arange(samples).astype(f"S{KEY_DIGITS}"), KEY_DIGITS)
    if column == "shard":
        return (np.arange(samples) // SHARD_SAMPLES).astype(np.int32)
    sizes = {"bytes": sum(MEMBER_BYTES), "bytes.bin": MEMBER_BYTES[0], "bytes.cls": MEMBER_BYTES[1]}
    return np.full(samples, sizes[column], np.int64)


def main() -> None:
    parser = benchmark_parser(__doc__, "shardfeed.benchmarks.index_columns")
    parser.add_argument("--samples", default="1e7")
    parser.add_argument("--columns", default="shard,bytes,bytes.bin,key")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    samples = int(float(args.samples))
    with tempfile.TemporaryDirectory(prefix="shardfeed-columns-") as work:
        root = Path(work) / "d"
        root.mkdir()
        began = time.perf_counter()
        (root / INDEX_FILE).write_bytes(parquet_bytes(synthetic_index(samples).to_table()))
        print(f"{samples:,} samples: index written in {time.perf_counter() - began:.1f} s", flush=True)
        with start_service({"d": root.as_uri()}, cache_dir=Path(work) / "cache", timeout=600) as svc, \
                Client(svc.url, timeout=300) as client:
            rows = []
            for column in args.columns.split(","):
                seconds = []
                for _ in range(args.rounds):
                    began = time.perf_counter()
                    values = client.index_column("d", column)
                    seconds.append(time.perf_counter() - began)
                    if not np.array_equal(values, expected(column, samples)):
                        raise AssertionError(f"column {column!r} is not the synthetic index's")
                    del values
                median = statistics.median(seconds)
                rows.append((column, f"{samples * expected(column, 1).itemsize / 1e6:.0f}", f"{median:.3f}",
                             f"{median * 1e7 / samples:.3f}"))
            shards = client.index_column("d", "shard")
            columns = IndexColumns({"shard": shards}.__getitem__, ["shard"])
            seconds = []
            for _ in range(args.rounds):
                began = time.perf_counter()
                pool = pool_of(lambda index: index["shard"] % 2 == 0, samples, lambda: columns, "even shards")
                seconds.append(time.perf_counter() - began)
            if not np.array_equal(pool, np.flatnonzero(np.arange(samples) // SHARD_SAMPLES % 2 == 0)):
                raise AssertionError("the predicate's subset is not every other shard's samples")
            median = statistics.median(seconds)
            rows.append(("subset by a predicate (build)", "", f"{median:.3f}", f"{median * 1e7 / samples:.3f}"))
    print(table(("column", "MB", "median s", "s per 1e7 samples"), rows))


if __name__ == "__main__":
    main()
