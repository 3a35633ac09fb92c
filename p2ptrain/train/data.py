"""Deterministic data sets, per-node sharding and an IDX (MNIST) file loader.

Everything here is reproducible without touching torch's global RNG, so that
every node of a decentralized run can rebuild the same data set and the same
shard assignment from nothing but a seed, with no coordination and no download
at run time. Shard indices are exact everywhere; synthetic tensors are
bit-identical for the same arguments on the same platform.
"""

from __future__ import annotations

import gzip
import math
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from p2ptrain.choices import DATASET_NAMES, IDX_DATASETS

__all__ = [
    "DatasetSplits",
    "DATASET_NAMES",
    "MNIST_MEAN",
    "MNIST_STD",
    "make_synthetic",
    "load_idx",
    "write_idx",
    "load_mnist_dir",
    "build_dataset",
    "shard_indices",
    "node_shard",
]

# The usual MNIST normalisation constants, so that models and learning rates
# tuned on the synthetic task (which is standardised too) transfer.
MNIST_MEAN = 0.1307
MNIST_STD = 0.3081


@dataclass(frozen=True)
class DatasetSplits:
    """A train/test pair plus the metadata needed to build a matching model."""

    train: TensorDataset  # (x float32, y int64)
    test: TensorDataset
    input_shape: tuple[int, ...]  # per-sample shape, e.g. (1, 28, 28)
    num_classes: int
    name: str


# --------------------------------------------------------------------------
# Synthetic task
# --------------------------------------------------------------------------

# Generator knobs, tuned (see the tests) so that a small MLP trained with
# SGD(lr=0.05, momentum=0.9) reaches ~85-90 % test accuracy on 12000 samples
# but only ~70-75 % with the same number of steps on 1500, while a linear
# model stays far lower. Images look like MNIST statistically -- non-negative
# "ink" on a black border, clipped to [0, 1] -- because pure Gaussian images
# of the same difficulty made that (aggressive) optimiser diverge.
_PROTOS_PER_CLASS = 4
_LOW_RES = 7  # resolution of the random noise that is upsampled into blobs
_INK_THRESHOLD = 0.5  # blob level (in std units) where ink is half on
_INK_GAIN = 3.0  # sharpness of the ink edge
_WINDOW_SIGMA = 0.25  # Gaussian vignette width, as a fraction of the canvas
_MAX_SHIFT = 2  # random translation in pixels, each axis
_CONTRAST = (0.6, 1.4)
_DISTRACTOR_AMP = 0.3
_PIXEL_NOISE = 0.3

# Independent generator streams derived from one seed.
_STREAM_PROTOS, _STREAM_TRAIN, _STREAM_TEST, _STREAM_SHARDS = 0, 1, 2, 3


def _rng(seed: int, stream: int) -> np.random.Generator:
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    return np.random.default_rng([int(seed), stream])


def _make_prototypes(rng: np.random.Generator, num_classes: int, size: int) -> torch.Tensor:
    """Smooth random ink blots in [0, 1], centred, ``(classes, protos, size, size)``."""
    n = num_classes * _PROTOS_PER_CLASS
    low = torch.from_numpy(rng.standard_normal((n, 1, _LOW_RES, _LOW_RES), dtype=np.float32))
    blobs = F.interpolate(low, size=(size, size), mode="bilinear", align_corners=False)[:, 0]
    blobs = (blobs - blobs.mean(dim=(1, 2), keepdim=True)) / blobs.std(dim=(1, 2), keepdim=True)
    ink = torch.sigmoid(_INK_GAIN * (blobs - _INK_THRESHOLD))
    r = torch.arange(size, dtype=torch.float32) - (size - 1) / 2
    sigma = _WINDOW_SIGMA * size
    window = torch.exp(-(r[:, None] ** 2 + r[None, :] ** 2) / (2 * sigma**2))
    return (ink * window).reshape(num_classes, _PROTOS_PER_CLASS, size, size)


def _shifted_crops(images: torch.Tensor, dy: np.ndarray, dx: np.ndarray, size: int) -> torch.Tensor:
    """Crop ``size x size`` windows at per-sample offsets (one gather, no Python loop)."""
    rows = torch.from_numpy(dy)[:, None] + torch.arange(size)  # (N, size)
    cols = torch.from_numpy(dx)[:, None] + torch.arange(size)
    n = images.shape[0]
    return images[torch.arange(n)[:, None, None], rows[:, :, None], cols[:, None, :]]


