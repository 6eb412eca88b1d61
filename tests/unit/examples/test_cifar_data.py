import io
import pickle
import struct

import pytest

np = pytest.importorskip("numpy")
torch = pytest.importorskip("torch")

from trainpod.examples import cifar_data  # noqa: E402
from trainpod.examples.cifar_data import (  # noqa: E402
    CIFAR_MEAN,
    CIFAR_STD,
    CifarFormatError,
    find_batches_dir,
    load_cifar10,
    read_batch,
    synthetic_cifar10,
)

BATCH_NAMES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]


def write_batch(path, n, seed, protocol=2):
    """A batch in the python format: dict with bytes keys, uint8 [N, 3072], a list of labels."""
    rng = np.random.default_rng(seed)
    batch = {
        b"batch_label": b"fake batch",
        b"labels": [int(x) for x in rng.integers(0, 10, n)],
        b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
        b"filenames": [b"img_%d.png" % i for i in range(n)],
    }
    with open(path, "wb") as f:
        pickle.dump(batch, f, protocol=protocol)
    return batch


class Python2Pickler(pickle._Pickler):
    """Writes bytes as Python 2 str opcodes, as the official files (pickled by Python 2) hold them."""

    dispatch = pickle._Pickler.dispatch.copy()

    def save_str2(self, obj):
        if len(obj) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(obj)]) + obj)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", len(obj)) + obj)
        self.memoize(obj)

    dispatch[bytes] = save_str2


def write_python2_batch(path, n, seed):
    rng = np.random.default_rng(seed)
    batch = {b"labels": [int(x) for x in rng.integers(0, 10, n)], b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8)}
    buffer = io.BytesIO()
    Python2Pickler(buffer, protocol=2).dump(batch)
    # The official files name numpy 1.x's module.
    data = buffer.getvalue().replace(b"cnumpy._core.multiarray\n", b"cnumpy.core.multiarray\n")
    assert b"cnumpy.core.multiarray\n" in data and b"_codecs" not in data
    path.write_bytes(data)
    return batch


def write_all_batches(directory, n=7):
    directory.mkdir(parents=True, exist_ok=True)
    return {name: write_batch(directory / name, n, seed) for seed, name in enumerate(BATCH_NAMES)}


# --- synthetic ---------------------------------------------------------------------------------


