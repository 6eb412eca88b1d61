import os
import random

import pytest

np = pytest.importorskip("numpy")
torch = pytest.importorskip("torch")
Image = pytest.importorskip("PIL.Image")

from torch.utils.data import DataLoader  # noqa: E402

from fixtures.jpeg_tree import make_jpeg_tree  # noqa: E402
from trainpod.errors import EXIT_CONFIG, ConfigError  # noqa: E402
from trainpod.examples.imagenet_data import (  # noqa: E402
    IMAGENET_MEAN,
    IMAGENET_STD,
    ImageDataError,
    ImageFolder,
    SyntheticImageNet,
    eval_resize_size,
    eval_transform,
    find_split,
    random_resized_crop_box,
    sample_rng,
    to_normalized_tensor,
    train_transform,
)
from trainpod.train.samplers import EpochIndices, ResumableDistributedSampler  # noqa: E402

MEAN = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
STD = torch.tensor(IMAGENET_STD).view(3, 1, 1)
LOWEST = (0 - MEAN) / STD  # what pixel 0 and pixel 255 normalize to, per channel
HIGHEST = (1 - MEAN) / STD
CLASSES = ("n02", "n01", "n03")  # written out of order: the labels follow the sorted names


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """root/train and root/val, 3 classes, real 96x80 JPEGs."""
    root = tmp_path_factory.mktemp("imagenet")
    make_jpeg_tree(root / "train", CLASSES, per_class=4, size=(96, 80), seed=0)
    make_jpeg_tree(root / "val", CLASSES, per_class=2, size=(80, 96), seed=1)
    return root


def assert_normalized_image(x, size):
    assert x.shape == (3, size, size) and x.dtype == torch.float32 and x.is_contiguous()
    assert (x >= LOWEST - 1e-5).all() and (x <= HIGHEST + 1e-5).all()


def one_line_naming(error, path):
    message = str(error.value)
    assert isinstance(error.value, ConfigError) and error.value.exit_code == EXIT_CONFIG == 78
    assert "\n" not in message, message
    assert str(path) in message, message
    return message


# --- the tree ----------------------------------------------------------------------------------


def test_decodes_real_jpegs_through_both_transforms(tree):
    train = ImageFolder(tree, image_size=64, train=True, seed=0)
    val = ImageFolder(tree, image_size=48, train=False)
    assert train.root == tree / "train" and val.root == tree / "val"
    assert len(train) == 12 and len(val) == 6
    for dataset, size in ((train, 64), (val, 48)):
        for i in range(len(dataset)):
            x, label = dataset[i]
            assert_normalized_image(x, size)
            assert isinstance(label, int)
    # Real content, not a constant: the images span a range of values in every channel.
    x, _ = train[0]
    assert (x.flatten(1).std(dim=1) > 0.05).all()


def test_classes_and_labels_come_from_directory_names(tree):
    dataset = ImageFolder(tree, image_size=32)
    assert dataset.classes == ["n01", "n02", "n03"] and dataset.num_classes == 3
    assert dataset.class_to_idx == {"n01": 0, "n02": 1, "n03": 2}
    assert dataset.labels.dtype == torch.int64 and dataset.labels.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    for i in range(len(dataset)):
        assert dataset.path(i).parent.name == dataset.classes[dataset[i][1]]
    # Files in sorted order within a class.
    assert [dataset.path(i).name for i in range(4)] == [f"n01_{i:04d}.JPEG" for i in range(4)]


def test_root_may_be_the_split_directory_itself(tree):
    direct = ImageFolder(tree / "val", image_size=32, train=True)
    assert direct.root == tree / "val" and len(direct) == 6


def test_find_split(tree, tmp_path):
    assert find_split(tree, "train") == tree / "train"
    assert find_split(tree, "val") == tree / "val"
    assert find_split(tree / "train", "val") == tree / "train"  # a split directory stands for any split
    assert find_split(tmp_path / "missing", "train") is None
    (tmp_path / "only" / "train").mkdir(parents=True)
    assert find_split(tmp_path / "only", "val") is None


