"""A synthetic JPEG dataset (``shardfeed seed --jpegs``): real, photo-like JPEG files of ImageNet's sizes.

Each sample is ``jpg`` (a baseline JPEG, RGB, 4:2:0) and ``cls`` (a label 0-999 as ASCII digits), keyed
as the synthetic dataset's (``000000000``, ...). Everything is a pure function of ``(seed, i)`` (with the
same Pillow and libjpeg), so a test can make sample ``i`` again with :func:`sample_jpeg`.

Sizes follow ImageNet's shape: half the images are 500 x 375, a third other 500-pixel shapes (500 x 333,
portraits 375 x 500 and 333 x 500, squares), the rest any size from 200 to 1000 pixels a side. The pixels
look like a photo to the encoder (smooth gradients, blurred shapes, noise at two scales), so a 500 x 375
image is about 95 KiB at quality 93, as ImageNet's are; quality steps down for large images and up for
small ones to keep every file within 20-250 KiB.

Making them is cheap: a pool of 16 base images per seed (about 0.2 s each, once), then each sample is a
crop of one at its own offset, its own colour shift and mirror, and two shapes of its own drawn on it:
the JPEG encode is most of a sample's cost (about 2 ms for 500 x 375 here).
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from functools import lru_cache

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

from shardfeed.seeds.synthetic import sample_key
from shardfeed.service.datasets.index import Index
from shardfeed.service.datasets.shards import DEFAULT_SHARD_SIZE, Sample, write_shards

FIELDS = ("jpg", "cls")
SIDES = (200, 1000)
"""The smallest and largest side of an image, in pixels."""
FILE_SIZES = (20 << 10, 250 << 10)
"""Every file's size lies within these bytes (the quality steps until it does)."""
QUALITY = 93
"""The JPEG quality of an image that falls within ``FILE_SIZES`` at it (most of them)."""
_QUALITIES = (95, 98)  # tried, in turn, for an image too small at QUALITY
_LOWER = (80, 70, 60, 50)  # tried, in turn, for one too large
_BASES = 16
_BASE_SIDE = 1024  # every base holds a crop of the largest size
_COMMON = ((500, 333), (375, 500), (333, 500), (500, 500))  # ImageNet's next most common shapes


def _rng(seed: int, i: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, i, stream])


def image_size(seed: int, i: int) -> tuple[int, int]:
    """``(width, height)`` of sample ``i``."""
    rng = _rng(seed, i, 0)
    draw = rng.random()
    if draw < 0.5:
        return 500, 375
    if draw < 0.85:
        return _COMMON[int(rng.integers(len(_COMMON)))]
    long = int(rng.integers(SIDES[0], SIDES[1] + 1))
    short = max(SIDES[0], min(long, round(long / rng.uniform(1.0, 16 / 9))))
    return (short, long) if rng.random() < 0.3 else (long, short)


def sample_label(seed: int, i: int) -> int:
    """The class of sample ``i``, 0-999."""
    return int(_rng(seed, i, 1).integers(1000))


def _shape(draw: ImageDraw.ImageDraw, rng: np.random.Generator, side: int) -> None:
    """One filled ellipse, rectangle or triangle of a random colour somewhere within ``side`` pixels."""
    colour = tuple(int(c) for c in rng.integers(0, 256, 3))
    x, y = (int(v) for v in rng.integers(0, side, 2))
    r = int(rng.integers(10, side // 5))
    box = [x - r, y - r, x + r, y + int(r * rng.uniform(0.3, 1.5))]
    kind = int(rng.integers(3))
    if kind == 0:
        draw.ellipse(box, fill=colour)
    elif kind == 1:
        draw.rectangle(box, fill=colour)
    else:
        draw.polygon([tuple(int(v) for v in rng.integers(0, side, 2)) for _ in range(3)], fill=colour)


def _base(seed: int, b: int) -> Image.Image:
    """Base image ``b`` of the pool: a smooth colour field, blurred shapes, then grain and blotches."""
    rng = _rng(seed, b, 2)
    side = _BASE_SIDE
    image = Image.fromarray(rng.integers(0, 256, (5, 5, 3), dtype=np.uint8)).resize((side, side), Image.BICUBIC)
    draw = ImageDraw.Draw(image)
    for _ in range(40):
        _shape(draw, rng, side)
    pixels = np.asarray(image.filter(ImageFilter.GaussianBlur(2)), dtype=np.float32)
    blotches = Image.fromarray(rng.integers(0, 256, (side // 2, side // 2), dtype=np.uint8))
    pixels += (np.asarray(blotches.resize((side, side), Image.BILINEAR), dtype=np.float32)[..., None] - 128) * 0.4
    pixels += rng.normal(0, 10, (side, side, 3)).astype(np.float32)  # grain, each channel its own
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


@lru_cache(maxsize=2)
def _pool(seed: int) -> tuple[Image.Image, ...]:
    return tuple(_base(seed, b) for b in range(_BASES))


def sample_image(seed: int, i: int, size: tuple[int, int] | None = None) -> Image.Image:
    """The pixels of sample ``i`` (RGB, :func:`image_size` or ``size``) before they are encoded."""
    width, height = size or image_size(seed, i)
    rng = _rng(seed, i, 3)
    base = _pool(seed)[int(rng.integers(_BASES))]
    x, y = int(rng.integers(0, _BASE_SIDE - width + 1)), int(rng.integers(0, _BASE_SIDE - height + 1))
    image = base.crop((x, y, x + width, y + height))
    gain, shift = rng.uniform(0.8, 1.2, 3), rng.uniform(-25, 25, 3)
    lut = np.clip(np.arange(256)[None, :] * gain[:, None] + shift[:, None], 0, 255).astype(np.uint8)
    image = image.point(lut.ravel().tolist())  # per-channel colour shift: one table of 3 x 256
    if rng.random() < 0.5:
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    draw = ImageDraw.Draw(image)
    for _ in range(2):
        _shape(draw, rng, min(width, height))
    return image


def _encode(image: Image.Image, quality: int) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=quality)
    return buffer.getvalue()


def sample_jpeg(seed: int, i: int, size: tuple[int, int] | None = None) -> bytes:
    """The ``jpg`` member of sample ``i`` (or, with ``size``, its image at that size): at ``QUALITY``, or
    the first quality that brings it within ``FILE_SIZES``."""
    image = sample_image(seed, i, size)
    data = _encode(image, QUALITY)
    low, high = FILE_SIZES
    for quality in _QUALITIES if len(data) < low else _LOWER if len(data) > high else ():
        data = _encode(image, quality)
        if low <= len(data) <= high:
            break
    return data


def iter_samples(samples: int, seed: int) -> Iterator[Sample]:
    for i in range(samples):
        yield sample_key(i), [("jpg", sample_jpeg(seed, i)), ("cls", str(sample_label(seed, i)).encode())]


async def seed_jpegs(store, *, samples: int, shard_size: int = DEFAULT_SHARD_SIZE, seed: int = 0,
                     progress: bool = True) -> Index:
    """Write ``samples`` synthetic JPEGs (``jpg`` + ``cls``) as shards + index into ``store``; returns the index.

    shard_size: target shard size in bytes (an image is about 100 KiB of tar).
    seed: selects the images; the same arguments always give the same dataset.
    """
    if samples < 1:
        raise ValueError(f"--samples must be at least 1, not {samples}")
    if seed < 0:
        raise ValueError(f"--seed must not be negative, not {seed}")
    return await write_shards(store, iter_samples(samples, seed), shard_size=shard_size,
                              total_bytes=samples * (100 << 10), desc="jpegs", progress=progress)
