"""Tests for p2ptrain.train.partition: Dirichlet non-IID partitions (seed 003, section 4.1)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from p2ptrain.train import partition as P

torch.set_num_threads(1)

BALANCED = torch.arange(12000) % 10  # 10 classes x 1200 samples


def _covers_exactly_once(parts: list[torch.Tensor], n: int) -> bool:
    flat = torch.cat(parts)
    return flat.dtype == torch.int64 and torch.equal(flat.sort().values, torch.arange(n))


@pytest.mark.parametrize("world_size", [1, 3, 8])
@pytest.mark.parametrize("alpha", [0.01, 0.1, 1.0, 100.0])
def test_every_sample_assigned_exactly_once(world_size, alpha):
    labels = torch.from_numpy(np.random.default_rng(5).integers(0, 7, 1000))
    parts = P.dirichlet_indices(labels, world_size, alpha, seed=2)
    assert len(parts) == world_size
    assert _covers_exactly_once(parts, labels.numel())
    assert all(p.numel() >= 1 for p in parts)


def test_unbalanced_and_sparse_labels_are_covered():
    labels = torch.tensor([9] * 50 + [0] * 3 + [4] * 200, dtype=torch.int32)
    parts = P.dirichlet_indices(labels, 4, 0.5, seed=1)
    assert _covers_exactly_once(parts, labels.numel())


def test_deterministic_and_seed_dependent():
    torch.manual_seed(0)
    np.random.seed(0)
    a = P.dirichlet_indices(BALANCED, 8, 0.5, seed=3)
    torch.manual_seed(1)
    np.random.seed(1)
    torch.rand(5)
    b = P.dirichlet_indices(BALANCED, 8, 0.5, seed=3)
    c = P.dirichlet_indices(BALANCED, 8, 0.5, seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))


def test_smaller_alpha_is_more_skewed():
    skews = [
        P.skew(P.class_histograms(BALANCED, P.dirichlet_indices(BALANCED, 8, a, seed=0), 10))
        for a in (0.01, 0.1, 1.0, 100.0)
    ]
    assert skews[0] > skews[1] > skews[2] > skews[3], skews
    assert skews[3] < 0.1, skews
    assert skews[0] > 0.5, skews


def test_class_histograms_and_skew_values():
    labels = torch.tensor([0, 0, 1, 1, 2, 2])
    parts = [torch.tensor([0, 2, 4]), torch.tensor([1, 3, 5])]
    hist = P.class_histograms(labels, parts, 3)
    assert hist.shape == (2, 3) and hist.dtype == torch.int64
    assert torch.equal(hist, torch.ones(2, 3, dtype=torch.int64))
    assert P.skew(hist) == 0.0
    # Two nodes, each holding one of two equally common classes: TV = 0.5 each.
    assert math.isclose(P.skew(torch.tensor([[5, 0], [0, 5]])), 0.5)
    hist = P.class_histograms(BALANCED, P.dirichlet_indices(BALANCED, 8, 0.3, seed=1), 10)
    assert torch.equal(hist.sum(dim=0), torch.full((10,), 1200))


def test_min_size_respected():
    labels = torch.arange(400) % 4
    parts = P.dirichlet_indices(labels, 8, 0.3, seed=0, min_size=20)
    assert min(p.numel() for p in parts) >= 20
    assert _covers_exactly_once(parts, 400)


def test_impossible_requests_raise():
    with pytest.raises(ValueError, match="fewer nodes"):
        P.dirichlet_indices(torch.arange(5) % 2, 8, 1.0)  # fewer samples than nodes
    with pytest.raises(ValueError, match="fewer nodes"):
        P.dirichlet_indices(torch.arange(100) % 2, 8, 1.0, min_size=20)
    # Possible in principle, but a near one-class-per-node alpha with 2 classes
    # over 20 nodes essentially never gives every node a sample.
    with pytest.raises(ValueError, match="larger alpha"):
        P.dirichlet_indices(torch.arange(40) % 2, 20, 0.001, min_size=1)


@pytest.mark.parametrize("alpha", [0, -1.0, float("nan"), float("inf"), "x"])
def test_bad_alpha_raises(alpha):
    with pytest.raises(ValueError, match="alpha"):
        P.dirichlet_indices(BALANCED, 4, alpha)


@pytest.mark.parametrize(
    "labels",
    [
        torch.zeros(10),  # float
        torch.zeros(10, dtype=torch.bool),
        torch.zeros(5, 2, dtype=torch.int64),  # not 1-D
        torch.tensor([0, -1, 2]),  # negative
        [0, 1, 2],  # not a tensor
    ],
)
def test_bad_labels_raise(labels):
    with pytest.raises(ValueError, match="labels"):
        P.dirichlet_indices(labels, 2, 1.0)


def test_bad_world_size_and_rank_raise():
    ds = TensorDataset(torch.randn(20, 3), torch.arange(20) % 2)
    with pytest.raises(ValueError, match="world_size"):
        P.dirichlet_indices(ds.tensors[1], 0, 1.0)
    for rank in (-1, 4, 10):
        with pytest.raises(ValueError, match="rank"):
            P.dirichlet_shard(ds, rank, 4, 1.0)


def test_dirichlet_shard_is_the_right_subset():
    x = torch.randn(600, 1, 4, 4)
    y = torch.arange(600) % 6
    ds = TensorDataset(x, y)
    parts = P.dirichlet_indices(y, 5, 0.5, seed=7)
    for rank in range(5):
        shard = P.dirichlet_shard(ds, rank, 5, 0.5, seed=7)
        assert len(shard) == parts[rank].numel()
        for got, src in zip(shard.tensors, ds.tensors):
            assert torch.equal(got, src[parts[rank]])
