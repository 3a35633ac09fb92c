"""Tests for p2ptrain.train.data: synthetic task, IDX files, MNIST folders, sharding."""

from __future__ import annotations

import gzip

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from p2ptrain.train import data, models

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def synthetic() -> data.DatasetSplits:
    return data.make_synthetic()


# --------------------------------------------------------------------------
# Synthetic task
# --------------------------------------------------------------------------


def _equal_splits(a: data.DatasetSplits, b: data.DatasetSplits) -> bool:
    return all(
        torch.equal(ta, tb)
        for sa, sb in ((a.train, b.train), (a.test, b.test))
        for ta, tb in zip(sa.tensors, sb.tensors)
    )


def test_synthetic_is_deterministic_and_ignores_global_rng():
    torch.manual_seed(1)
    a = data.make_synthetic(num_train=600, num_test=100, seed=3)
    torch.manual_seed(2)
    torch.rand(10)
    b = data.make_synthetic(num_train=600, num_test=100, seed=3)
    assert _equal_splits(a, b)
    c = data.make_synthetic(num_train=600, num_test=100, seed=4)
    assert not torch.equal(a.train.tensors[0], c.train.tensors[0])


def test_synthetic_shapes_dtypes_and_standardisation(synthetic):
    x, y = synthetic.train.tensors
    xt, yt = synthetic.test.tensors
    assert x.shape == (12000, 1, 28, 28) and xt.shape == (2000, 1, 28, 28)
    assert x.dtype == xt.dtype == torch.float32
    assert y.dtype == yt.dtype == torch.int64
    assert synthetic.input_shape == (1, 28, 28)
    assert synthetic.num_classes == 10
    assert synthetic.name == "synthetic"
    assert abs(x.mean().item()) < 1e-3 and abs(x.std().item() - 1) < 1e-3
    assert abs(xt.mean().item()) < 0.1 and abs(xt.std().item() - 1) < 0.1
    assert torch.isfinite(x).all() and torch.isfinite(xt).all()

    small = data.make_synthetic(num_train=40, num_test=10, num_classes=4, image_size=20)
    assert small.train.tensors[0].shape == (40, 1, 20, 20)
    assert small.input_shape == (1, 20, 20) and small.num_classes == 4
    assert set(small.train.tensors[1].tolist()) == {0, 1, 2, 3}


def test_synthetic_classes_are_balanced(synthetic):
    for split in (synthetic.train, synthetic.test):
        counts = torch.bincount(split.tensors[1], minlength=10)
        assert counts.min() >= 0.95 * counts.max()


def test_synthetic_train_and_test_are_disjoint(synthetic):
    def rows(split: TensorDataset) -> set[bytes]:
        return {r.tobytes() for r in split.tensors[0].reshape(len(split), -1).numpy()}

    train_rows, test_rows = rows(synthetic.train), rows(synthetic.test)
    assert len(train_rows) == len(synthetic.train)  # no duplicates inside either
    assert len(test_rows) == len(synthetic.test)
    assert not train_rows & test_rows


def _train_and_eval(
    model: torch.nn.Module, train: TensorDataset, test: TensorDataset, steps: int
) -> float:
    """SGD(lr=0.05, momentum=0.9), batch 32, reshuffling every epoch; test accuracy."""
    x, y = train.tensors
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(0)
    step = 0
    while step < steps:
        perm = torch.randperm(len(x), generator=gen)
        for start in range(0, len(x) - 31, 32):
            idx = perm[start : start + 32]
            loss = F.nll_loss(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if step == steps:
                break
    xt, yt = test.tensors
    with torch.no_grad():
        return (model(xt).argmax(1) == yt).float().mean().item()


def test_synthetic_more_data_helps(synthetic):
    """The property decentralized training relies on: more samples -> better model.

    Same number of steps (2 epochs of 12000 samples) on 1500 vs 12000 samples;
    measured 0.730 vs 0.876. A linear model is far behind (0.539), so
    the task is not linearly trivial.
    """
    steps = 750
    small = TensorDataset(*(t[:1500] for t in synthetic.train.tensors))
    torch.manual_seed(0)
    acc_big = _train_and_eval(models.MLP((1, 28, 28), 10), synthetic.train, synthetic.test, steps)
    torch.manual_seed(0)
    acc_small = _train_and_eval(models.MLP((1, 28, 28), 10), small, synthetic.test, steps)
    torch.manual_seed(0)
    linear = torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(784, 10), torch.nn.LogSoftmax(dim=1)
    )
    acc_linear = _train_and_eval(linear, synthetic.train, synthetic.test, steps)

    assert acc_big >= 0.80, acc_big
    assert acc_big - acc_small >= 0.08, (acc_big, acc_small)
    assert acc_small >= 0.4, acc_small  # still learns something: well above 10 % chance
    assert acc_linear <= acc_big - 0.1, (acc_linear, acc_big)


