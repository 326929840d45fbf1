"""``shardfeed seed``: write a synthetic dataset (``seeds/synthetic.py``), synthetic JPEGs
(``seeds/jpegs.py``) or scikit-learn's digits (``seeds/digits.py``) to a store, through the one
shard writer."""

from __future__ import annotations

import argparse
import asyncio
import time

from shardfeed.seeds.digits import DEFAULT_SHARD_SIZE as DIGITS_SHARD_SIZE
from shardfeed.seeds.digits import seed_digits
from shardfeed.seeds.synthetic import DEFAULT_FIELDS, FIELDS, seed_dataset
from shardfeed.service.datasets.index import Index
from shardfeed.service.datasets.shards import DEFAULT_SHARD_SIZE
from shardfeed.service.stores import open_store
from shardfeed.sizes import parse_size


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dest", metavar="DEST_URL", help="new dataset root: s3://bucket/prefix, file:///dir or a path")
    parser.add_argument("--samples", type=int, help="number of samples (required unless --digits)")
    parser.add_argument("--size", default=None,
                        help="payload size, fixed (10KiB) or a range (1KiB-100KiB) (default 10KiB)")
    parser.add_argument("--shard-size", default=None,
                        help="target shard size (default 64MiB; 512KiB with --digits)")
    parser.add_argument("--fields", default=None,
                        help=f"comma-separated fields, from {', '.join(FIELDS)} (default bin,cls)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--digits", action="store_true",
                        help="write scikit-learn's 1797 8x8 digits (.npy + .cls) instead of synthetic data")
    parser.add_argument("--jpegs", action="store_true",
                        help="write --samples synthetic photo-like JPEGs of ImageNet's sizes (.jpg + .cls, "
                             "about 100 KiB each) instead of synthetic data")


def run(args: argparse.Namespace) -> int:
    if args.digits and args.jpegs:
        raise ValueError("choose one of --digits and --jpegs")
    if args.digits and args.samples is not None:
        raise ValueError("--digits writes a fixed dataset; drop --samples")
    if not args.digits and args.samples is None:
        raise ValueError("--samples is required (or use --digits)")
    if (args.digits or args.jpegs) and (args.size is not None or args.fields is not None):
        raise ValueError(f"--{'digits' if args.digits else 'jpegs'} sets its own fields and sizes; "
                         "drop --size and --fields")
    default = DIGITS_SHARD_SIZE if args.digits else DEFAULT_SHARD_SIZE
    shard_size = default if args.shard_size is None else parse_size(args.shard_size)

    async def main() -> Index:
        async with open_store(args.dest) as store:
            if args.digits:
                return await seed_digits(store, shard_size=shard_size,
                                         progress=args.progress)
            if args.jpegs:
                from shardfeed.seeds.jpegs import seed_jpegs  # Pillow (the image extra): imported only when used

                return await seed_jpegs(store, samples=args.samples, shard_size=shard_size, seed=args.seed,
                                        progress=args.progress)
            return await seed_dataset(store, samples=args.samples, size=args.size or "10KiB",
                                      shard_size=shard_size, fields=args.fields or DEFAULT_FIELDS,
                                      seed=args.seed, progress=args.progress)

    started = time.monotonic()
    index = asyncio.run(main())
    print(f"seeded {index.summary()} to {args.dest} in {time.monotonic() - started:.1f}s")
    return 0
