"""Bucketed gradient all-reduce from backward hooks (p2ptrain/algorithms/buckets.py) on real
in-process clusters: the same training as the flat all-reduce, bit-identical models across nodes,
and the loops where hooks cannot stand for step()'s gradient (accumulation, GradScaler, clipping)
fall back to the flat all-reduce on every node alike.
"""
from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import p2ptrain
from p2ptrain.algorithms.allreduce import AllReduceSGD
from p2ptrain.transport import TransportOptions
from tests.cluster import run_cluster

N, DIM = 4, 12
STEPS = 6
TINY_BUCKETS_MB = 300 * 4 / 2**20  # about 300 floats: the MLP below cuts into several buckets
OPTIONS = TransportOptions(send_timeout=30.0, link_deadline=5.0)
_INIT = threading.Lock()


def net() -> nn.Module:
    with _INIT:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(DIM, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 1),
                             nn.Flatten(0))


def batch(rank: int, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 100 * rank + micro)
    x = torch.randn(16, DIM, generator=g) + rank
    return x, x.sum(1) * 0.3 + torch.randn(16, generator=g) * 0.1


def train(rank: int, comm, *, buckets_mb: float, accumulate: int = 1, scaled: bool = False, clip: bool = False):
    model = net()
    algorithm = AllReduceSGD(comm, average="gradients", buckets_mb=buckets_mb)
    opt = p2ptrain.DecentralizedOptimizer(torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9),
                                          model=model, algorithm=algorithm, comm=comm)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) if scaled else None
    for step in range(STEPS):
        for micro in range(accumulate):
            x, y = batch(rank, step, micro)
            loss = F.mse_loss(model(x), y) / accumulate
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
    opt.finish()
    return copy.deepcopy(model.state_dict()), algorithm.stats().get("bucketed_steps", 0.0)


def run(**kwargs):
    return run_cluster(N, lambda rank, comm: train(rank, comm, **kwargs), options=OPTIONS)


def assert_identical_across_nodes(results):
    first = results[0][0]
    for state, _ in results[1:]:
        for key, value in first.items():
            assert torch.equal(state[key], value), key


def assert_close_to(results, reference):
    for state, _ in results:
        for key, value in reference.items():
            torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_buckets_train_as_the_flat_all_reduce_with_identical_models():
    flat = run(buckets_mb=0)
    bucketed = run(buckets_mb=TINY_BUCKETS_MB)
    assert_identical_across_nodes(bucketed)
    assert [steps for _, steps in bucketed] == [STEPS] * N  # every step went through the buckets
    assert_close_to(bucketed, flat[0][0])


def test_buckets_cut_the_gradient_in_reverse_parameter_order():
    def body(rank, comm):
        model = net()
        algorithm = AllReduceSGD(comm, buckets_mb=TINY_BUCKETS_MB)
        p2ptrain.DecentralizedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                                        algorithm=algorithm, comm=comm).finish()
        return [(b.start, b.end) for b in algorithm.buckets.buckets]

    bounds = run_cluster(2, body, options=OPTIONS)[0]
    numel = sum(p.numel() for p in net().parameters())
    assert len(bounds) > 1 and bounds[0][1] == numel and bounds[-1][0] == 0
    assert all(later[1] == earlier[0] for earlier, later in zip(bounds, bounds[1:]))  # contiguous, from the end


@pytest.mark.parametrize("loop", [dict(accumulate=2), dict(scaled=True), dict(clip=True)],
                         ids=["accumulation", "grad-scaler", "clipping"])
def test_loops_hooks_cannot_stand_for_fall_back_to_the_flat_all_reduce(loop):
    flat = run(buckets_mb=0, **loop)
    bucketed = run(buckets_mb=TINY_BUCKETS_MB, **loop)
    assert_identical_across_nodes(bucketed)
    assert [steps for _, steps in bucketed] == [0] * N  # switched off at the first step on every node
    assert_close_to(bucketed, flat[0][0])