def _sample_split(
    rng: np.random.Generator, protos: torch.Tensor, num: int, image_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw ``num`` samples in [0, 1] and their labels from the prototype bank."""
    num_classes = protos.shape[0]
    flat = protos.reshape(-1, *protos.shape[2:])  # (classes * protos, P, P)

    labels = np.arange(num) % num_classes  # exactly balanced, then shuffled
    rng.shuffle(labels)
    proto = rng.integers(0, _PROTOS_PER_CLASS, num)
    # The distractor always comes from a *different* class.
    other = (labels + rng.integers(1, num_classes, num)) % num_classes
    other_proto = rng.integers(0, _PROTOS_PER_CLASS, num)
    shifts = rng.integers(0, 2 * _MAX_SHIFT + 1, (4, num))
    contrast = torch.from_numpy(rng.uniform(*_CONTRAST, num).astype(np.float32))
    noise = torch.from_numpy(rng.standard_normal((num, image_size, image_size), dtype=np.float32))

    own = flat[labels * _PROTOS_PER_CLASS + proto]
    foreign = flat[other * _PROTOS_PER_CLASS + other_proto]
    signal = _shifted_crops(own, shifts[0], shifts[1], image_size)
    distractor = _shifted_crops(foreign, shifts[2], shifts[3], image_size)
    x = contrast[:, None, None] * signal + _DISTRACTOR_AMP * distractor + _PIXEL_NOISE * noise
    return x.clamp_(0.0, 1.0).unsqueeze(1), torch.from_numpy(labels.astype(np.int64))


def make_synthetic(
    num_train: int = 12000,
    num_test: int = 2000,
    seed: int = 0,
    num_classes: int = 10,
    image_size: int = 28,
) -> DatasetSplits:
    """A deterministic MNIST-shaped image classification task that needs no download.

    Each class owns a few smooth random ink-blot prototypes; a sample is one
    of its class's prototypes, shifted by up to two pixels and rescaled in
    contrast, overlaid with a fainter prototype of another class, plus pixel
    noise, clipped to [0, 1]. Several prototypes per class plus shifts make it
    not linearly separable, and a model trained on few samples memorises the
    noise instead of the classes, so more data (more data-parallel nodes)
    measurably helps. Classes are exactly balanced.

    The same arguments give bit-identical tensors, regardless of torch's
    global RNG. Train and test come from disjoint generator streams of the
    same distribution; both are standardised with the train mean/std.
    """
    if num_train < 1 or num_test < 1:
        raise ValueError(f"num_train and num_test must be >= 1, got {num_train} and {num_test}")
    if num_classes < 2:
        raise ValueError(f"num_classes must be >= 2, got {num_classes}")
    if image_size < 4:
        raise ValueError(f"image_size must be >= 4, got {image_size}")

    protos = _make_prototypes(_rng(seed, _STREAM_PROTOS), num_classes, image_size + 2 * _MAX_SHIFT)
    x_train, y_train = _sample_split(_rng(seed, _STREAM_TRAIN), protos, num_train, image_size)
    x_test, y_test = _sample_split(_rng(seed, _STREAM_TEST), protos, num_test, image_size)

    mean, std = x_train.mean(), x_train.std()
    x_train = (x_train - mean) / std
    x_test = (x_test - mean) / std
    return DatasetSplits(
        train=TensorDataset(x_train, y_train),
        test=TensorDataset(x_test, y_test),
        input_shape=(1, image_size, image_size),
        num_classes=num_classes,
        name="synthetic",
    )


# --------------------------------------------------------------------------
# IDX format (the MNIST file format)
# --------------------------------------------------------------------------

# IDX type code -> (big-endian numpy dtype, torch dtype)
_IDX_TYPES: dict[int, tuple[str, torch.dtype]] = {
    0x08: (">u1", torch.uint8),
    0x09: (">i1", torch.int8),
    0x0B: (">i2", torch.int16),
    0x0C: (">i4", torch.int32),
    0x0D: (">f4", torch.float32),
    0x0E: (">f8", torch.float64),
}
_TORCH_TO_IDX = {torch_dtype: code for code, (_, torch_dtype) in _IDX_TYPES.items()}
_GZIP_MAGIC = b"\x1f\x8b"


def _read_maybe_gzipped(path: Path) -> bytes:
    """Whole file contents, gunzipped if it is gzip data (detected by content, not name)."""
    raw = path.read_bytes()
    if raw[:2] != _GZIP_MAGIC:
        return raw
    try:
        return gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as exc:
        raise ValueError(f"{path}: corrupt or truncated gzip data ({exc})") from exc


def load_idx(path: str | os.PathLike) -> torch.Tensor:
    """Parse one IDX file (plain or gzip-compressed) into a tensor of its stored dtype.

    Reads the whole file and validates the header against the payload size
    before touching the data, so a bad file fails fast with a ``ValueError``
    naming the file instead of hanging or producing garbage.
    """
    path = Path(path)
    raw = _read_maybe_gzipped(path)
    if len(raw) < 4:
        raise ValueError(f"{path}: too short to be an IDX file ({len(raw)} bytes)")
    if raw[0] != 0 or raw[1] != 0:
        raise ValueError(
            f"{path}: bad IDX magic {raw[:4].hex()} (expected two zero bytes, type code, ndim)"
        )
    code, ndim = raw[2], raw[3]
    if code not in _IDX_TYPES:
        raise ValueError(
            f"{path}: unknown IDX type code 0x{code:02X} "
            f"(known: {', '.join(f'0x{c:02X}' for c in _IDX_TYPES)})"
        )
    header_len = 4 + 4 * ndim
    if len(raw) < header_len:
        raise ValueError(f"{path}: truncated IDX header (need {header_len} bytes, got {len(raw)})")
    dims = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    np_dtype, _ = _IDX_TYPES[code]
    itemsize = np.dtype(np_dtype).itemsize
    expected = math.prod(dims) * itemsize
    payload = len(raw) - header_len
    if payload < expected:
        raise ValueError(
            f"{path}: truncated IDX data: shape {dims} needs {expected} bytes, file has {payload}"
        )
    if payload > expected:
        raise ValueError(
            f"{path}: IDX size mismatch: shape {dims} needs {expected} bytes, "
            f"file has {payload} ({payload - expected} trailing bytes)"
        )
    array = np.frombuffer(raw, dtype=np_dtype, offset=header_len).reshape(dims)
    # astype to native byte order copies, giving a writable array torch can own.
    return torch.from_numpy(array.astype(np.dtype(np_dtype).newbyteorder("=")))


def write_idx(path: str | os.PathLike, tensor: torch.Tensor | np.ndarray) -> None:
    """Write ``tensor`` as an IDX file; gzip-compressed when ``path`` ends in ``.gz``.

    Exists so tests and users can produce small MNIST-style files locally
    instead of downloading them.
    """
    path = Path(path)
    t = torch.as_tensor(tensor).detach().cpu()
    if t.dtype not in _TORCH_TO_IDX:
        raise ValueError(
            f"write_idx: dtype {t.dtype} has no IDX type code "
            f"(supported: {', '.join(str(d) for d in _TORCH_TO_IDX)})"
        )
    if t.dim() > 255:
        raise ValueError(f"write_idx: IDX supports at most 255 dimensions, got {t.dim()}")
    if any(d >= 2**32 for d in t.shape):
        raise ValueError(f"write_idx: dimension too large for IDX: {tuple(t.shape)}")
    code = _TORCH_TO_IDX[t.dtype]
    header = bytes([0, 0, code, t.dim()]) + np.asarray(t.shape, dtype=">u4").tobytes()
    body = t.contiguous().numpy().astype(_IDX_TYPES[code][0], copy=False).tobytes()
    payload = header + body
    if path.suffix == ".gz":
        payload = gzip.compress(payload, compresslevel=6, mtime=0)  # mtime=0: reproducible bytes
    path.write_bytes(payload)


# --------------------------------------------------------------------------
# MNIST-style folders
# --------------------------------------------------------------------------

# split -> (images stem, labels stem); each also accepted with "-idx" written
# ".idx" (e.g. "train-images.idx3-ubyte") and with a ".gz" suffix.
_MNIST_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def _candidates(stem: str) -> list[str]:
    dotted = stem.replace("-idx", ".idx")
    return [stem, stem + ".gz", dotted, dotted + ".gz"]


def _find_file(folder: Path, stem: str) -> Path | None:
    for name in _candidates(stem):
        if (folder / name).is_file():
            return folder / name
    return None


def _load_mnist_split(images_path: Path, labels_path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    images = load_idx(images_path)
    labels = load_idx(labels_path)
    if images.dtype != torch.uint8 or images.dim() != 3:
        raise ValueError(
            f"{images_path}: expected uint8 images of shape (N, H, W), "
            f"got {images.dtype} {tuple(images.shape)}"
        )
    if labels.dim() != 1 or labels.dtype.is_floating_point:
        raise ValueError(
            f"{labels_path}: expected integer labels of shape (N,), "
            f"got {labels.dtype} {tuple(labels.shape)}"
        )
    if images.shape[0] != labels.shape[0]:
        raise ValueError(
            f"{images_path.name} has {images.shape[0]} images but "
            f"{labels_path.name} has {labels.shape[0]} labels"
        )
    if labels.numel() and int(labels.min()) < 0:
        raise ValueError(f"{labels_path}: negative label {int(labels.min())}")
    x = (images.to(torch.float32).div_(255.0).sub_(MNIST_MEAN).div_(MNIST_STD)).unsqueeze(1)
    return x, labels.to(torch.int64)


def load_mnist_dir(folder: str | os.PathLike) -> DatasetSplits:
    """Load an MNIST-style folder of four IDX files (plain or ``.gz``).

    Also looks in ``folder/MNIST/raw``, the layout torchvision leaves behind,
    so an existing download can be reused. Images become float32 ``(N, 1, H, W)``
    normalised with the MNIST mean/std; labels become int64.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"MNIST data folder {folder} does not exist or is not a directory")

    paths: dict[str, Path] = {}
    missing: list[str] = []
    search = [folder, folder / "MNIST" / "raw"]
    for stems in _MNIST_FILES.values():
        for stem in stems:
            found = next((p for d in search if (p := _find_file(d, stem)) is not None), None)
            if found is None:
                missing.append(stem)
            else:
                paths[stem] = found
    if missing:
        present = sorted(p.name for p in folder.iterdir())
        raise FileNotFoundError(
            f"MNIST folder {folder} is missing {', '.join(missing)} "
            f"(each may also be spelled '.idxN-ubyte' and/or end in '.gz'); "
            f"folder contains: {', '.join(present) if present else '(nothing)'}"
        )

    splits = {
        split: _load_mnist_split(paths[images], paths[labels])
        for split, (images, labels) in _MNIST_FILES.items()
    }
    (x_train, y_train), (x_test, y_test) = splits["train"], splits["test"]
    if x_train.shape[1:] != x_test.shape[1:]:
        raise ValueError(
            f"{folder}: train images are {tuple(x_train.shape[2:])} but test images are "
            f"{tuple(x_test.shape[2:])}"
        )
    max_label = max(int(y.max()) if y.numel() else -1 for y in (y_train, y_test))
    return DatasetSplits(
        train=TensorDataset(x_train, y_train),
        test=TensorDataset(x_test, y_test),
        input_shape=tuple(x_train.shape[1:]),
        num_classes=max(10, max_label + 1),
        name="mnist",
    )


