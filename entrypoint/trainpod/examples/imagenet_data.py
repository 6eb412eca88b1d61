"""ImageNet-style input without torchvision: an ImageFolder tree decoded with Pillow, or a synthetic set.

    train = ImageFolder("/data/imagenet", image_size=224, train=True, seed=0)   # root/train/<class>/<image>
    val = ImageFolder("/data/imagenet", image_size=224, train=False)           # root/val/<class>/<image>
    sampler = ResumableDistributedSampler(train, seed=0)
    loader = DataLoader(train, batch_size=B, sampler=EpochIndices(sampler), num_workers=8, persistent_workers=True)
                                                     # EpochIndices: trainpod.train.samplers
    for epoch in ...:
        sampler.set_epoch(epoch)            # EpochIndices reads it: every index arrives as (epoch, i)
        for images, labels in loader: ...   # images float32 [B, 3, S, S], normalized; labels int64 [B]

The tree. `root` is either a split directory (`root/<class>/<image>`) or a directory holding
`train/` and `val/` split directories (find_split). Classes are the sorted names of the split's
subdirectories, labelled 0..C-1 in that order; a class's images are the files below its
directory (subdirectories and symlinks followed) whose names end in an image extension (any
case), sorted, as torchvision's ImageFolder lists them; names starting with "." are ignored
(.ipynb_checkpoints, macOS's ._ files). The list of paths is one numpy byte-string array rather
than a Python list of strings: a DataLoader worker forked from the main process reading a list
of 1.28M Python objects touches (and so copies) every page that holds a reference count, once
per worker; an array is one object.

Decoding (Pillow, converted to RGB) happens in __getitem__, so DataLoader workers decode in
parallel. An image Pillow cannot decode is a ConfigError naming the file; no sample is skipped.

Transforms (Pillow and torch, bilinear; torchvision's definitions):
- train: RandomResizedCrop(S, scale=(0.08, 1.0), ratio=(3/4, 4/3)) -- 10 attempts at a box of a
  random area and log-uniform aspect ratio that fits the image, else the central box of the
  widest allowed ratio -- then a horizontal flip with probability 1/2;
- eval: the short side resized to round(S * 256 / 224) (256 for 224), then the central S x S;
- both: float CHW in [0, 1], normalized with the ImageNet mean and std below.

DETERMINISM. A sample's random augmentation depends only on (seed, epoch, index): __getitem__
takes an int index (epoch 0) or a tuple (epoch, index), and draws from a random.Random seeded
with a hash of the three, never from the global RNGs or anything per worker. So a run resumed
after a kill sees bit-identical batches with any number of DataLoader workers, and so does a
rerun. The epoch has to travel with the index, not as an attribute set on the dataset: a
persistent worker holds its own copy of the dataset, made when the workers started, and never
sees an attribute set later in the main process. EpochIndices(sampler) does that: it yields
(sampler.epoch, i) for each index i of a sampler with an `epoch` (torch's DistributedSampler,
trainpod's ResumableDistributedSampler), read when each pass starts, i.e. after set_epoch; it lives
in trainpod.train.samplers, and the examples' harness uses it for every data set with `wants_epoch`.

SyntheticImageNet is the same interface without files: N images of S x S held in memory as one
uint8 tensor (N * 3 * S * S bytes: 10,000 at 64 px are 123 MB, 10,000 at 224 px 1.5 GB, per
rank), generated once from the seed, so every rank builds the same set and a sample costs
only its normalization. Labels are balanced over the classes; each class is a smooth random
colour pattern plus per-pixel noise, which a ResNet picks up within a few dozen steps at 32-64 px.
The patterns depend on the seed alone, the samples on the split too (train=False draws a held-out
set of the same classes). For training the only augmentation is the same (seed, epoch,
index)-determined horizontal flip.
"""

from __future__ import annotations

import hashlib
import math
import operator
import os
import random
from pathlib import Path
from typing import Any, Union

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import Dataset

from trainpod.errors import ConfigError

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "IMAGE_EXTENSIONS",
    "ImageDataError",
    "ImageFolder",
    "SyntheticImageNet",
    "decode",
    "eval_resize_size",
    "eval_transform",
    "find_split",
    "random_resized_crop_box",
    "sample_rng",
    "to_normalized_tensor",
    "train_transform",
]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
SPLITS = ("train", "val")
CROP_SCALE = (0.08, 1.0)
CROP_RATIO = (3 / 4, 4 / 3)
CROP_ATTEMPTS = 10
FLIP_PROBABILITY = 0.5
EVAL_RESIZE_RATIO = 256 / 224  # resize 256, crop 224: the usual ImageNet evaluation

