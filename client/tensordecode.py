"""Decoding a tensor batch where it is cheapest: images in one batched call, records as views.

The bytes of a :class:`~.tensors.Batch` are already in one buffer (pinned and on the GPU
after ``batch.pin_memory().to("cuda")``, or on the host); these helpers take a field of it:

    images = decode_images(batch["jpg"])            # CUDA when present: one nvJPEG call a batch
    labels = decode_labels(batch["cls"])            # int64, one per sample
    tokens = batch["tokens"].stacked(torch.int32)   # fixed records: a (n, length) view, no copy
    arrays = batch["emb"].view(torch.float16)       # or a view per sample, sizes differing

``examples/train_tensors.py`` trains on JPEG samples this way.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import torch

from .tensors import Field


def decode_images(field: Field, device: Any = None) -> list[torch.Tensor | None]:
    """Each sample's image as a ``(channels, height, width)`` uint8 tensor on ``device``
    (default: CUDA when present, else the CPU); ``None`` where a sample lacks the field.

    With torchvision, JPEGs for a CUDA device go to ``torchvision.io.decode_jpeg`` in one
    batched call (nvJPEG), other images through ``decode_image`` on the CPU; without it,
    Pillow decodes on the CPU (3 channels). The batch's views are read as they lie, uncopied.
    """
    device = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    views = list(field)
    present = [v for v in views if v is not None]
    try:
        from torchvision.io import decode_image, decode_jpeg
    except ImportError:
        decoded = [_pil(v).to(device) for v in present]
    else:
        if device.type == "cuda":
            decoded = decode_jpeg([v.cpu() for v in present], device=device)
        else:
            decoded = [decode_image(v) for v in present]
    images = iter(decoded)
    return [None if v is None else next(images) for v in views]


def _pil(view: torch.Tensor) -> torch.Tensor:
    try:
        from PIL import Image
    except ImportError:
        raise ImportError("decode_images needs torchvision or Pillow (pip install pillow)") from None
    with Image.open(io.BytesIO(view.cpu().numpy())) as image:  # Pillow reads a file: one copy of the encoded bytes
        return torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1)


def decode_labels(field: Field) -> torch.Tensor:
    """Each sample's ``.cls`` label (a decimal integer as text) as one int64 tensor; a sample
    that lacks the field is an error (``ValueError``)."""
    labels = []
    for i, view in enumerate(field):
        if view is None:
            raise ValueError(f"sample {i} of the batch has no {field.name!r} field")
        labels.append(int(bytes(view.cpu().numpy())))
    return torch.tensor(labels, dtype=torch.int64)
