"""The stock image transforms: ImageNet's standard recipe as a :class:`Transform`, without torchvision.

    serve --transform imagenet_train=shardfeed.transforms.image:imagenet_train
    serve --transform imagenet_eval=shardfeed.transforms.image:imagenet_eval

``prepare`` decodes the sample's image (JPEG, PNG or WebP) to RGB and resizes it so its short side is
256 (torchvision's ``Resize(256)`` on a PIL image: Pillow's antialiased bilinear, the long side
truncated), and parses its label: ``image`` uint8 ``(H, W, 3)``, ``label`` int64 ``()``. ``augment`` is
``RandomResizedCrop(224)`` then ``RandomHorizontalFlip()`` for training, ``CenterCrop(224)`` for
evaluation, with torchvision's arithmetic and sampling procedure (drawn from the sample's own
generator, not torch's): ``image`` uint8 ``(3, 224, 224)``, ``label`` int64 ``()``.

A JPEG much larger than the resize's output is decoded already shrunk by 1/2, 1/4 or 1/8 (libjpeg's
DCT scaling, Pillow's ``draft``: the largest that leaves it no smaller than the output), which makes
decode and resize of a large photo about a third cheaper. It is decoded by simplejpeg where installed
(the ``image`` extra: about a third faster than Pillow on ImageNet-sized JPEGs,
``python -m shardfeed.benchmarks.jpeg_decode``), else by Pillow; both are libjpeg-turbo with the same
settings and give the same pixels (a test holds them equal), so ``prepare`` is the same bytes whichever
a process has. Other formats are decoded by Pillow.
"""

from __future__ import annotations

import io
import math

import numpy as np
from PIL import Image

from shardfeed.transforms.base import Output, Transform

try:
    import simplejpeg
except ImportError:  # the image extra is not installed: Pillow decodes JPEGs too, to the same pixels
    simplejpeg = None

IMAGE_FIELDS = ("jpg", "jpeg", "png", "webp")
"""The fields an image is looked for in, in this order, when no ``image_field`` is named."""
SHORT_SIDE = 256
CROP = 224
SCALE = (0.08, 1.0)
RATIO = (3 / 4, 4 / 3)
_JPEG = b"\xff\xd8\xff"
_SIMPLE_COLOURS = ("YCbCr", "Gray")  # the JPEG colour spaces simplejpeg decodes to Pillow's pixels


def resized_size(width: int, height: int, short_side: int = SHORT_SIDE) -> tuple[int, int]:
    """``(width, height)`` with the short side ``short_side`` and the aspect kept, the long side
    truncated (torchvision's ``Resize(int)``)."""
    if width <= height:
        return short_side, int(short_side * height / width)
    return int(short_side * width / height), short_side


