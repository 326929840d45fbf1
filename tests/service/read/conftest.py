"""What the read path's in-process tests share: a small file:// dataset of ~1 KiB samples in
four shards of 50 (read in 64 KiB blocks, about 30 samples make one)."""

from __future__ import annotations

import pytest

from common.datasets import dir_put, make_dataset

SAMPLES, PER_SHARD = 200, 50


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """``(root, {(sample, field): bytes})`` of the dataset, written once per module."""
    root = tmp_path_factory.mktemp("read-dataset")
    return root, make_dataset(dir_put(root), samples=SAMPLES, per_shard=PER_SHARD, sizes=(900, 1100))
