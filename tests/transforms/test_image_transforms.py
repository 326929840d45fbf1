"""The stock image transforms (shardfeed/transforms/image.py) on the synthetic JPEGs (seeds/jpegs.py)."""

import io

import numpy as np
import pytest
from PIL import Image

from shardfeed.seeds.jpegs import sample_jpeg
from shardfeed.transforms import TransformError, apply, checked, describe, load, pack, unpack
from shardfeed.transforms import image as stock
from shardfeed.transforms.image import (
    ImageNet, center_crop_box, crop_resized, decode, random_resized_crop_box, resized_size,
)


def encoded(pixels: np.ndarray, format: str = "PNG", **options) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format, **options)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def samples():
    return [{"jpg": sample_jpeg(0, i), "cls": str(i * 7 % 1000).encode()} for i in range(6)]


@pytest.mark.parametrize("factory", ["imagenet_train", "imagenet_eval"])
def test_the_factories_load_and_declare_their_outputs(factory):
    transform = load(f"shardfeed.transforms.image:{factory}")
    assert describe(transform) == {"version": "1", "fields": ["jpg", "jpeg", "png", "webp", "cls"],
                                   "outputs": {"image": {"dtype": "uint8", "shape": [3, 224, 224]},
                                               "label": {"dtype": "int64", "shape": []}}}


def test_prepare_gives_a_short_side_of_256_and_the_label(samples):
    transform = stock.imagenet_train()
    for n, sample in enumerate(samples):
        width, height = Image.open(io.BytesIO(sample["jpg"])).size
        prepared = transform.prepare(sample)
        assert prepared["image"].dtype == np.uint8
        assert prepared["image"].shape == (*resized_size(width, height)[::-1], 3)
        assert min(prepared["image"].shape[:2]) == 256
        assert prepared["label"].dtype == np.int64 and prepared["label"].shape == () and prepared["label"] == n * 7
        for name in ("train", "eval"):
            out = checked(transform, apply(getattr(stock, f"imagenet_{name}")(), prepared, 0, 0, n))
            assert out["image"].shape == (3, 224, 224) and int(out["label"]) == n * 7


def test_a_jpeg_decoded_shrunk_is_resized_from_its_own_size():
    # 999 x 520 decodes at 500 x 260 (DCT scaling by 1/2), whose own short-side resize would be 492 wide;
    # torchvision's Resize(256) of the original is int(256 * 999 / 520) = 491 wide.
    for size, resized in [((1000, 750), (256, 341, 3)), ((999, 520), (256, 491, 3))]:
        assert stock.imagenet_train().prepare({"jpg": sample_jpeg(0, 0, size), "cls": b"0"})["image"].shape == resized


def test_a_jpeg_smaller_than_the_short_side_is_resized_up(monkeypatch):
    # The synthetic dataset's sides start at 200 pixels, as some of ImageNet's do; Pillow's path too.
    for decoder in (stock.simplejpeg, None):
        monkeypatch.setattr(stock, "simplejpeg", decoder)
        for size, resized in [((200, 150), (256, 341, 3)), ((240, 320), (341, 256, 3))]:
            jpeg = sample_jpeg(0, 0, size)
            assert stock.imagenet_train().prepare({"jpg": jpeg, "cls": b"0"})["image"].shape == resized


def test_prepare_is_the_same_bytes_every_time(samples):
    first = [pack(stock.imagenet_train().prepare(sample)) for sample in samples]
    again = [pack(stock.imagenet_eval().prepare(sample)) for sample in samples]
    assert first == again


def test_simplejpeg_and_pillow_decode_to_the_same_pixels(samples, monkeypatch):
    if stock.simplejpeg is None:
        pytest.skip("simplejpeg is not installed (the image extra)")
    gray = encoded(np.arange(600 * 530, dtype=np.uint32).reshape(530, 600).astype(np.uint8), "JPEG")
    large = sample_jpeg(0, 1, (1000, 750))  # decoded at 1/2 (DCT scaling) by both
    datas = [s["jpg"] for s in samples] + [gray, large]
    simple = [np.asarray(decode(data)[0]) for data in datas]
    monkeypatch.setattr(stock, "simplejpeg", None)
    pillow = [np.asarray(decode(data)[0]) for data in datas]
    assert simple[-1].shape == (375, 500, 3)
    for a, b in zip(simple, pillow):
        assert a.shape == b.shape and np.array_equal(a, b)


def test_augment_is_reproducible_from_seed_epoch_index_and_differs_across_epochs(samples):
    transform = stock.imagenet_train()
    prepared = transform.prepare(samples[0])
    first = apply(transform, prepared, seed=5, epoch=0, index=0)["image"]
    assert np.array_equal(apply(transform, unpack(pack(prepared)), seed=5, epoch=0, index=0)["image"], first)
    others = [apply(transform, prepared, seed=5, epoch=epoch, index=0)["image"] for epoch in (1, 2, 3)]
    assert all(not np.array_equal(other, first) for other in others)
    assert not np.array_equal(apply(transform, prepared, seed=6, epoch=0, index=0)["image"], first)


def test_eval_is_the_centre_crop_and_draws_nothing(samples):
    transform = stock.imagenet_eval()
    prepared = transform.prepare(samples[0])
    pixels = prepared["image"]
    top, left = (pixels.shape[0] - 224 + 1) // 2, round((pixels.shape[1] - 224) / 2)
    expected = pixels[top:top + 224, left:left + 224].transpose(2, 0, 1)
    for epoch in (0, 1):
        assert np.array_equal(apply(transform, prepared, 0, epoch, 0)["image"], expected)