def _dct_scale(width: int, height: int, wanted: tuple[int, int]) -> int:
    """The largest of 8, 4, 2, 1 that shrinks ``(width, height)`` no smaller than ``wanted`` (Pillow's
    ``draft`` rule); 1 for an image smaller than ``wanted`` (a resize up)."""
    scale = min(width // wanted[0], height // wanted[1])
    return next((s for s in (8, 4, 2) if scale >= s), 1)


def _decode_jpeg(data: bytes, short_side: int) -> tuple[Image.Image, tuple[int, int]]:
    # CMYK and YCCK JPEGs go to Pillow: libjpeg-turbo's conversion of them to RGB is not Pillow's.
    header = None if simplejpeg is None else simplejpeg.decode_jpeg_header(data)
    if header is None or header[2] not in _SIMPLE_COLOURS:
        image = Image.open(io.BytesIO(data))
        size = image.size
        image.draft("RGB", resized_size(*size, short_side))
        return image.convert("RGB"), size
    height, width = header[:2]
    scale = _dct_scale(width, height, resized_size(width, height, short_side))
    pixels = simplejpeg.decode_jpeg(data, colorspace="RGB", min_width=-(-width // scale),
                                    min_height=-(-height // scale))
    return Image.fromarray(pixels), (width, height)


def decode(data: bytes, short_side: int = SHORT_SIDE) -> tuple[Image.Image, tuple[int, int]]:
    """An encoded image as an RGB Pillow image, and the ``(width, height)`` it was encoded at: a JPEG may
    come DCT-shrunk, never below what a resize to ``short_side`` needs. ``ValueError`` if it is not a
    whole image Pillow or simplejpeg can read."""
    try:
        if data[:3] == _JPEG:
            return _decode_jpeg(data, short_side)
        with Image.open(io.BytesIO(data)) as image:
            return image.convert("RGB"), image.size
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as err:
        raise ValueError(f"not a decodable image ({len(data)} bytes): {err}") from None


def resize_short(image: Image.Image, size: tuple[int, int], short_side: int = SHORT_SIDE) -> np.ndarray:
    """``image`` (decoded from one of ``size``, maybe shrunk) resized to the short side ``short_side`` of
    ``size`` (antialiased bilinear, as torchvision on PIL), uint8 ``(H, W, 3)``."""
    return np.asarray(image.resize(resized_size(*size, short_side), Image.BILINEAR))


def random_resized_crop_box(height: int, width: int, rng: np.random.Generator, scale: tuple[float, float] = SCALE,
                            ratio: tuple[float, float] = RATIO) -> tuple[int, int, int, int]:
    """``(top, left, h, w)`` of a random crop: torchvision's ``RandomResizedCrop.get_params``, from ``rng``.
    Ten tries at an area share from ``scale`` and a log-uniform aspect from ``ratio``; then the centre
    crop of the aspect nearest the image's within ``ratio``."""
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_ratio[0], log_ratio[1]))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return top, left, h, w
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        w, h = int(round(height * max(ratio))), height
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def center_crop_box(height: int, width: int, size: int = CROP) -> tuple[int, int, int, int]:
    """``(top, left, h, w)`` of torchvision's ``CenterCrop(size)`` (the image at least ``size`` a side)."""
    return int(round((height - size) / 2.0)), int(round((width - size) / 2.0)), size, size


def crop_resized(pixels: np.ndarray, box: tuple[int, int, int, int], size: int = CROP) -> np.ndarray:
    """The ``(top, left, h, w)`` box of ``pixels`` (``(H, W, 3)``) resized to ``size`` x ``size`` (antialiased
    bilinear; none when it is that size already), as ``(H, W, 3)``."""
    top, left, h, w = box
    crop = pixels[top:top + h, left:left + w]
    if (h, w) == (size, size):
        return crop
    return np.asarray(Image.fromarray(np.ascontiguousarray(crop)).resize((size, size), Image.BILINEAR))


class ImageNet(Transform):
    """ImageNet's recipe for one field's image and one field's label (see the module).

    train: random-resized-crop and flip (else the centre crop).
    image_field: the field holding the image; ``None``: the first of ``IMAGE_FIELDS`` the sample has.
    label_field: the field holding the class as ASCII digits (``cls``); ``None``: no label is read and
    every ``label`` is -1. A sample without it, or whose label is not an integer, fails in ``prepare``.
    """

    version = "1"
    outputs = {"image": Output("uint8", (3, CROP, CROP)), "label": Output("int64", ())}

    def __init__(self, train: bool = True, image_field: str | None = None, label_field: str | None = "cls"):
        self.train = train
        self.image_fields = IMAGE_FIELDS if image_field is None else (image_field,)
        self.label_field = label_field
        self.fields = self.image_fields + (() if label_field is None else (label_field,))

    def _image(self, sample) -> tuple[str, bytes]:
        for field in self.image_fields:
            if field in sample:
                return field, bytes(sample[field])
        raise ValueError(f"the sample has no image field ({', '.join(self.image_fields)})")

    def _label(self, sample) -> int:
        if self.label_field is None:
            return -1
        if self.label_field not in sample:
            raise ValueError(f"the sample has no label field {self.label_field!r}")
        text = bytes(sample[self.label_field])
        try:
            return int(text.decode("ascii").strip())
        except (UnicodeDecodeError, ValueError):
            raise ValueError(f"label field {self.label_field!r} is not an integer: {text[:40]!r}") from None

    def prepare(self, sample):
        """The image decoded and resized to a short side of 256, uint8 ``(H, W, 3)``; its label."""
        field, data = self._image(sample)
        try:
            pixels = resize_short(*decode(data))
        except ValueError as err:
            raise ValueError(f"field {field!r}: {err}") from None
        return {"image": pixels, "label": np.array(self._label(sample), dtype=np.int64)}

    def augment(self, prepared, rng):
        pixels = prepared["image"]
        height, width = pixels.shape[:2]
        if self.train:
            out = crop_resized(pixels, random_resized_crop_box(height, width, rng))
            if rng.random() < 0.5:
                out = out[:, ::-1]
        else:
            out = crop_resized(pixels, center_crop_box(height, width))
        return {"image": np.ascontiguousarray(out.transpose(2, 0, 1)), "label": prepared["label"]}


def imagenet_train() -> ImageNet:
    """``RandomResizedCrop(224)`` + ``RandomHorizontalFlip()`` of the image in ``jpg``/``jpeg``/``png``/``webp``,
    label from ``cls``."""
    return ImageNet(train=True)


def imagenet_eval() -> ImageNet:
    """``CenterCrop(224)`` of the image in ``jpg``/``jpeg``/``png``/``webp``, label from ``cls``."""
    return ImageNet(train=False)