_MEAN = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
_STD = torch.tensor(IMAGENET_STD).view(3, 1, 1)

Key = Union[int, tuple[int, int]]  # what __getitem__ takes: i (epoch 0) or (epoch, i)


class ImageDataError(ConfigError):
    """A one-line ConfigError (exit 78) about the data, that stays one line out of a DataLoader worker.

    torch re-raises a worker's exception in the main process as type(e)(text), the text being
    "Caught ImageDataError in DataLoader worker process N.\\nOriginal Traceback ...", ending in the
    traceback's last line "<module>.ImageDataError: <message>". Keep the message: the worker's
    traceback says nothing a user can act on.
    """

    def __init__(self, message: str):
        super().__init__(_one_line(message, f"{type(self).__module__}.{type(self).__qualname__}: "))


def _one_line(message: str, traceback_prefix: str) -> str:
    if message.startswith("Caught ") and "\nOriginal Traceback" in message:
        last = message.rstrip("\n").rsplit("\n", 1)[-1]
        if last.startswith(traceback_prefix):
            return last[len(traceback_prefix) :]
    return " ".join(message.split())


# --- the tree ----------------------------------------------------------------------------------


def find_split(root: str | os.PathLike, split: str) -> Path | None:
    """`root/split` if it is a directory; else `root` itself if it holds neither train/ nor val/
    (it is then taken to be the split directory); else None (no such directory, or a tree of
    splits without this one). So a tree whose classes include one named train or val is read
    as a tree of splits."""
    root = Path(root)
    if (root / split).is_dir():
        return root / split
    if root.is_dir() and not any((root / name).is_dir() for name in SPLITS):
        return root
    return None


def _visible(name: str) -> bool:
    return not name.startswith(".")


def _is_image(name: str) -> bool:
    return name.lower().endswith(IMAGE_EXTENSIONS)


def _scan(split_dir: Path) -> tuple[list[str], np.ndarray, np.ndarray]:
    """(classes, relative paths as a byte-string array, labels) of a split directory."""
    try:
        classes = sorted(e.name for e in os.scandir(split_dir) if e.is_dir() and _visible(e.name))
    except OSError as e:
        raise ImageDataError(f"{split_dir}: cannot list the directory ({e.strerror or e})") from e
    if not classes:
        raise ImageDataError(
            f"{split_dir}: no class subdirectories (expected {split_dir}/<class>/<image>; "
            "a flat validation directory needs sorting into class directories)"
        )
    paths: list[bytes] = []
    labels: list[int] = []
    for label, name in enumerate(classes):
        found = _class_images(split_dir, name)
        if not found:
            expected = ", ".join(IMAGE_EXTENSIONS)
            raise ImageDataError(f"{split_dir / name}: class directory with no images (expected files ending {expected})")
        paths += found
        labels += [label] * len(found)
    return classes, np.array(paths, dtype=np.bytes_), np.array(labels, dtype=np.int64)


def _class_images(split_dir: Path, name: str) -> list[bytes]:
    # torchvision's order: directories in sorted order, files sorted within each.
    found = []
    for directory, subdirs, files in sorted(os.walk(split_dir / name, followlinks=True)):
        subdirs[:] = [d for d in subdirs if _visible(d)]
        relative = os.path.relpath(directory, split_dir)
        found += [os.fsencode(os.path.join(relative, f)) for f in sorted(files) if _visible(f) and _is_image(f)]
    return found


def decode(path: str | os.PathLike) -> Image.Image:
    """The image at `path` as RGB, or an ImageDataError naming the file and Pillow's reason."""
    try:
        with Image.open(path) as image:
            return image.convert("RGB")  # also forces the decode, so a truncated file fails here
    except MemoryError:
        raise
    except UnidentifiedImageError as e:  # its text repeats the path
        raise ImageDataError(f"{path}: cannot decode image (not in a format Pillow recognizes)") from e
    except Exception as e:  # Pillow raises OSError, SyntaxError, ValueError, ... depending on the format
        raise ImageDataError(f"{path}: cannot decode image ({type(e).__name__}: {e})") from e