def test_what_counts_as_an_image(tmp_path):
    make_jpeg_tree(tmp_path, ["a"], per_class=1, size=40)
    image = Image.open(tmp_path / "a" / "a_0000.JPEG").convert("RGB")
    for name in ("b.png", "c.Jpg", "d.webp", "e.BMP", "f.tif"):
        image.save(tmp_path / "a" / name)
    (tmp_path / "a" / "notes.txt").write_text("not an image")
    (tmp_path / "a" / "._a_0000.JPEG").write_bytes(b"macOS resource fork")  # hidden: ignored
    (tmp_path / "a" / "nested").mkdir()
    image.save(tmp_path / "a" / "nested" / "g.jpeg")
    (tmp_path / "a" / "link.jpg").symlink_to(tmp_path / "a" / "a_0000.JPEG")
    (tmp_path / ".ipynb_checkpoints").mkdir()  # a hidden directory is not a class
    dataset = ImageFolder(tmp_path, image_size=16)
    assert dataset.classes == ["a"]
    names = sorted(os.path.relpath(dataset.path(i), tmp_path / "a") for i in range(len(dataset)))
    assert names == sorted(["a_0000.JPEG", "b.png", "c.Jpg", "d.webp", "e.BMP", "f.tif", "link.jpg", os.path.join("nested", "g.jpeg")])
    for i in range(len(dataset)):
        assert_normalized_image(dataset[i][0], 16)


def test_grayscale_and_palette_images_become_rgb(tmp_path):
    (tmp_path / "a").mkdir()
    Image.new("L", (40, 30), 200).save(tmp_path / "a" / "gray.png")
    Image.new("P", (40, 30), 3).save(tmp_path / "a" / "palette.bmp")
    dataset = ImageFolder(tmp_path, image_size=16, train=False)
    for i in range(2):
        assert_normalized_image(dataset[i][0], 16)


# --- errors: one line, exit 78, the path named -------------------------------------------------


def test_missing_root(tmp_path):
    with pytest.raises(ImageDataError) as error:
        ImageFolder(tmp_path / "nowhere", image_size=32)
    assert "no such directory" in one_line_naming(error, tmp_path / "nowhere")


def test_root_is_a_file(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ImageDataError) as error:
        ImageFolder(tmp_path / "file", image_size=32)
    assert "not a directory" in one_line_naming(error, tmp_path / "file")


def test_no_class_directories(tmp_path):
    (tmp_path / "stray.JPEG").write_bytes(b"")
    with pytest.raises(ImageDataError) as error:
        ImageFolder(tmp_path, image_size=32)
    assert "no class subdirectories" in one_line_naming(error, tmp_path)


def test_missing_split(tree, tmp_path):
    make_jpeg_tree(tmp_path / "train", ["a"], per_class=1, size=32)
    with pytest.raises(ImageDataError) as error:
        ImageFolder(tmp_path, image_size=32, train=False)
    assert "no val/ directory" in one_line_naming(error, tmp_path)


def test_class_without_images(tmp_path):
    make_jpeg_tree(tmp_path, ["a", "c"], per_class=1, size=32)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "README.txt").write_text("nothing here")
    with pytest.raises(ImageDataError) as error:
        ImageFolder(tmp_path, image_size=32)
    assert "class directory with no images" in one_line_naming(error, tmp_path / "b")