def test_synthetic_rejects_bad_arguments():
    with pytest.raises(ValueError):
        data.make_synthetic(num_train=0)
    with pytest.raises(ValueError):
        data.make_synthetic(num_classes=1)
    with pytest.raises(ValueError, match="seed"):
        data.make_synthetic(num_train=10, num_test=10, seed=-1)


# --------------------------------------------------------------------------
# IDX files
# --------------------------------------------------------------------------

_IDX_SAMPLES = {
    torch.uint8: torch.tensor([[0, 1, 255], [7, 128, 3]], dtype=torch.uint8),
    torch.int8: torch.tensor([-128, -1, 0, 127], dtype=torch.int8),
    torch.int16: torch.tensor([[[-32768, 1], [2, 32767]]], dtype=torch.int16),
    torch.int32: torch.tensor([-(2**31), -5, 0, 2**31 - 1], dtype=torch.int32),
    torch.float32: torch.tensor([[1.5, -2.25], [float("inf"), 3e-38]], dtype=torch.float32),
    torch.float64: torch.tensor([1e300, -0.1, 0.0], dtype=torch.float64),
}


@pytest.mark.parametrize("suffix", ["", ".gz"])
@pytest.mark.parametrize("dtype", list(_IDX_SAMPLES), ids=str)
def test_idx_round_trip(tmp_path, dtype, suffix):
    tensor = _IDX_SAMPLES[dtype]
    path = tmp_path / f"t.idx{suffix}"
    data.write_idx(path, tensor)
    back = data.load_idx(path)
    assert back.dtype == dtype
    assert back.shape == tensor.shape
    assert torch.equal(back, tensor)


def test_idx_header_is_big_endian_and_gzip_detected_by_content(tmp_path):
    path = tmp_path / "labels.gz"
    data.write_idx(path, torch.arange(3, dtype=torch.int16))
    raw = gzip.decompress(path.read_bytes())
    assert raw[:4] == b"\x00\x00\x0b\x01"
    assert raw[4:8] == (3).to_bytes(4, "big")
    assert raw[8:] == b"\x00\x00\x00\x01\x00\x02"
    renamed = tmp_path / "labels-no-suffix"
    path.rename(renamed)
    assert torch.equal(data.load_idx(renamed), torch.arange(3, dtype=torch.int16))


def _write_bytes(path, payload: bytes):
    path.write_bytes(payload)
    return path


@pytest.mark.parametrize(
    "payload, message",
    [
        (b"", "too short"),
        (b"\x01\x00\x08\x01\x00\x00\x00\x01\x05", "magic"),
        (b"\x00\x00\x42\x01\x00\x00\x00\x01\x05", "type code"),
        (b"\x00\x00\x08\x03\x00\x00\x00\x02", "truncated IDX header"),
        (b"\x00\x00\x08\x01\x00\x00\x00\x05\x01\x02", "truncated"),
        (b"\x00\x00\x08\x01\x00\x00\x00\x01\x01\x02", "mismatch"),
        # Huge dimensions must fail fast instead of trying to allocate.
        (b"\x00\x00\x0e\x02\xff\xff\xff\xff\xff\xff\xff\xff", "truncated"),
    ],
    ids=["empty", "magic", "dtype", "header", "data", "trailing", "huge"],
)
def test_idx_bad_files_raise_clear_errors(tmp_path, payload, message):
    path = _write_bytes(tmp_path / "bad-file-idx", payload)
    with pytest.raises(ValueError, match=message) as info:
        data.load_idx(path)
    assert "bad-file-idx" in str(info.value)