def tensors(dataset) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sample of a synthetic set, read one by one as a DataLoader does, stacked."""
    images, labels = zip(*(dataset[i] for i in range(len(dataset))))
    return torch.stack(images), torch.stack(labels)


def test_synthetic_shapes_dtypes_and_labels():
    train, test = synthetic_cifar10(256, 64, seed=0)
    assert len(train) == 256 and len(test) == 64
    images, labels = tensors(train)
    assert images.shape == (256, 3, 32, 32) and images.dtype == torch.float32
    assert labels.shape == (256,) and labels.dtype == torch.int64
    assert int(labels.min()) >= 0 and int(labels.max()) <= 9
    assert len(labels.unique()) == 10
    image, label = train[0]
    assert image.shape == (3, 32, 32) and label.dim() == 0


def test_synthetic_is_normalized_like_cifar():
    images = tensors(synthetic_cifar10(1024, 16, seed=0)[0])[0]
    per_channel = images.transpose(0, 1).reshape(3, -1)
    assert per_channel.mean(dim=1).abs().max() < 0.2
    assert ((per_channel.std(dim=1) - 1).abs() < 0.2).all()


def test_synthetic_same_seed_same_tensors():
    a_train, a_test = synthetic_cifar10(128, 32, seed=3)
    b_train, b_test = synthetic_cifar10(128, 32, seed=3)
    for a, b in zip(tensors(a_train) + tensors(a_test), tensors(b_train) + tensors(b_test)):
        assert torch.equal(a, b)


def test_a_synthetic_sample_is_the_same_in_any_order_and_in_a_copy_of_the_set():
    # Its noise is made when it is read: the order the sampler reads in, and a DataLoader worker's copy of the
    # set (pickled), do not change it; the training and test sets' samples differ.
    train, test = synthetic_cifar10(64, 16, seed=0)
    forward = [train[i][0] for i in range(len(train))]
    backward = [train[i][0] for i in reversed(range(len(train)))][::-1]
    copy = pickle.loads(pickle.dumps(train))
    assert all(torch.equal(a, b) and torch.equal(a, copy[i][0]) for i, (a, b) in enumerate(zip(forward, backward)))
    assert not torch.equal(train[0][0], test[0][0])
    assert torch.equal(train[-1][0], train[len(train) - 1][0])  # indexed as a tensor is
    with pytest.raises(IndexError):
        train[len(train)]


def test_synthetic_different_seeds_differ():
    a = tensors(synthetic_cifar10(128, 32, seed=0)[0])[0]
    b = tensors(synthetic_cifar10(128, 32, seed=1)[0])[0]
    assert not torch.equal(a, b)


def test_synthetic_leaves_global_rng_alone():
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    train, _ = synthetic_cifar10(64, 16, seed=0)
    train[3]  # the noise too
    assert torch.equal(torch.rand(3), expected)


def test_synthetic_test_set_shares_the_classes_of_the_training_set():
    # Learnable means: the class means of train and test images agree (the same prototypes).
    train, test = synthetic_cifar10(2048, 1024, seed=0)
    (xtr, ytr), (xte, yte) = tensors(train), tensors(test)
    means_tr = torch.stack([xtr[ytr == c].mean(0) for c in range(10)]).flatten(1)
    means_te = torch.stack([xte[yte == c].mean(0) for c in range(10)]).flatten(1)
    nearest = torch.cdist(means_te, means_tr).argmin(dim=1)
    assert torch.equal(nearest, torch.arange(10))


# --- the python-format reader ------------------------------------------------------------------


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_read_batch(tmp_path, protocol):
    written = write_batch(tmp_path / "data_batch_1", 5, seed=1, protocol=protocol)
    images, labels = read_batch(tmp_path / "data_batch_1")
    assert images.shape == (5, 3, 32, 32) and images.dtype == np.uint8
    assert labels.tolist() == written[b"labels"]
    # Channel-major rows: the first 1024 values of a row are the red plane.
    assert np.array_equal(images[2, 0].reshape(-1), written[b"data"][2, :1024])
    assert np.array_equal(images[2, 2].reshape(-1), written[b"data"][2, 2048:])


def test_read_batch_pickled_by_python2(tmp_path):
    written = write_python2_batch(tmp_path / "test_batch", 4, seed=2)
    images, labels = read_batch(tmp_path / "test_batch")
    assert labels.tolist() == written[b"labels"]
    assert np.array_equal(images.reshape(4, -1), written[b"data"])


def test_find_batches_dir_in_the_archive_subdirectory(tmp_path):
    write_all_batches(tmp_path / "cifar-10-batches-py")
    assert find_batches_dir(tmp_path) == tmp_path / "cifar-10-batches-py"


def test_find_batches_dir_holding_the_files_directly(tmp_path):
    write_all_batches(tmp_path)
    assert find_batches_dir(tmp_path) == tmp_path
    assert find_batches_dir(str(tmp_path)) == tmp_path


def test_find_batches_dir_none_without_all_files(tmp_path):
    assert find_batches_dir(None) is None
    assert find_batches_dir("") is None
    assert find_batches_dir(tmp_path / "missing") is None
    assert find_batches_dir(tmp_path) is None
    write_all_batches(tmp_path)
    (tmp_path / "test_batch").unlink()
    assert find_batches_dir(tmp_path) is None


@pytest.mark.parametrize("layout", ["cifar-10-batches-py", "."])
def test_load_cifar10_both_layouts(tmp_path, layout):
    written = write_all_batches(tmp_path / layout, n=7)
    train, test = load_cifar10(find_batches_dir(tmp_path))
    assert len(train) == 35 and len(test) == 7

    expected_labels = sum((written[name][b"labels"] for name in BATCH_NAMES[:5]), [])
    assert [int(train[i][1]) for i in range(len(train))] == expected_labels

    # Sample 8 is the second row of data_batch_2; normalized with the CIFAR mean and std.
    image, label = train[8]
    assert image.shape == (3, 32, 32) and image.dtype == torch.float32 and label.dtype == torch.int64
    raw = torch.from_numpy(written["data_batch_2"][b"data"][1].reshape(3, 32, 32)).float() / 255
    mean = torch.tensor(CIFAR_MEAN).view(3, 1, 1)
    std = torch.tensor(CIFAR_STD).view(3, 1, 1)
    assert torch.allclose(image, (raw - mean) / std)

    test_image, test_label = test[6]
    assert int(test_label) == written["test_batch"][b"labels"][6]


def test_reader_refuses_pickles_that_would_run_code(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    with open(tmp_path / "data_batch_1", "wb") as f:
        pickle.dump({b"data": Evil(), b"labels": []}, f)
    with pytest.raises(CifarFormatError, match="refusing"):
        read_batch(tmp_path / "data_batch_1")


@pytest.mark.parametrize(
    "content",
    [
        b"not a pickle",
        pickle.dumps({b"labels": [1]}),  # no b'data'
        pickle.dumps({b"data": np.zeros((2, 100), np.uint8), b"labels": [1, 2]}),  # wrong width
        pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [1]}),  # count mismatch
        pickle.dumps({b"data": np.zeros((1, 3072), np.uint8), b"labels": [10]}),  # label range
    ],
)
def test_reader_rejects_malformed_batches(tmp_path, content):
    (tmp_path / "data_batch_1").write_bytes(content)
    with pytest.raises(CifarFormatError, match="data_batch_1"):
        read_batch(tmp_path / "data_batch_1")


def test_constants_match_the_archive():
    assert cifar_data.SUBDIR == "cifar-10-batches-py"
    assert (*cifar_data.TRAIN_FILES, cifar_data.TEST_FILE) == tuple(BATCH_NAMES)
