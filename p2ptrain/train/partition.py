"""Non-IID (Dirichlet) partitions of a labelled data set over nodes.

Decentralized algorithms behave very differently when nodes see different class mixes, so the
RelaySGD thesis (seed 003, section 4.1) evaluates them on a Dirichlet(alpha) partition: for every
class ``c`` draw node proportions ``p_c ~ Dir(alpha * 1_n)`` and split that class's samples among
the ``n`` nodes according to ``p_c``. Small ``alpha`` gives each node a few classes (very skewed);
large ``alpha`` approaches the IID split of :func:`p2ptrain.train.data.shard_indices`.

Like the IID sharding, everything is derived from a seed with a private numpy Generator, so every
node rebuilds the same partition without coordination and without touching torch's or numpy's
global RNG.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch.utils.data import TensorDataset

__all__ = ["dirichlet_indices", "dirichlet_shard", "class_histograms", "skew"]

# Generator stream for Dirichlet partitions; distinct from data.py's streams
# (0-3) so a partition never reuses the randomness of data generation or IID
# sharding with the same seed.
_STREAM_DIRICHLET = 17
MAX_ATTEMPTS = 100


def _check_world_size(world_size: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer)) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")


def _check_alpha(alpha: float) -> float:
    try:
        a = float(alpha)
    except (TypeError, ValueError):
        raise ValueError(f"alpha must be a positive finite number, got {alpha!r}") from None
    if not math.isfinite(a) or a <= 0:
        raise ValueError(f"alpha must be a positive finite number, got {alpha!r}")
    return a


def _check_labels(labels: torch.Tensor) -> np.ndarray:
    if not isinstance(labels, torch.Tensor):
        raise ValueError(f"labels must be a torch.Tensor, got {type(labels).__name__}")
    if labels.dim() != 1:
        raise ValueError(f"labels must be 1-D, got shape {tuple(labels.shape)}")
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise ValueError(f"labels must have an integer dtype, got {labels.dtype}")
    y = labels.detach().cpu().to(torch.int64).numpy()
    if y.size and int(y.min()) < 0:
        raise ValueError(f"labels must be >= 0, got {int(y.min())}")
    return y


def _draw(y: np.ndarray, world_size: int, alpha: float, rng: np.random.Generator) -> list[np.ndarray]:
    """One Dirichlet draw: per class, shuffle its indices and cut at rounded cumulative proportions."""
    buckets: list[list[np.ndarray]] = [[] for _ in range(world_size)]
    for c in np.unique(y):
        idx = np.flatnonzero(y == c)
        rng.shuffle(idx)
        p = rng.dirichlet(np.full(world_size, alpha))
        if not np.all(np.isfinite(p)) or p.sum() <= 0:  # underflow guard for tiny alpha
            p = np.zeros(world_size)
            p[rng.integers(world_size)] = 1.0
        # Cutting at rounded cumulative counts (not rounding each share) makes
        # the pieces sum exactly to the class size.
        cuts = np.clip(np.round(np.cumsum(p)[:-1] * idx.size), 0, idx.size).astype(np.int64)
        cuts = np.maximum.accumulate(cuts)
        for node, piece in enumerate(np.split(idx, cuts)):
            buckets[node].append(piece)
    return [
        np.sort(np.concatenate(b)) if b else np.empty(0, dtype=np.int64) for b in buckets
    ]


def dirichlet_indices(
    labels: torch.Tensor, world_size: int, alpha: float, seed: int = 0, min_size: int = 1
) -> list[torch.Tensor]:
    """Per-node int64 sample indices of a Dirichlet(``alpha``) class partition (seed 003, §4.1).

    Every sample is assigned to exactly one node, and the result depends only
    on ``(labels, world_size, alpha, seed, min_size)``. Because an empty shard
    would break a node's data loader, draws in which some node gets fewer than
    ``min_size`` samples are rejected and re-drawn (up to ``MAX_ATTEMPTS``
    times, each from a seed derived from ``seed``); ``ValueError`` if that is
    impossible or never succeeds.
    """
    _check_world_size(world_size)
    a = _check_alpha(alpha)
    y = _check_labels(labels)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
    if isinstance(min_size, bool) or not isinstance(min_size, (int, np.integer)) or min_size < 0:
        raise ValueError(f"min_size must be an integer >= 0, got {min_size!r}")
    world_size, min_size = int(world_size), int(min_size)
    if y.size < world_size * min_size:
        raise ValueError(
            f"cannot give each of {world_size} nodes at least {min_size} sample(s): only "
            f"{y.size} samples; use fewer nodes or a smaller min_size"
        )

    smallest = 0
    for attempt in range(MAX_ATTEMPTS):
        rng = np.random.default_rng([int(seed), _STREAM_DIRICHLET, attempt])
        parts = _draw(y, world_size, a, rng)
        smallest = min(p.size for p in parts)
        if smallest >= min_size:
            return [torch.from_numpy(p.astype(np.int64)) for p in parts]
    raise ValueError(
        f"Dirichlet partition with alpha={a} over {world_size} nodes left some node with fewer "
        f"than {min_size} sample(s) in all {MAX_ATTEMPTS} attempts (last smallest shard: "
        f"{smallest}); use a larger alpha or fewer nodes"
    )


def dirichlet_shard(
    dataset: TensorDataset, rank: int, world_size: int, alpha: float, seed: int = 0
) -> TensorDataset:
    """Node ``rank``'s part of a Dirichlet(``alpha``) partition of ``dataset`` (the non-IID
    counterpart of :func:`p2ptrain.train.data.node_shard`).

    Labels are taken from the last tensor of ``dataset`` (``(x, y)`` convention).
    Every node computes the full partition from the seed and keeps its part.
    """
    _check_world_size(world_size)
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an integer in [0, {world_size}), got {rank!r}")
    if not dataset.tensors:
        raise ValueError("dataset has no tensors (expected (x, y))")
    parts = dirichlet_indices(dataset.tensors[-1], world_size, alpha, seed)
    idx = parts[int(rank)]
    return TensorDataset(*(t[idx] for t in dataset.tensors))


def class_histograms(labels: torch.Tensor, parts: list[torch.Tensor], num_classes: int) -> torch.Tensor:
    """Int64 ``[len(parts), num_classes]`` label counts per node, to inspect or log how skewed
    a partition is."""
    y = _check_labels(labels)
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    if y.size and int(y.max()) >= num_classes:
        raise ValueError(f"label {int(y.max())} out of range for num_classes={num_classes}")
    yt = torch.from_numpy(y)
    rows = [torch.bincount(yt[torch.as_tensor(p, dtype=torch.int64)], minlength=num_classes) for p in parts]
    if not rows:
        return torch.zeros(0, num_classes, dtype=torch.int64)
    return torch.stack(rows).to(torch.int64)


def skew(histograms: torch.Tensor) -> float:
    """Mean over (non-empty) nodes of the total-variation distance between the node's class
    distribution and the global one: 0 for a perfectly IID split, approaching 1 when
    every node holds a single class of many. One number to compare partitions (alpha values)."""
    h = torch.as_tensor(histograms, dtype=torch.float64)
    if h.dim() != 2:
        raise ValueError(f"histograms must be [nodes, classes], got shape {tuple(h.shape)}")
    if (h < 0).any():
        raise ValueError("histograms must be non-negative counts")
    totals = h.sum(dim=1)
    keep = totals > 0
    if not keep.any():
        return 0.0
    h, totals = h[keep], totals[keep]
    global_dist = h.sum(dim=0) / h.sum()
    node_dist = h / totals[:, None]
    tv = 0.5 * (node_dist - global_dist).abs().sum(dim=1)
    return float(tv.mean())