# --- randomness --------------------------------------------------------------------------------


def sample_rng(seed: int, epoch: int, index: int) -> random.Random:
    """The generator for one sample's augmentation: a function of (seed, epoch, index) only."""
    digest = hashlib.blake2b(f"{seed}:{epoch}:{index}".encode(), digest_size=8).digest()
    return random.Random(int.from_bytes(digest, "little"))


def _epoch_and_index(key: Any, length: int) -> tuple[int, int]:
    if isinstance(key, (tuple, list)):
        if len(key) != 2:
            raise TypeError(f"expected an index or an (epoch, index) pair, got {key!r}")
        epoch, index = operator.index(key[0]), operator.index(key[1])
    else:
        epoch, index = 0, operator.index(key)
    if not -length <= index < length:
        raise IndexError(f"index {index} out of range for {length} samples")
    return epoch, index % length  # a negative index draws the same augmentation as its positive twin


# --- transforms --------------------------------------------------------------------------------


def random_resized_crop_box(
    width: int, height: int, rng: random.Random, scale: tuple[float, float] = CROP_SCALE, ratio: tuple[float, float] = CROP_RATIO
) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop.get_params: (top, left, height, width) of a box inside the image."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(CROP_ATTEMPTS):
        target_area = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        w = round(math.sqrt(target_area * aspect))
        h = round(math.sqrt(target_area / aspect))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, height - h), rng.randint(0, width - w), h, w
    # No attempt fit (a very long or tall image): the central box of the nearest allowed ratio.
    image_ratio = width / height
    if image_ratio < min(ratio):
        w, h = width, round(width / min(ratio))
    elif image_ratio > max(ratio):
        w, h = round(height * max(ratio)), height
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def to_normalized_tensor(image: Image.Image) -> torch.Tensor:
    """RGB image -> float32 [3, H, W]: scaled to [0, 1], then normalized with the ImageNet mean and std."""
    # The same operations in the same order as torchvision's ToTensor + Normalize, so the same bits.
    pixels = torch.from_numpy(np.array(image, dtype=np.uint8)).permute(2, 0, 1).contiguous()
    return pixels.float().div_(255).sub_(_MEAN).div_(_STD)


def train_transform(image: Image.Image, size: int, rng: random.Random) -> torch.Tensor:
    """RandomResizedCrop(size) and a random horizontal flip, drawn from `rng`; then normalized."""
    top, left, h, w = random_resized_crop_box(image.width, image.height, rng)
    image = image.crop((left, top, left + w, top + h)).resize((size, size), Image.Resampling.BILINEAR)
    if rng.random() < FLIP_PROBABILITY:
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return to_normalized_tensor(image)


def eval_resize_size(size: int) -> int:
    """The short side evaluation resizes to before its central crop: 256 for 224, 73 for 64."""
    return round(size * EVAL_RESIZE_RATIO)


def eval_transform(image: Image.Image, size: int) -> torch.Tensor:
    """The short side resized to eval_resize_size(size), the central size x size crop, normalized."""
    short = eval_resize_size(size)
    w, h = image.size
    # torchvision's Resize(int): the long side scaled in proportion, truncated.
    new_w, new_h = (short, int(short * h / w)) if w <= h else (int(short * w / h), short)
    image = image.resize((new_w, new_h), Image.Resampling.BILINEAR)
    top, left = int(round((new_h - size) / 2.0)), int(round((new_w - size) / 2.0))
    return to_normalized_tensor(image.crop((left, top, left + size, top + size)))


