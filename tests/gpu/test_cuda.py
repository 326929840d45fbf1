"""Tensor batches on a CUDA device, from a real service: a pinned batch reaches the GPU in one
host-to-device copy, JPEGs decode in one batched nvJPEG call, and a DataLoader with
``pin_memory=True`` hands out pinned batches. Skipped without CUDA (this module only: nothing
else in the suite needs a GPU); ``make gpu-check`` runs it with the stall benchmark's copy
timing."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image
from torch.profiler import ProfilerActivity, profile
from torch.utils.data import DataLoader

from shardfeed.client import Client
from shardfeed.client.tensordecode import decode_images
from shardfeed.client.tensors import Batch
from shardfeed.client.torch import ShardfeedDataset
from shardfeed.process import start_service

from common.datasets import odd_tar_dataset, tar_dataset

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here (make gpu-check needs one)")

SAMPLES = 60
IMAGES = 24
SIDES = [(8, 8), (37, 53), (64, 48), (120, 200), (17, 300)]  # MCU-aligned and not
NO_IMAGE = 5
"""The one sample of the image dataset without a ``jpg`` (its label only)."""


def picture(i: int) -> bytes:
    """Image ``i`` as a JPEG: smooth (nvJPEG and libjpeg-turbo differ most at sharp edges),
    of differing sizes, every third grayscale, every fourth colour one without chroma
    subsampling (4:4:4; the rest 4:2:0, Pillow's default)."""
    height, width = SIDES[i % len(SIDES)]
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    rgb = np.stack([np.sin(x / 13 + i), np.cos(y / 17 - i), np.sin((x + y) / 23)], axis=-1)
    image = Image.fromarray((128 + 90 * rgb).astype(np.uint8))
    out = io.BytesIO()
    if i % 3 == 0:
        image.convert("L").save(out, format="JPEG", quality=90)
    else:
        image.save(out, format="JPEG", quality=90, subsampling=0 if i % 4 == 0 else 2)
    return out.getvalue()


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    """A client of one service over two datasets: ``odd`` (long names, empty members, a field
    some samples lack) and ``jpegs`` (``picture(i)`` and a label, but sample ``NO_IMAGE``)."""
    root = tmp_path_factory.mktemp("gpu")
    odd, _ = odd_tar_dataset(root / "odd", SAMPLES)
    members = {}
    for i in range(IMAGES):
        if i != NO_IMAGE:
            members[f"img{i:04d}.jpg"] = picture(i)
        members[f"img{i:04d}.cls"] = b"%d" % (i % 10)
    jpegs = tar_dataset(root / "jpegs", [members])
    with start_service({"odd": odd, "jpegs": jpegs}, cache_dir=root / "cache") as svc, Client(svc.url) as client:
        torch.zeros(1, device="cuda")  # the CUDA context made before any profiling
        yield client


def as_bytes(batch: Batch) -> list[dict]:
    """The batch's samples with ``bytes`` for views, wherever its buffer lies."""
    return [{k: bytes(v.cpu().numpy()) if torch.is_tensor(v) else v for k, v in s.items()} for s in batch]


def host_to_device_copies(work) -> list[str]:
    """The host-to-device copies the GPU ran for ``work()``, as CUPTI names them
    (``Memcpy HtoD (Pinned -> Device)``)."""
    if ProfilerActivity.CUDA not in torch.profiler.supported_activities():
        pytest.skip("torch's profiler cannot see CUDA activity here (no CUPTI): the copies cannot be counted")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        work()
        torch.cuda.synchronize()
    return [event.name for event in prof.events() if "Memcpy HtoD" in event.name]


def test_a_pinned_batch_reaches_the_gpu_in_one_copy_byte_exact(client):
    batch = client.get_batch_tensors("odd", list(range(SAMPLES)) + [3, 3])
    pinned = batch.pin_memory()
    assert pinned.buffer.is_pinned() and torch.equal(pinned.buffer, batch.buffer)
    moved: list[Batch] = []
    copies = host_to_device_copies(lambda: moved.append(pinned.to("cuda", non_blocking=True)))
    assert len(copies) == 1 and "Pinned" in copies[0], copies  # page-locked: the copy can run asynchronously
    on_gpu = moved[0]
    assert on_gpu.buffer.device.type == "cuda"
    assert torch.equal(on_gpu.buffer.cpu(), batch.buffer)
    assert as_bytes(on_gpu) == as_bytes(batch)  # every view now lies on the GPU, at the same offsets
    unpinned = host_to_device_copies(lambda: batch.to("cuda"))
    assert unpinned and all("Pageable" in c for c in unpinned), unpinned  # the profiler tells the two apart


def torchvision_io():
    """``torchvision.io``, the test skipped where it cannot decode JPEGs on CUDA (then
    ``decode_images`` decodes with Pillow on the CPU)."""
    try:
        import torchvision.io as tvio
    except Exception as error:  # absent, or built for another torch: any import error says the same
        pytest.skip(f"torchvision.io is not importable here ({error!r}): decode_images uses Pillow on the CPU")
    if not hasattr(tvio, "decode_jpeg"):
        pytest.skip("this torchvision has no torchvision.io.decode_jpeg")
    try:
        tvio.decode_jpeg([torch.frombuffer(bytearray(picture(1)), dtype=torch.uint8)], device="cuda")
    except RuntimeError as error:  # a CPU-only torchvision beside a CUDA torch
        pytest.skip(f"this torchvision cannot decode JPEGs on CUDA: {error}")
    return tvio


def test_a_batch_of_jpegs_decodes_in_one_nvjpeg_call_as_pillow_decodes_them(client, monkeypatch):
    # nvJPEG's IDCT and chroma upsampling are not libjpeg-turbo's (Pillow's): pixels may differ
    # by a few levels, so the images are compared within a tolerance, their shapes exactly.
    tvio = torchvision_io()
    real, calls = tvio.decode_jpeg, []

    def counted(images, *args, **kwargs):
        calls.append((images, kwargs.get("device")))
        return real(images, *args, **kwargs)

    monkeypatch.setattr(tvio, "decode_jpeg", counted)
    indices = list(range(IMAGES))[::-1]
    batch = client.get_batch_tensors("jpegs", indices).pin_memory()
    decoded = decode_images(batch["jpg"], device="cuda")
    assert len(calls) == 1, f"{len(calls)} calls to decode_jpeg for one batch"
    images, device = calls[0]
    assert isinstance(images, list) and len(images) == IMAGES - 1 and torch.device(device).type == "cuda"
    for i, image in zip(indices, decoded):
        if i == NO_IMAGE:
            assert image is None
            continue
        with Image.open(io.BytesIO(picture(i))) as source:
            want = torch.from_numpy(np.array(source))
        want = want[None] if want.ndim == 2 else want.permute(2, 0, 1)  # grayscale: one channel, as stored
        assert image.device.type == "cuda" and image.dtype == torch.uint8
        assert image.shape == want.shape, (i, tuple(image.shape), tuple(want.shape))
        diff = (image.cpu().int() - want.int()).abs()
        assert diff.float().mean() <= 2.0 and diff.max() <= 24, (i, diff.float().mean().item(), diff.max().item())


def test_a_dataloader_with_pin_memory_hands_out_pinned_batches_that_move_whole(client):
    ds = ShardfeedDataset(client, "odd", output="tensors", fields=["bin", "cls"])
    loader = DataLoader(ds, batch_size=8, num_workers=2, pin_memory=True, shuffle=True,
                        generator=torch.Generator().manual_seed(0))
    seen = []
    for batch in loader:
        assert isinstance(batch, Batch) and batch.buffer.is_pinned(), batch
        on_gpu = batch.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert as_bytes(on_gpu) == client.get_batch("odd", batch.indices.tolist(), ["bin", "cls"])
        seen += batch.indices.tolist()
    assert sorted(seen) == list(range(SAMPLES))