class Drawn:
    """A generator that hands out given numbers, for crops computed by hand."""

    def __init__(self, uniforms, integers=(), randoms=()):
        self.uniforms, self.ints, self.randoms = list(uniforms), list(integers), list(randoms)

    def uniform(self, low, high):
        return low + self.uniforms.pop(0) * (high - low)

    def integers(self, low, high):
        value = self.ints.pop(0)
        assert low <= value < high
        return value

    def random(self):
        return self.randoms.pop(0)


def test_random_resized_crop_box_by_hand():
    # A 100 x 200 image (area 20000); an area share 0.5 of scale and an aspect 1 (log ratio midway):
    # 10000 px, 100 x 100, placed at the drawn top 0 and left 37.
    box = random_resized_crop_box(100, 200, Drawn([(0.5 - 0.08) / 0.92, 0.5], [0, 37]))
    assert box == (0, 37, 100, 100)
    # Ten tries that never fit (the whole area at the widest aspect is wider than 200): the fallback.
    # A 100 x 200 image is wider than 4/3: the height kept, the width 133, centred.
    assert random_resized_crop_box(100, 200, Drawn([1.0, 1.0] * 10)) == (0, 33, 100, 133)
    # A square within the ratios: the whole image.
    assert random_resized_crop_box(50, 50, Drawn([1.0, 1.0] * 10)) == (0, 0, 50, 50)
    # Taller than 3/4: the width kept, the height 200 / (3/4) = 267 of 400, centred.
    assert random_resized_crop_box(400, 200, Drawn([1.0, 1.0] * 10)) == (66, 0, 267, 200)


def test_crop_and_flip_by_hand_on_a_small_image():
    # A 256 x 300 image whose pixels name their place; a crop exactly 224 x 224 is not resized.
    rows, cols = np.meshgrid(np.arange(256), np.arange(300), indexing="ij")
    pixels = np.stack([rows % 256, cols % 256, (rows + cols) % 256], axis=-1).astype(np.uint8)
    prepared = {"image": pixels, "label": np.array(3, np.int64)}
    aspect = 0.5  # log-uniform midway between 3/4 and 4/3: an aspect of 1
    share = (224 * 224 / (256 * 300) - 0.08) / 0.92
    transform = ImageNet(train=True)
    unflipped = transform.augment(prepared, Drawn([share, aspect], [10, 20], [0.7]))["image"]
    assert np.array_equal(unflipped, pixels[10:234, 20:244].transpose(2, 0, 1))
    flipped = transform.augment(prepared, Drawn([share, aspect], [10, 20], [0.3]))["image"]
    assert np.array_equal(flipped, pixels[10:234, 20:244][:, ::-1].transpose(2, 0, 1))
    assert np.array_equal(flipped[:, :, 0], unflipped[:, :, -1])
    # The eval crop of the same: rows 16-239, columns 38-261 (torchvision rounds (300 - 224) / 2 = 38).
    assert center_crop_box(256, 300) == (16, 38, 224, 224)
    assert np.array_equal(ImageNet(train=False).augment(prepared, None)["image"],
                          pixels[16:240, 38:262].transpose(2, 0, 1))


def test_a_crop_is_resized_as_pillow_resizes_it():
    pixels = np.random.default_rng(0).integers(0, 256, (256, 320, 3), dtype=np.uint8)
    expected = Image.fromarray(pixels).crop((5, 7, 5 + 150, 7 + 100)).resize((224, 224), Image.BILINEAR)
    assert np.array_equal(crop_resized(pixels, (7, 5, 100, 150)), np.asarray(expected))


def test_png_webp_and_a_named_field_are_read():
    pixels = np.random.default_rng(1).integers(0, 256, (300, 400, 3), dtype=np.uint8)
    png = ImageNet().prepare({"png": encoded(pixels), "cls": b"4\n"})
    assert png["image"].shape == (256, 341, 3) and int(png["label"]) == 4
    assert np.array_equal(png["image"], np.asarray(Image.fromarray(pixels).resize((341, 256), Image.BILINEAR)))
    webp = ImageNet(image_field="img", label_field=None).prepare({"img": encoded(pixels, "WEBP"), "cls": b"x"})
    assert webp["image"].shape == (256, 341, 3) and int(webp["label"]) == -1
    assert ImageNet(image_field="img", label_field="y").fields == ("img", "y")


@pytest.mark.parametrize("sample, message", [
    ({"jpg": b"\xff\xd8\xff\xe0 not really a jpeg", "cls": b"1"}, r"field 'jpg': not a decodable image \(22 bytes\)"),
    ({"png": b"garbage", "cls": b"1"}, "field 'png': not a decodable image"),
    ({"cls": b"1"}, r"the sample has no image field \(jpg, jpeg, png, webp\)"),
    ({"jpg": None, "cls": b"seven"}, "label field 'cls' is not an integer: b'seven'"),
    ({"jpg": None}, "the sample has no label field 'cls'"),
])
def test_bad_samples_fail_in_prepare_with_a_clear_error(samples, sample, message):
    sample = {k: samples[0]["jpg"] if v is None else v for k, v in sample.items()}
    with pytest.raises(ValueError, match=message) as error:
        stock.imagenet_train().prepare(sample)
    assert not isinstance(error.value, TransformError)


def test_a_truncated_jpeg_fails_in_prepare(samples, monkeypatch):
    data = samples[0]["jpg"]
    for decoder in ("simplejpeg", "Pillow"):
        with pytest.raises(ValueError, match="field 'jpg': not a decodable image"):
            stock.imagenet_train().prepare({"jpg": data[:len(data) // 2], "cls": b"1"})
        monkeypatch.setattr(stock, "simplejpeg", None)