def test_idx_truncated_gzip_and_real_truncation(tmp_path):
    good = tmp_path / "good.gz"
    data.write_idx(good, torch.zeros(100, 28, 28, dtype=torch.uint8))
    cut = _write_bytes(tmp_path / "cut.gz", good.read_bytes()[:-20])
    with pytest.raises(ValueError, match="cut.gz"):
        data.load_idx(cut)

    plain = tmp_path / "plain"
    data.write_idx(plain, torch.zeros(10, 4, dtype=torch.float32))
    short = _write_bytes(tmp_path / "short", plain.read_bytes()[:-1])
    with pytest.raises(ValueError, match="truncated"):
        data.load_idx(short)


def test_write_idx_rejects_unsupported_dtype(tmp_path):
    with pytest.raises(ValueError, match="dtype"):
        data.write_idx(tmp_path / "x", torch.zeros(3, dtype=torch.int64))


# --------------------------------------------------------------------------
# MNIST-style folders
# --------------------------------------------------------------------------

_STEMS = [
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
]
_NAMES = {
    "plain": _STEMS,
    "gz": [f"{stem}.gz" for stem in _STEMS],
    # "train-images.idx3-ubyte" spelling, mixed with one gzipped file
    "dot": [stem.replace("-idx", ".idx") for stem in _STEMS[:3]] + ["t10k-labels.idx1-ubyte.gz"],
}


def _fake_mnist(folder, style="plain", n_train=50, n_test=20, max_label=9):
    """Tiny random MNIST-format files; returns the raw tensors written."""
    rng = np.random.default_rng(0)
    tensors = [
        torch.from_numpy(rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8)),
        torch.arange(n_train, dtype=torch.uint8) % (max_label + 1),
        torch.from_numpy(rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8)),
        torch.arange(n_test, dtype=torch.uint8) % (max_label + 1),
    ]
    folder.mkdir(parents=True, exist_ok=True)
    for name, tensor in zip(_NAMES[style], tensors):
        data.write_idx(folder / name, tensor)
    return tensors


@pytest.mark.parametrize("style", list(_NAMES))
def test_load_mnist_dir(tmp_path, style):
    raw = _fake_mnist(tmp_path, style)
    splits = data.load_mnist_dir(tmp_path)
    x, y = splits.train.tensors
    xt, yt = splits.test.tensors
    assert x.shape == (50, 1, 28, 28) and xt.shape == (20, 1, 28, 28)
    assert x.dtype == torch.float32 and y.dtype == torch.int64
    expected = (raw[0].float() / 255 - data.MNIST_MEAN) / data.MNIST_STD
    torch.testing.assert_close(x[:, 0], expected)
    assert torch.equal(y, raw[1].long()) and torch.equal(yt, raw[3].long())
    assert splits.input_shape == (1, 28, 28)
    assert splits.num_classes == 10
    assert splits.name == "mnist"


def test_load_mnist_dir_torchvision_layout_and_num_classes(tmp_path):
    _fake_mnist(tmp_path / "MNIST" / "raw", "gz", max_label=11)
    splits = data.load_mnist_dir(tmp_path)
    assert splits.num_classes == 12
    few = tmp_path / "few"
    _fake_mnist(few, max_label=3)
    assert data.load_mnist_dir(few).num_classes == 10  # at least 10


def test_load_mnist_dir_missing_files(tmp_path):
    _fake_mnist(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(FileNotFoundError) as info:
        data.load_mnist_dir(tmp_path)
    message = str(info.value)
    assert "t10k-labels-idx1-ubyte" in message  # what was expected
    assert "train-images-idx3-ubyte" in message  # what is there
    with pytest.raises(FileNotFoundError, match="does not exist"):
        data.load_mnist_dir(tmp_path / "nope")


def test_load_mnist_dir_count_mismatch_and_corruption(tmp_path):
    _fake_mnist(tmp_path)
    data.write_idx(tmp_path / "train-labels-idx1-ubyte", torch.zeros(49, dtype=torch.uint8))
    with pytest.raises(ValueError, match="50 images.*49 labels"):
        data.load_mnist_dir(tmp_path)

    other = tmp_path / "corrupt"
    _fake_mnist(other)
    images = other / "t10k-images-idx3-ubyte"
    images.write_bytes(images.read_bytes()[:1000])
    with pytest.raises(ValueError, match="t10k-images-idx3-ubyte"):
        data.load_mnist_dir(other)


def test_build_dataset(tmp_path):
    synth = data.build_dataset("synthetic", num_train=300, num_test=50, seed=1)
    assert len(synth.train) == 300 and len(synth.test) == 50
    assert _equal_splits(synth, data.make_synthetic(num_train=300, num_test=50, seed=1))

    _fake_mnist(tmp_path)
    full = data.build_dataset("mnist", data_dir=str(tmp_path))
    assert len(full.train) == 50 and len(full.test) == 20
    cut = data.build_dataset("IDX", data_dir=str(tmp_path), num_train=10, num_test=5)
    assert len(cut.train) == 10 and len(cut.test) == 5
    assert torch.equal(cut.train.tensors[0], full.train.tensors[0][:10])

    with pytest.raises(ValueError, match="data_dir"):
        data.build_dataset("mnist")
    with pytest.raises(ValueError, match="synthetic.*mnist"):
        data.build_dataset("cifar")


# --------------------------------------------------------------------------
# Sharding
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "num_samples, world_size", [(10, 1), (10, 3), (101, 7), (12000, 16), (5, 5)]
)
def test_shards_partition_the_data(num_samples, world_size):
    shards = [data.shard_indices(num_samples, r, world_size, seed=2) for r in range(world_size)]
    assert all(s.dtype == torch.int64 for s in shards)
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1
    everything = torch.cat(shards)
    assert len(everything) == num_samples
    assert torch.equal(everything.sort().values, torch.arange(num_samples))


