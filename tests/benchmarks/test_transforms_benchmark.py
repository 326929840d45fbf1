"""``python -m shardfeed.benchmarks.transforms``: its smoke run (SeaweedFS, a service per shardfeed
loader, Streaming where installed), and the checks that make it exit 1, on epochs made by hand."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from shardfeed.benchmarks.common import WrongBytes
from shardfeed.benchmarks.transforms import output_digest, run_epoch


def outputs(i: int, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """Stand-ins for sample ``i``'s outputs in ``epoch``: an image and a label of the real dtypes and shapes."""
    rng = np.random.default_rng([i, epoch])
    return rng.integers(0, 256, (3, 224, 224), dtype=np.uint8), np.array(i % 7, np.int64)


def streaming_batch(indices: list[int], epoch: int) -> dict:
    """A batch as Streaming's default collate makes it: the index column, images and labels stacked."""
    images, labels = zip(*(outputs(i, epoch) for i in indices))
    return {"index": torch.tensor(indices), "image": torch.from_numpy(np.stack(images)),
            "label": torch.from_numpy(np.stack(labels))}


def test_every_output_is_checked_against_its_epochs_digest_and_every_sample_read_once():
    expected = np.array([[output_digest(*outputs(i, e)) for e in range(2)] for i in range(5)], np.uint64)
    epoch = run_epoch("streaming", [streaming_batch([3, 0, 4], 1), streaming_batch([1, 2], 1)], expected, 1)
    assert epoch.rate > 0 and set(epoch.cpu) == {"main", "workers", "service"}
    with pytest.raises(WrongBytes, match=r"streaming, cold epoch: sample 3: other outputs than apply\("):
        run_epoch("streaming", [streaming_batch([3, 0, 4, 1, 2], 1)], expected, 0)  # epoch 1's augmentation
    with pytest.raises(WrongBytes, match="warm epoch: 1 samples not read, 1 read more than once"):
        run_epoch("streaming", [streaming_batch([3, 0, 4, 1, 1], 1)], expected, 1)
    with pytest.raises(WrongBytes, match="sample 5, outside the 5 seeded"):
        run_epoch("streaming", [streaming_batch([5], 1)], expected, 1)


@pytest.mark.slow  # SeaweedFS, a service per shardfeed loader, Streaming
@pytest.mark.timeout(150)
def test_the_transforms_benchmark_runs_every_loader_tiny_every_output_checked():
    out = subprocess.run([sys.executable, "-m", "shardfeed.benchmarks.transforms", "--samples", "64", "--rounds", "1",
                          "--service-workers", "1", "--transform-processes", "1"],
                         capture_output=True, text=True, timeout=140)
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"^round 1 service +cold +\d+ samples/s, .*prepared hits 0% +warm .*prepared hits 100%$",
                     out.stdout, re.M), out.stdout
    for kind in ("service", "standard"):
        assert re.search(rf"^{kind} +[\d,]+ +[\d,]+ +[\d.]+ / [\d.]+ +[\d,]+ / [\d,]+ +[\d,]+ / [\d,]+$", out.stdout,
                         re.M), out.stdout
    assert re.search(r"^service / standard +[\d.]+x / [\d.]+x .* +[\d.]+x / [\d.]+x$", out.stdout, re.M), out.stdout
    assert "prepared cache hit ratio over the warm epoch (GET /v1/stats): 100.0% (each round)" in out.stdout
    for target in (r"service warm >= 2\.5x the standard recipe", r"service cold >= 1x the standard recipe",
                   r"training CPU per sample, service <= 0\.2x the standard recipe's"):
        assert re.search(rf"^target: {target}: (met|missed) \(", out.stdout, re.M), out.stdout
    assert re.search(r"^streaming +[\d,]+ +[\d,]+ ", out.stdout, re.M) or \
        "MosaicML Streaming is not installed" in out.stdout or re.search(r"streaming +failed", out.stdout), out.stdout
