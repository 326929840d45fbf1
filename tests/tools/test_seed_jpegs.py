"""The synthetic JPEG dataset (seeds/jpegs.py) and ``shardfeed seed --jpegs``."""

import io

import numpy as np
from PIL import Image

from shardfeed.seeds.jpegs import FILE_SIZES, SIDES, image_size, sample_jpeg, sample_label

from common.cli import members_through_index, ok, one_line_error, refusals


def test_images_are_valid_jpegs_of_imagenet_sizes_within_the_file_sizes():
    sizes, files = [], []
    for i in range(120):
        data = sample_jpeg(0, i)
        with Image.open(io.BytesIO(data)) as image:
            assert image.format == "JPEG" and image.mode == "RGB"
            assert image.size == image_size(0, i)
            image.load()  # the whole file decodes
        sizes.append(image.size)
        files.append(len(data))
        assert all(SIDES[0] <= side <= SIDES[1] for side in image.size)
        assert FILE_SIZES[0] <= len(data) <= FILE_SIZES[1], (i, image.size, len(data))
    assert 0.35 < sizes.count((500, 375)) / len(sizes) < 0.65  # ImageNet's typical size, most often
    assert any(w < h for w, h in sizes)  # portraits too
    typical = [n for n, size in zip(files, sizes) if size == (500, 375)]
    assert 80 << 10 < np.median(typical) < 115 << 10


def test_large_and_small_images_stay_within_the_file_sizes():
    for size in [(1000, 1000), (1000, 563), (200, 200), (200, 260)]:
        assert FILE_SIZES[0] <= len(sample_jpeg(0, 1, size)) <= FILE_SIZES[1], size


def test_samples_are_a_function_of_seed_and_index():
    assert sample_jpeg(1, 7) == sample_jpeg(1, 7) and sample_label(1, 7) == sample_label(1, 7)
    assert len({sample_jpeg(1, i) for i in range(8)}) == 8
    assert sample_jpeg(0, 7) != sample_jpeg(1, 7)
    assert len({sample_label(0, i) for i in range(200)}) > 150 and all(0 <= sample_label(0, i) < 1000
                                                                      for i in range(200))


def test_seed_jpegs_writes_jpg_and_cls_shards(tmp_path):
    url = str(tmp_path / "jpegs")
    assert ok("seed", url, "--jpegs", "--samples", "12", "--seed", "4", "--shard-size", "300KiB").startswith(
        "seeded 12 samples (24 members")
    index, members = members_through_index(url)
    assert len(index) == 12 and index.fields == ["cls", "jpg"] and len(index.shards) > 1
    for i in range(12):
        key = f"{i:09d}"
        assert members[key, "jpg"] == sample_jpeg(4, i)
        assert members[key, "cls"] == str(sample_label(4, i)).encode()


def test_seed_jpegs_refuses_what_it_does_not_take(tmp_path):
    seed = ["seed", str(tmp_path / "d")]
    errors = [one_line_error(refused) for refused in refusals([
        [*seed, "--jpegs"], [*seed, "--jpegs", "--digits"], [*seed, "--jpegs", "--samples", "2", "--size", "1KiB"],
        [*seed, "--jpegs", "--samples", "0"]])]
    assert "--samples is required" in errors[0]
    assert "choose one of --digits and --jpegs" in errors[1]
    assert "--jpegs sets its own fields and sizes; drop --size and --fields" in errors[2]
    assert "--samples must be at least 1" in errors[3]
    assert not (tmp_path / "d").exists()