def test_shards_are_deterministic_and_seeded():
    a = data.shard_indices(1000, 1, 4, seed=0)
    assert torch.equal(a, data.shard_indices(1000, 1, 4, seed=0))
    assert not torch.equal(a, data.shard_indices(1000, 1, 4, seed=1))
    assert not torch.equal(a, torch.arange(250, 500))  # shuffled, not contiguous


@pytest.mark.parametrize(
    "num_samples, rank, world_size", [(10, -1, 2), (10, 2, 2), (10, 0, 0), (3, 0, 4)]
)
def test_shard_indices_rejects_bad_arguments(num_samples, rank, world_size):
    with pytest.raises(ValueError):
        data.shard_indices(num_samples, rank, world_size)


def test_node_shard():
    x = torch.arange(20, dtype=torch.float32).reshape(10, 2)
    y = torch.arange(10)
    dataset = TensorDataset(x, y)
    parts = [data.node_shard(dataset, r, 3, seed=5) for r in range(3)]
    for rank, part in enumerate(parts):
        idx = data.shard_indices(10, rank, 3, seed=5)
        assert torch.equal(part.tensors[0], x[idx]) and torch.equal(part.tensors[1], y[idx])
    assert sorted(torch.cat([p.tensors[1] for p in parts]).tolist()) == list(range(10))


@pytest.mark.parametrize(("n", "batch_size", "drop_last"),
                         [(100, 32, True), (100, 32, False), (96, 32, True), (96, 32, False), (10, 32, False)])
def test_shuffled_batches_are_dataloaders_batches_and_leave_its_generator_where_it_would(n, batch_size, drop_last):
    """The training loader (p2ptrain/train/batches.py) indexes the tensors instead of fetching and
    stacking samples; every batch, and the generator's state after each epoch and after a partial
    one (a reshard stops an epoch early), must be DataLoader(shuffle=True)'s."""
    from torch.utils.data import DataLoader

    from p2ptrain.train.batches import ShuffledBatches

    shard = TensorDataset(torch.randn(n, 3, 2), torch.arange(n))
    reference_generator, generator = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    reference = DataLoader(shard, batch_size=batch_size, shuffle=True, drop_last=drop_last,
                           generator=reference_generator)
    batches = ShuffledBatches(shard, batch_size, generator=generator, drop_last=drop_last)
    assert len(batches) == len(reference)
    for _ in range(3):
        expected, got = list(reference), list(batches)
        assert len(got) == len(expected) and len(got) >= 1
        for (x, y), (x2, y2) in zip(expected, got):
            assert torch.equal(x, x2) and torch.equal(y, y2) and x2.dtype == x.dtype
        assert torch.equal(reference_generator.get_state(), generator.get_state())
    next(iter(reference)), next(iter(batches))
    assert torch.equal(reference_generator.get_state(), generator.get_state())
    epoch_a, epoch_b = iter(reference), iter(batches)
    for _ in range(len(reference)):  # all batches taken, the end not asked for yet
        next(epoch_a), next(epoch_b)
    assert torch.equal(reference_generator.get_state(), generator.get_state())
    with pytest.raises(ValueError, match="batch_size"):
        ShuffledBatches(shard, 0, generator=generator)
