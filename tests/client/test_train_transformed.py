"""examples/train_transformed.py: a model trained on the stock ImageNet transform's tensors, run by a
real service (its pool and prepared cache) and, with --on-client, in the DataLoader workers, on
synthetic JPEGs (seeds/jpegs.py) at sizes below ImageNet's, to keep it quick."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from shardfeed.process import start_service
from shardfeed.seeds.jpegs import sample_jpeg, sample_label

from common.datasets import tar_dataset

SAMPLES = 24
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_transformed.py"


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    root = tmp_path_factory.mktemp("transformed")
    shards = [{f"img{i:04d}.{field}": data for i in range(s, s + SAMPLES // 2)
               for field, data in (("jpg", sample_jpeg(0, i, (300, 240))), ("cls", b"%d" % sample_label(0, i)))}
              for s in (0, SAMPLES // 2)]
    url = tar_dataset(root / "data", shards)
    with start_service({"jpegs": url}, cache_dir=root / "cache",
                       args=["--transform", "imagenet_train=shardfeed.transforms.image:imagenet_train",
                                   "--transform-processes", "1"]) as svc:
        yield svc


@pytest.mark.parametrize("where", [[], ["--on-client"]], ids=["service", "client"])
def test_the_example_trains_on_the_transforms_tensors(service, where):
    done = subprocess.run([sys.executable, str(EXAMPLE), service.url, "--dataset", "jpegs", "--workers", "2",
                           "--batch-size", "8", "--epochs", "2", *where],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "epoch 2: loss" in done.stdout and f"{SAMPLES} samples" in done.stdout