def _check_size(name: str, value: int, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int of at least {minimum}, got {value!r}")
    return value


# --- the datasets ------------------------------------------------------------------------------


class ImageFolder(Dataset):
    """root/<class>/<image> (or root/{train,val}/<class>/<image>), decoded and transformed per sample.

    dataset[i] or dataset[(epoch, i)] is (float32 [3, S, S], int label); see the module docstring.
    """

    wants_epoch = True  # __getitem__ takes (epoch, index): the harness wraps its sampler in EpochIndices

    def __init__(self, root: str | os.PathLike, image_size: int = 224, train: bool = True, seed: int = 0):
        self.image_size = _check_size("image_size", image_size)
        self.train = train
        self.seed = seed
        split = "train" if train else "val"
        split_dir = find_split(root, split)
        if split_dir is None:
            root = Path(root)
            if not root.is_dir():
                what = "not a directory" if root.exists() else "no such directory"
                raise ImageDataError(f"{root}: {what} (expected an image tree: <class>/<image>, or train/ and val/ of them)")
            raise ImageDataError(f"{root}: no {split}/ directory (expected {root}/{split}/<class>/<image> beside the other split)")
        self.root = split_dir
        self.classes, self._paths, labels = _scan(split_dir)
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}
        self.labels = torch.from_numpy(labels)

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def __len__(self) -> int:
        return len(self._paths)

    def path(self, index: int) -> Path:
        return self.root / os.fsdecode(self._paths[index])

    def __getitem__(self, key: Key) -> tuple[torch.Tensor, int]:
        epoch, index = _epoch_and_index(key, len(self))
        image = decode(self.path(index))
        if self.train:
            tensor = train_transform(image, self.image_size, sample_rng(self.seed, epoch, index))
        else:
            tensor = eval_transform(image, self.image_size)
        return tensor, int(self.labels[index])


SYNTHETIC_CHUNK = 256  # samples generated per step: bounds the float scratch memory, fixes the draw order
SYNTHETIC_PATTERN = 4  # side of the coarse grid each class's pattern is upsampled from
SYNTHETIC_SIGNAL = 48.0  # grey levels per unit of pattern ...
SYNTHETIC_NOISE = 40.0  # ... and of noise, around mid-grey 128


class SyntheticImageNet(Dataset):
    """`samples` learnable ImageNet-shaped images in memory (uint8, samples * 3 * S * S bytes).

    dataset[i] or dataset[(epoch, i)] is (float32 [3, S, S], int label); see the module docstring.
    """

    wants_epoch = True

    def __init__(self, samples: int, image_size: int = 224, num_classes: int = 1000, seed: int = 0, train: bool = True):
        self.image_size = _check_size("image_size", image_size)
        self.num_classes = _check_size("num_classes", num_classes)
        _check_size("samples", samples)
        self.seed = seed
        self.train = train
        self.classes = [f"class{c:04d}" for c in range(num_classes)]
        self.labels, self.images = _synthetic(samples, image_size, num_classes, seed, "train" if train else "val")

    @property
    def nbytes(self) -> int:
        return self.images.numel()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, key: Key) -> tuple[torch.Tensor, int]:
        epoch, index = _epoch_and_index(key, len(self))
        pixels = self.images[index]
        if self.train and sample_rng(self.seed, epoch, index).random() < FLIP_PROBABILITY:
            pixels = pixels.flip(-1)
        return pixels.float().div_(255).sub_(_MEAN).div_(_STD), int(self.labels[index])


def _synthetic(samples: int, size: int, num_classes: int, seed: int, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(labels int64 [N], images uint8 [N, 3, S, S]), all drawn from generators seeded from `seed`.

    The class patterns depend on the seed only, the labels and the noise on the split too: the
    training and the evaluation set of one seed are different samples of the same classes.
    """
    patterns = torch.randn(num_classes, 3, SYNTHETIC_PATTERN, SYNTHETIC_PATTERN, generator=_generator(seed, "patterns"))
    # Balanced: every class samples // num_classes times, the first samples % num_classes once more, shuffled.
    labels = (torch.arange(samples) % num_classes)[torch.randperm(samples, generator=_generator(seed, split, "labels"))]
    images = torch.empty(samples, 3, size, size, dtype=torch.uint8)
    for start in range(0, samples, SYNTHETIC_CHUNK):
        chunk_labels = labels[start : start + SYNTHETIC_CHUNK]
        signal = torch.nn.functional.interpolate(patterns[chunk_labels], size=(size, size), mode="bilinear", align_corners=False)
        # Each chunk from its own generator: the set does not depend on how torch batches its draws.
        noise = torch.randn(signal.shape, generator=_generator(seed, split, start))
        pixels = signal.mul_(SYNTHETIC_SIGNAL).add_(noise, alpha=SYNTHETIC_NOISE).add_(128.0).round_().clamp_(0, 255)
        images[start : start + len(chunk_labels)] = pixels.to(torch.uint8)
    return labels, images


def _generator(*key: object) -> torch.Generator:
    digest = hashlib.blake2b(":".join(map(str, ("synthetic", *key))).encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)  # manual_seed takes 63 bits safely
