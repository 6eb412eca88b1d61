"""The ImageNet input's cost per core: samples/s of decode + augment, and of the synthetic set.

    PYTHONPATH=entrypoint python3 bench/imagenet_input.py [--images 200] [--seconds 3]

Writes JPEGs of about 256 x 256 (four shapes around it, quality 90, smooth content plus grain:
file sizes like photos of that size) to a temporary directory, then times, in this process on
one thread (as a DataLoader worker runs: torch sets its workers to one thread):
decode alone, decode + the training transform and decode + the evaluation transform at 64 and
224 px; and SyntheticImageNet's generation and per-sample cost. Prints one JSON object.
Files are read from the page cache after the first pass: this measures CPU, not the disk.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import results_page
import torch
from PIL import Image

from trainpod.examples.imagenet_data import ImageFolder, SyntheticImageNet, decode

SHAPES = ((256, 256), (320, 240), (240, 320), (288, 256))  # (width, height)


def write_images(root: Path, count: int) -> list[int]:
    rng = np.random.default_rng(0)
    sizes = []
    for i in range(count):
        width, height = SHAPES[i % len(SHAPES)]
        coarse = rng.uniform(0, 255, size=(12, 12, 3)).astype(np.uint8)
        smooth = np.asarray(Image.fromarray(coarse).resize((width, height), Image.Resampling.BICUBIC), dtype=np.float64)
        pixels = np.clip(smooth + rng.normal(0, 10, size=smooth.shape), 0, 255).astype(np.uint8)
        path = root / "c" / f"{i:05d}.JPEG"
        Image.fromarray(pixels).save(path, quality=90)
        sizes.append(path.stat().st_size)
    return sizes


def rate(fn, count: int, seconds: float) -> float:
    """Samples/s of fn(i) over i in 0..count-1, repeated for at least `seconds`; the median of rounds."""
    fn(0)  # warm-up
    rounds = []
    started = time.perf_counter()
    while not rounds or time.perf_counter() - started < seconds:
        t = time.perf_counter()
        for i in range(count):
            fn(i)
        rounds.append(count / (time.perf_counter() - t))
    return round(statistics.median(rounds), 1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--images", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--synthetic-samples", type=int, default=2048)
    args = parser.parse_args()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="trainpod-bench-imagenet-"))
    try:
        (root / "c").mkdir()
        sizes = write_images(root, args.images)
        result = {
            "cpu": platform.processor() or platform.machine(),
            "images": args.images,
            "mean_jpeg_kb": round(sum(sizes) / len(sizes) / 1024, 1),
            "decode_per_s": rate(lambda i: decode(root / "c" / f"{i:05d}.JPEG"), args.images, args.seconds),
        }
        for size in (64, 224):
            train = ImageFolder(root, size, train=True, seed=0)
            val = ImageFolder(root, size, train=False)
            result[f"train_{size}_per_s"] = rate(lambda i, d=train: d[(1, i)], args.images, args.seconds)
            result[f"eval_{size}_per_s"] = rate(lambda i, d=val: d[i], args.images, args.seconds)
        for size in (64, 224):
            n = args.synthetic_samples
            t = time.perf_counter()
            synthetic = SyntheticImageNet(n, size, num_classes=100, seed=0)
            result[f"synthetic_{size}_generate_per_s"] = round(n / (time.perf_counter() - t), 1)
            result[f"synthetic_{size}_per_s"] = rate(lambda i, d=synthetic: d[(1, i)], n, args.seconds)
        print(json.dumps(result))
        results_page.record("imagenet-input", json.dumps(result, indent=1))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
