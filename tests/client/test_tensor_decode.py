"""Decoding tensor batches (client/tensordecode.py) and examples/train_tensors.py, on JPEGs
written by Pillow, served by a real service."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from shardfeed.client import Client
from shardfeed.client.tensordecode import decode_images, decode_labels
from shardfeed.client.tensors import ABSENT, Field
from shardfeed.process import start_service

from common.datasets import tar_dataset

SAMPLES = 40
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_tensors.py"


def jpeg(i: int) -> bytes:
    rng = np.random.default_rng(i)
    pixels = rng.integers(0, 255, (8 + i % 5, 12 + i % 3, 3), dtype=np.uint8)  # sizes differ
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG")
    return out.getvalue()


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("jpegs")
    shards = [{f"img{i:04d}.{field}": data for i in range(s, s + SAMPLES // 2)
               for field, data in (("jpg", jpeg(i)), ("cls", b"%d" % (i % 10)))} for s in (0, SAMPLES // 2)]
    url = tar_dataset(root / "data", shards)
    with start_service({"jpegs": url}, cache_dir=root / "cache") as svc:
        yield svc


def test_images_and_labels_decode_from_the_batch_views(images):
    with Client(images.url) as client:
        indices = [3, 17, 0, 39, 22]
        batch = client.get_batch_tensors("jpegs", indices)
        decoded = decode_images(batch["jpg"], "cpu")
        for i, image in zip(indices, decoded):
            want = np.array(Image.open(io.BytesIO(jpeg(i))).convert("RGB"))
            assert torch.equal(image, torch.from_numpy(want).permute(2, 0, 1))
        assert decode_labels(batch["cls"]).tolist() == [i % 10 for i in indices]
        lacking = Field(batch.buffer, "cls", np.zeros(1, np.int64), np.full(1, ABSENT, np.int64))
        with pytest.raises(ValueError, match="sample 0 of the batch has no 'cls' field"):
            decode_labels(lacking)


def test_the_example_trains_an_epoch_on_tensor_batches(images):
    done = subprocess.run([sys.executable, str(EXAMPLE), images.url, "--dataset", "jpegs", "--workers", "2",
                           "--batch-size", "8", "--classes", "10", "--side", "8"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "epoch 1: loss" in done.stdout and f"{SAMPLES} samples" in done.stdout
