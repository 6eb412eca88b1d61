"""CIFAR-10 without torchvision: the python-format batches when present, else synthetic data.

The real data is the "CIFAR-10 python version" (cifar-10-python.tar.gz unpacked): pickled dicts
with b'data' (uint8, [N, 3072], channel-major: 1024 red, 1024 green, 1024 blue) and b'labels'.
The synthetic set has the same shape, dtype and normalization, needs no files and is learnable,
so the example runs (and shows a falling loss) anywhere.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

NUM_CLASSES = 10
IMAGE_SHAPE = (3, 32, 32)
TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_FILE = "test_batch"
SUBDIR = "cifar-10-batches-py"  # what the official archive unpacks to

# Per-channel mean and std of the CIFAR-10 training images (pixel values scaled to [0, 1]).
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)


class CifarFormatError(ValueError):
    """A batch file exists but is not in the CIFAR-10 python format."""


def find_batches_dir(data_dir: str | os.PathLike | None) -> Path | None:
    """The directory holding all six batch files: `data_dir/cifar-10-batches-py` or `data_dir`."""
    if not data_dir:
        return None
    root = Path(data_dir)
    for candidate in (root / SUBDIR, root):
        if all((candidate / name).is_file() for name in (*TRAIN_FILES, TEST_FILE)):
            return candidate
    return None


class _ArraysOnly(pickle.Unpickler):
    # Pickle runs arbitrary code on load, and data directories are often shared volumes:
    # allow only what the batches need (numpy arrays), so a planted file cannot execute anything.
    _ALLOWED = {
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy.core.multiarray", "_reconstruct"),  # arrays pickled by numpy 1.x (the official files)
        ("numpy._core.multiarray", "_reconstruct"),  # ... and by numpy 2.x
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
        ("numpy.core.numeric", "_frombuffer"),  # pickle protocol 5
        ("numpy._core.numeric", "_frombuffer"),
        ("_codecs", "encode"),  # how Python 3 writes bytes at protocol 2; it only builds bytes
    }

    def find_class(self, module: str, name: str):
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}")
        return super().find_class(module, name)


def read_batch(path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray]:
    """One batch file as (uint8 images [N, 3, 32, 32], int64 labels [N])."""
    try:
        with open(path, "rb") as f:
            # encoding='bytes': the official files were pickled by Python 2, so their str keys are bytes.
            batch = _ArraysOnly(f, encoding="bytes").load()
        data = np.asarray(batch[b"data"], dtype=np.uint8)
        labels = np.asarray(batch[b"labels"], dtype=np.int64)
    except (OSError, EOFError, pickle.UnpicklingError, KeyError, TypeError, ValueError) as e:
        raise CifarFormatError(f"{path}: not a CIFAR-10 python batch ({e})") from e
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or len(labels) != len(data):
        raise CifarFormatError(f"{path}: expected data [N, 3072] and N labels, got {data.shape} and {len(labels)}")
    if len(labels) and (labels.min() < 0 or labels.max() >= NUM_CLASSES):
        raise CifarFormatError(f"{path}: labels outside 0..{NUM_CLASSES - 1}")
    return data.reshape(-1, *IMAGE_SHAPE), labels


class NormalizedImages(Dataset):
    """uint8 images normalized on access.

    Kept as uint8 because the float copy of the training set is 600 MB, once per rank.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor):
        self.images = images
        self.labels = labels
        self._mean = torch.tensor(CIFAR_MEAN).view(3, 1, 1)
        self._std = torch.tensor(CIFAR_STD).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = self.images[i].float().div_(255.0)
        return (image - self._mean) / self._std, self.labels[i]


def load_cifar10(batches_dir: str | os.PathLike) -> tuple[NormalizedImages, NormalizedImages]:
    """(train, test) from a directory holding data_batch_1..5 and test_batch."""
    batches_dir = Path(batches_dir)

    def load(names):
        parts = [read_batch(batches_dir / name) for name in names]
        images = torch.from_numpy(np.concatenate([p[0] for p in parts]))
        labels = torch.from_numpy(np.concatenate([p[1] for p in parts]))
        return NormalizedImages(images, labels)

    return load(TRAIN_FILES), load([TEST_FILE])


class SyntheticImages(Dataset):
    """A class's prototype plus noise, the noise made when a sample is read: from a generator seeded with the
    sample's own seed (`first_seed` + its index), so a sample is the same whatever reads it, in any order, in
    any process, and the set costs no time or memory to make. A rank's start (and a replacement's, in-process
    recovery: docs/recovery.md) would otherwise spend most of its time, growing with the set, drawing noise for
    samples that other ranks train on; here each rank draws only its own, one batch at a time."""

    def __init__(self, prototypes: torch.Tensor, labels: torch.Tensor, first_seed: int):
        self.prototypes = prototypes
        self.labels = labels
        self.first_seed = first_seed
        self._generator = torch.Generator()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        index = range(len(self.labels))[i]  # a negative index as a tensor's; past the end, IndexError
        label = self.labels[index]
        noise = torch.randn(IMAGE_SHAPE, generator=self._generator.manual_seed(self.first_seed + index))
        # Signal and noise of equal strength, scaled to unit variance per pixel like normalized CIFAR.
        return (self.prototypes[label] + noise) / 2**0.5, label

    def __getstate__(self) -> dict:  # a DataLoader worker gets its own generator (a Generator does not pickle)
        return {k: v for k, v in self.__dict__.items() if k != "_generator"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _generator=torch.Generator())


def synthetic_cifar10(train_samples: int = 4096, test_samples: int = 1024, seed: int = 0) -> tuple[SyntheticImages, SyntheticImages]:
    """(train, test): each class is a fixed smooth random image, each sample that image plus noise.

    Everything comes from `seed`, so every rank (and every run) reads identical samples without sharing files.
    Prototypes are drawn at 4x4 and upsampled so that they are spatial patterns a small CNN picks up within an
    epoch; the noise keeps it from being trivial. The labels are drawn here, the noise when read (SyntheticImages).
    """
    g = torch.Generator().manual_seed(seed)
    coarse = torch.randn(NUM_CLASSES, 3, 4, 4, generator=g)
    prototypes = torch.nn.functional.interpolate(coarse, size=IMAGE_SHAPE[1:], mode="bilinear", align_corners=False)
    prototypes = prototypes / prototypes.std()

    def make(n: int) -> SyntheticImages:
        labels = torch.randint(0, NUM_CLASSES, (n,), generator=g)
        first_seed = int(torch.randint(0, 1 << 62, (), generator=g))  # the train and test sets' noise apart
        return SyntheticImages(prototypes, labels, first_seed)

    train = make(train_samples)
    return train, make(test_samples)
