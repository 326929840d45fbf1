"""Which JPEG decoder the stock image transform uses, and what each of its stages costs, on one core.

    python -m shardfeed.benchmarks.jpeg_decode [--images 24] [--rounds 5]

On the synthetic dataset's photo-like JPEGs (``seeds/jpegs.py``) at four sizes, ms per image of:
decode alone by Pillow, by simplejpeg, and by Pillow with ``draft`` (libjpeg's DCT scaling to no less
than the resize's output); then ``prepare``'s decode + resize to a short side of 256 by each of them and
by simplejpeg with the same DCT scaling (what ``shardfeed.transforms.image`` does); then the stages of
the transform on its own path: decode, resize, the train crop (random-resized-crop to 224 + flip, from
the prepared array) and the eval crop. Each figure is the best of ``--rounds`` passes over the images
(the least disturbed by other load), so run it on a quiet machine.
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable

import numpy as np
import simplejpeg
from PIL import Image

from shardfeed.benchmarks.common import benchmark_parser, load_note, table
from shardfeed.seeds.jpegs import sample_jpeg
from shardfeed.transforms import apply
from shardfeed.transforms.image import SHORT_SIDE, decode, imagenet_eval, imagenet_train, resize_short, resized_size

SIZES = [(400, 300), (500, 375), (800, 600), (1000, 750)]
"""(width, height): ImageNet's typical size (500 x 375) among the rest of its range."""




def best_ms(works: list[Callable[[object], object]], items: list, rounds: int) -> list[float]:
    """Each of ``works``' fastest of ``rounds`` passes over ``items``, in ms per item (after one warm-up).
    The works take turns within each round, so a burst of other load falls on all of them alike."""
    best = [float("inf")] * len(works)
    for work in works:
        work(items[0])
    for _ in range(rounds):
        for n, work in enumerate(works):
            started = time.perf_counter()
            for item in items:
                work(item)
            best[n] = min(best[n], time.perf_counter() - started)
    return [seconds / len(items) * 1000 for seconds in best]


def pillow(data: bytes) -> tuple[Image.Image, tuple[int, int]]:
    image = Image.open(io.BytesIO(data))
    return image.convert("RGB"), image.size


def pillow_draft(data: bytes) -> tuple[Image.Image, tuple[int, int]]:
    image = Image.open(io.BytesIO(data))
    size = image.size
    image.draft("RGB", resized_size(*size))
    return image.convert("RGB"), size


def simple(data: bytes) -> tuple[Image.Image, tuple[int, int]]:
    pixels = simplejpeg.decode_jpeg(data, colorspace="RGB")
    return Image.fromarray(pixels), pixels.shape[1::-1]


DECODERS = [("Pillow", pillow), ("simplejpeg", simple), ("Pillow draft", pillow_draft)]
PREPARERS = [*DECODERS, ("simplejpeg scaled (used)", decode)]


def main() -> None:
    parser = benchmark_parser(__doc__, __spec__.name)
    parser.add_argument("--images", type=int, default=24, help="images of each size (default 24)")
    parser.add_argument("--rounds", type=int, default=5, help="passes, the best kept (default 5)")
    args = parser.parse_args()
    sets = {size: [sample_jpeg(0, i, size) for i in range(args.images)] for size in SIZES}
    names = [f"{w} x {h} ({np.mean([len(d) for d in sets[w, h]]) / 1024:.0f} KiB)" for w, h in SIZES]

    def rows(methods, stage):
        columns = [best_ms([lambda data, m=method: stage(m, data) for _, method in methods], sets[size], args.rounds)
                   for size in SIZES]
        return [[name, *(f"{column[n]:.2f}" for column in columns)] for n, (name, _) in enumerate(methods)]

    print(f"one core, best of {args.rounds} passes over {args.images} images a size; {load_note()}\n")
    print("decode, ms per image")
    print(table(["decoder", *names], rows(DECODERS, lambda method, data: method(data))))
    print(f"\nprepare: decode + resize to a short side of {SHORT_SIDE}, ms per image")
    print(table(["decoder", *names], rows(PREPARERS, lambda method, data: resize_short(*method(data)))))

    train, evaluate = imagenet_train(), imagenet_eval()
    stages = []
    for size in SIZES:
        images = [decode(data) for data in sets[size]]
        prepared = list(enumerate(train.prepare({"jpg": data, "cls": b"0"}) for data in sets[size]))
        decoding, = best_ms([decode], sets[size], args.rounds)
        resizing, = best_ms([lambda decoded: resize_short(*decoded)], images, args.rounds)
        crops = best_ms([lambda ip, t=t: apply(t, ip[1], 0, 0, ip[0]) for t in (train, evaluate)], prepared,
                        args.rounds)
        stages.append([f"{ms:.2f}" for ms in (decoding, resizing, *crops)])
    print("\nthe transform's stages, ms per image")
    print(table(["image", "decode", "resize to 256", "train crop + flip", "eval crop"],
                [[name, *row] for name, row in zip(names, stages)]))


if __name__ == "__main__":
    main()