# --------------------------------------------------------------------------
# Selection by name, sharding
# --------------------------------------------------------------------------


def _truncate(dataset: TensorDataset, limit: int | None) -> TensorDataset:
    if limit is None or limit >= len(dataset):
        return dataset
    return TensorDataset(*(t[:limit] for t in dataset.tensors))


def build_dataset(
    name: str,
    data_dir: str | None = None,
    seed: int = 0,
    num_train: int | None = None,
    num_test: int | None = None,
) -> DatasetSplits:
    """Pick a data set by its command-line name.

    ``"synthetic"`` generates ``num_train``/``num_test`` samples (defaults
    12000/2000); ``"mnist"``/``"idx"`` load ``data_dir`` and keep at most the
    first ``num_train``/``num_test`` samples (all when ``None``).
    """
    key = name.strip().lower()
    for label, value in (("num_train", num_train), ("num_test", num_test)):
        if value is not None and value < 1:
            raise ValueError(f"{label} must be >= 1 or None, got {value}")
    if key == "synthetic":
        sizes = {"num_train": num_train, "num_test": num_test}
        return make_synthetic(seed=seed, **{k: v for k, v in sizes.items() if v is not None})
    if key in IDX_DATASETS:
        if data_dir is None:
            raise ValueError(f"data set {name!r} needs data_dir (a folder of MNIST IDX files)")
        splits = load_mnist_dir(data_dir)
        return DatasetSplits(
            train=_truncate(splits.train, num_train),
            test=_truncate(splits.test, num_test),
            input_shape=splits.input_shape,
            num_classes=splits.num_classes,
            name=key,
        )
    raise ValueError(f"unknown data set {name!r}; valid names: {', '.join(DATASET_NAMES)}")


def shard_indices(num_samples: int, rank: int, world_size: int, seed: int = 0) -> torch.Tensor:
    """Indices (int64) of node ``rank``'s shard of a ``num_samples`` data set.

    A seeded permutation cut into ``world_size`` contiguous chunks: every node
    computes the same permutation independently, shards are disjoint, cover
    every index and differ in size by at most one, and class order in the
    source data cannot leak into the shards.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if num_samples < world_size:
        raise ValueError(
            f"cannot shard {num_samples} samples over {world_size} nodes: "
            "every node needs at least one"
        )
    perm = _rng(seed, _STREAM_SHARDS).permutation(num_samples).astype(np.int64)
    return torch.tensor_split(torch.from_numpy(perm), world_size)[rank].clone()


def node_shard(dataset: TensorDataset, rank: int, world_size: int, seed: int = 0) -> TensorDataset:
    """The part of ``dataset`` that node ``rank`` of ``world_size`` trains on."""
    idx = shard_indices(len(dataset), rank, world_size, seed)
    return TensorDataset(*(t[idx] for t in dataset.tensors))