def undecodable_tree(root):
    make_jpeg_tree(root, ["a"], per_class=2, size=64)
    garbage = root / "a" / "garbage.jpg"
    garbage.write_bytes(b"this is not a JPEG\n" * 10)
    good = (root / "a" / "a_0000.JPEG").read_bytes()
    truncated = root / "a" / "truncated.jpg"
    truncated.write_bytes(good[: len(good) // 2])
    (root / "a" / "dangling.jpg").symlink_to(root / "a" / "deleted.jpg")
    return ImageFolder(root, image_size=32)


@pytest.mark.parametrize("name", ["garbage.jpg", "truncated.jpg", "dangling.jpg"])
def test_undecodable_image(tmp_path, name):
    dataset = undecodable_tree(tmp_path)
    index = next(i for i in range(len(dataset)) if dataset.path(i).name == name)
    with pytest.raises(ImageDataError) as error:
        dataset[index]
    assert "cannot decode image" in one_line_naming(error, tmp_path / "a" / name)


def test_undecodable_image_in_a_worker_is_still_one_line(tmp_path):
    # torch re-raises a worker's exception with the worker's traceback as its message.
    dataset = undecodable_tree(tmp_path)
    loader = DataLoader(dataset, batch_size=len(dataset), num_workers=2)
    with pytest.raises(ImageDataError) as error:
        next(iter(loader))
    message = one_line_naming(error, tmp_path / "a")
    assert message.startswith(str(tmp_path / "a")) and "cannot decode image" in message


def test_image_data_error_keeps_ordinary_messages():
    assert str(ImageDataError("/x: bad")) == "/x: bad"
    assert str(ImageDataError("/x: bad\nreally")) == "/x: bad really"


# --- determinism -------------------------------------------------------------------------------


def test_same_epoch_and_index_same_tensor_in_a_fresh_dataset(tree):
    a = ImageFolder(tree, image_size=32, seed=7)
    b = ImageFolder(tree, image_size=32, seed=7)
    for key in [(0, 0), (3, 5), (3, 11)]:
        assert torch.equal(a[key][0], b[key][0])
    assert torch.equal(a[4][0], a[(0, 4)][0])
    assert torch.equal(a[-1][0], a[(0, len(a) - 1)][0])


def test_global_rng_state_does_not_matter(tree):
    dataset = ImageFolder(tree, image_size=32, seed=7)
    torch.manual_seed(1)
    random.seed(1)
    np.random.seed(1)
    first = dataset[(2, 3)][0]
    torch.manual_seed(2)
    random.seed(2)
    np.random.seed(2)
    assert torch.equal(dataset[(2, 3)][0], first)


def test_seed_and_epoch_change_the_augmentation(tree):
    dataset = ImageFolder(tree, image_size=32, seed=0)
    other_seed = ImageFolder(tree, image_size=32, seed=1)
    for i in range(len(dataset)):
        assert not torch.equal(dataset[(0, i)][0], dataset[(1, i)][0])
        assert not torch.equal(dataset[(0, i)][0], other_seed[(0, i)][0])


def test_evaluation_is_the_same_in_every_epoch(tree):
    val = ImageFolder(tree, image_size=32, train=False, seed=0)
    assert torch.equal(val[(0, 1)][0], val[(9, 1)][0])


def load_epoch(dataset, epoch, workers):
    sampler = ResumableDistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=3)
    indices = EpochIndices(sampler)
    indices.set_epoch(epoch)
    loader = DataLoader(dataset, batch_size=5, sampler=indices, num_workers=workers)
    images, labels = zip(*loader)
    return torch.cat(images), torch.cat(labels), list(indices)


def test_dataloader_workers_do_not_change_the_batches(tree):
    dataset = ImageFolder(tree, image_size=24, seed=5)
    images0, labels0, keys = load_epoch(dataset, epoch=3, workers=0)
    images2, labels2, _ = load_epoch(ImageFolder(tree, image_size=24, seed=5), epoch=3, workers=2)
    assert torch.equal(images0, images2) and torch.equal(labels0, labels2)
    assert all(epoch == 3 for epoch, _ in keys)
    assert torch.equal(images0, torch.stack([dataset[key][0] for key in keys]))
    other_epoch, _, _ = load_epoch(dataset, epoch=4, workers=2)
    assert not torch.equal(images0, other_epoch)


def test_persistent_workers_follow_the_epoch(tree):
    # The reason for EpochIndices: the epoch reaches persistent workers with every index.
    dataset = ImageFolder(tree, image_size=24, seed=5)
    sampler = EpochIndices(ResumableDistributedSampler(dataset, num_replicas=1, rank=0, shuffle=False))
    loader = DataLoader(dataset, batch_size=len(dataset), sampler=sampler, num_workers=2, persistent_workers=True)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        (images, _), = list(loader)
        assert torch.equal(images, torch.stack([dataset[(epoch, i)][0] for i in range(len(dataset))]))


def test_sample_rng_depends_on_seed_epoch_and_index_only():
    draws = {(s, e, i): sample_rng(s, e, i).random() for s in range(3) for e in range(3) for i in range(3)}
    assert len(set(draws.values())) == len(draws)
    assert sample_rng(1, 2, 0).random() == draws[(1, 2, 0)]


# --- transforms --------------------------------------------------------------------------------


@pytest.mark.parametrize("width,height", [(300, 50), (50, 300), (256, 256), (500, 375), (33, 17), (1, 1)])
def test_random_resized_crop_box_stays_inside(width, height):
    for k in range(500):
        top, left, h, w = random_resized_crop_box(width, height, random.Random(k))
        assert 0 < h <= height and 0 < w <= width
        assert 0 <= top <= height - h and 0 <= left <= width - w


def test_random_resized_crop_box_follows_scale_and_ratio():
    areas, ratios = [], []
    for k in range(2000):
        top, left, h, w = random_resized_crop_box(256, 256, random.Random(k))
        areas.append(h * w / 256**2)
        ratios.append(w / h)
    # Rounding to whole pixels moves the bounds a little.
    assert min(areas) >= 0.07 and max(areas) <= 1.0
    assert min(ratios) >= 0.7 and max(ratios) <= 1.4
    # Under the mean of uniform [0.08, 1] (0.54): a large box at a skewed ratio does not fit and is redrawn.
    assert 0.42 < np.mean(areas) < 0.52


def test_random_resized_crop_box_falls_back_to_the_centre():
    # 1000 x 7: no box of at least 8% of the area fits at a ratio of 4/3 or less, so every attempt
    # fails and the fallback takes the central 9 x 7 box (the widest allowed ratio).
    assert random_resized_crop_box(1000, 7, random.Random(0)) == (0, 495, 7, 9)
    assert random_resized_crop_box(7, 1000, random.Random(0)) == (495, 0, 9, 7)


@pytest.mark.parametrize("width,height", [(300, 50), (50, 300), (17, 23)])
def test_train_transform_gives_the_requested_size_for_odd_shapes(width, height):
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8))
    for k in range(20):
        assert_normalized_image(train_transform(image, 64, random.Random(k)), 64)


def test_train_transform_is_crop_resize_and_flip():
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (60, 90, 3), dtype=np.uint8))
    flips = 0
    for k in range(40):
        rng = random.Random(k)
        top, left, h, w = random_resized_crop_box(90, 60, rng)
        flip = rng.random() < 0.5
        expected = image.crop((left, top, left + w, top + h)).resize((32, 32), Image.Resampling.BILINEAR)
        if flip:
            expected = expected.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        assert torch.equal(train_transform(image, 32, random.Random(k)), to_normalized_tensor(expected))
        flips += flip
    assert 10 <= flips <= 30


def test_eval_resize_size():
    assert eval_resize_size(224) == 256
    assert eval_resize_size(64) == 73
    assert eval_resize_size(32) == 37


@pytest.mark.parametrize("width,height", [(300, 50), (50, 300), (256, 256), (500, 375)])
def test_eval_transform_resizes_the_short_side_and_crops_the_centre(width, height):
    # A horizontal ramp: the crop's central column is the image's central column, whatever the width.
    ramp = np.broadcast_to(np.linspace(0, 255, width).round().astype(np.uint8)[None, :, None], (height, width, 3))
    x = eval_transform(Image.fromarray(np.ascontiguousarray(ramp)), 64)
    assert_normalized_image(x, 64)
    red = x[0] * STD[0] + MEAN[0]
    assert red[:, 32].mean().item() == pytest.approx(0.5, abs=0.03)
    assert (red[:, 1:] >= red[:, :-1] - 1e-6).all()  # still a rising ramp: not flipped


def test_normalization_values():
    pixels = np.zeros((2, 2, 3), dtype=np.uint8)
    pixels[0, 0] = (255, 255, 255)
    pixels[1, 1] = (51, 102, 153)
    x = to_normalized_tensor(Image.fromarray(pixels))
    assert torch.allclose(x[:, 0, 0], HIGHEST.flatten())
    assert torch.allclose(x[:, 0, 1], LOWEST.flatten())
    assert torch.allclose(x[:, 1, 1], (torch.tensor([0.2, 0.4, 0.6]) - MEAN.flatten()) / STD.flatten())


def test_transforms_match_torchvision():
    transforms = pytest.importorskip("torchvision.transforms")
    functional = pytest.importorskip("torchvision.transforms.functional")
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (333, 500, 3), dtype=np.uint8))
    normalize = transforms.Compose([transforms.ToTensor(), transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
    theirs = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224), normalize])
    assert torch.equal(eval_transform(image, 224), theirs(image))
    rng = random.Random(3)
    top, left, h, w = random_resized_crop_box(500, 333, rng)
    crop = functional.resized_crop(image, top, left, h, w, [224, 224], transforms.InterpolationMode.BILINEAR)
    if rng.random() < 0.5:
        crop = functional.hflip(crop)
    assert torch.equal(train_transform(image, 224, random.Random(3)), normalize(crop))


# --- the synthetic set -------------------------------------------------------------------------


def test_synthetic_shapes_and_memory():
    dataset = SyntheticImageNet(100, image_size=32, num_classes=10, seed=0)
    assert len(dataset) == 100 and dataset.num_classes == 10 and len(dataset.classes) == 10
    assert dataset.images.dtype == torch.uint8 and dataset.images.shape == (100, 3, 32, 32)
    assert dataset.nbytes == 100 * 3 * 32 * 32
    x, label = dataset[0]
    assert_normalized_image(x, 32)
    assert isinstance(label, int) and 0 <= label < 10


def test_synthetic_is_balanced():
    labels = SyntheticImageNet(1003, image_size=8, num_classes=10, seed=0).labels
    counts = torch.bincount(labels, minlength=10)
    assert counts.sum() == 1003 and counts.max() - counts.min() <= 1
    assert labels[:10].tolist() != list(range(10))  # shuffled, not cycling through the classes


def test_synthetic_is_deterministic():
    a = SyntheticImageNet(300, image_size=16, num_classes=7, seed=3)
    b = SyntheticImageNet(300, image_size=16, num_classes=7, seed=3)
    assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)
    assert torch.equal(a[(2, 5)][0], b[(2, 5)][0])
    c = SyntheticImageNet(300, image_size=16, num_classes=7, seed=4)
    assert not torch.equal(a.images, c.images)


def test_synthetic_leaves_global_rng_alone():
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    SyntheticImageNet(50, image_size=16, num_classes=5, seed=0)[(1, 3)]
    assert torch.equal(torch.rand(3), expected)


def test_synthetic_flip_is_determined_by_seed_epoch_and_index():
    train = SyntheticImageNet(64, image_size=16, num_classes=4, seed=0, train=True)
    val = SyntheticImageNet(64, image_size=16, num_classes=4, seed=0, train=False)
    flips = 0
    for i in range(64):
        assert torch.equal(val[(5, i)][0], val[i][0])  # evaluation: no augmentation
        plain = (train.images[i].float() / 255 - MEAN) / STD
        flipped = sample_rng(0, 2, i).random() < 0.5
        assert torch.equal(train[(2, i)][0], plain.flip(-1) if flipped else plain)
        flips += flipped
    assert 16 <= flips <= 48


def test_synthetic_evaluation_set_is_other_samples_of_the_same_classes():
    train = SyntheticImageNet(400, image_size=16, num_classes=4, seed=0, train=True)
    val = SyntheticImageNet(400, image_size=16, num_classes=4, seed=0, train=False)
    assert not torch.equal(train.images[:10], val.images[:10])
    means_train = torch.stack([train.images[train.labels == c].float().mean(0) for c in range(4)]).flatten(1)
    means_val = torch.stack([val.images[val.labels == c].float().mean(0) for c in range(4)]).flatten(1)
    assert torch.equal(torch.cdist(means_val, means_train).argmin(dim=1), torch.arange(4))


def test_synthetic_is_learnable():
    torch.manual_seed(0)
    train = SyntheticImageNet(512, image_size=32, num_classes=10, seed=0)
    held_out = SyntheticImageNet(256, image_size=32, num_classes=10, seed=0, train=False)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, stride=2, padding=1),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(4),
        torch.nn.Flatten(),
        torch.nn.Linear(16 * 16, 10),
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    x_val, y_val = next(iter(DataLoader(held_out, batch_size=256)))

    def held_out_loss():
        with torch.no_grad():
            return torch.nn.functional.cross_entropy(model(x_val), y_val).item()

    before = held_out_loss()
    for epoch in range(2):
        sampler = EpochIndices(ResumableDistributedSampler(train, num_replicas=1, rank=0, seed=0))
        sampler.set_epoch(epoch)
        for x, y in DataLoader(train, batch_size=64, sampler=sampler):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    assert held_out_loss() < 0.5 * before
