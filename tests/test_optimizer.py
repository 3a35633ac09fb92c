"""p2ptrain.DecentralizedOptimizer the way a user calls it (issue 12): any torch optimizer, a loop of
one's own (clipping, LR scheduler, GradScaler, accumulation, parameter groups, AdamW state), model
buffers kept consistent, mixed dtypes, clear errors, and checkpoints that resume exactly.

In-process clusters (tests/cluster.py): real gRPC between real Transports, one thread per node;
each test compares the cluster with a single-process reference of the same math.
"""
from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import p2ptrain
from p2ptrain.algorithms.allreduce import AllReduceSGD
from p2ptrain.algorithms.base import Algorithm
from p2ptrain.algorithms.sgp import SGP
from p2ptrain.topology import build_topology
from p2ptrain.transport import TransportOptions
from tests.cluster import run_cluster

N, DIM = 3, 6
_INIT = threading.Lock()
OPTIONS = TransportOptions(send_timeout=30.0, link_deadline=5.0)


def net(seed: int = 0) -> nn.Module:
    """The same initial model on every node (built under a lock: the nodes are threads sharing
    torch's global RNG)."""
    with _INIT:
        torch.manual_seed(seed)
        # (no bias before the BatchNorm: its gradient is rounding noise, which AdamW would amplify to
        # lr-sized steps whose sign depends on the order of summation)
        return nn.Sequential(nn.Linear(DIM, 8, bias=False), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1),
                             nn.Flatten(0))


def batch(rank: int, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 100 * rank + micro)
    x = torch.randn(16, DIM, generator=g) + rank  # shards differ (BatchNorm statistics too)
    return x, x.sum(1) * 0.3 + torch.randn(16, generator=g) * 0.1


def user_loop(model: nn.Module, opt, rank: int, steps: int, *, start: int = 0, accumulate: int = 2,
              scaler: torch.amp.GradScaler | None = None, scheduler=None) -> None:
    """The loop of the issue: micro-batch accumulation, GradScaler, clipping, a scheduler, set_to_none."""
    for step in range(start, steps):
        model.train()
        for micro in range(accumulate):
            x, y = batch(rank, step, micro)
            loss = F.mse_loss(model(x), y) / accumulate
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        if scheduler is not None:
            scheduler.step()
        opt.zero_grad(set_to_none=True)


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    """Two parameter groups with their own learning rates, and optimizer state (AdamW's moments)."""
    first, rest = list(model[0].parameters()), [p for m in list(model)[1:] for p in m.parameters()]
    return torch.optim.AdamW([{"params": first, "lr": 0.02}, {"params": rest, "lr": 0.005}], weight_decay=0.01)


def reference_model_averaging(steps: int, scaled: bool) -> nn.Module:
    """One process doing what N AllReduce-SGD (average=models) nodes do: each replica takes its own
    local step, then parameters and buffers are averaged."""
    replicas = [net() for _ in range(N)]
    opts = [adamw(m) for m in replicas]
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5) for o in opts]
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) if scaled else None for _ in range(N)]
    for step in range(steps):
        for rank, (m, o, s, sc) in enumerate(zip(replicas, opts, scheds, scalers)):
            user_loop(m, o, rank, step + 1, start=step, scaler=sc, scheduler=s)
        with torch.no_grad():
            states = [dict(m.state_dict()) for m in replicas]
            for key, value in states[0].items():
                if value.dtype.is_floating_point:
                    mean = torch.stack([s[key] for s in states]).mean(0)
                    for m in replicas:
                        m.state_dict()[key].copy_(mean)
    return replicas[0]


@pytest.mark.parametrize("scaled", [False, True])
def test_wrapper_with_clipping_scheduler_scaler_and_accumulation_matches_the_reference(scaled):
    steps = 8

    def body(rank, comm):
        model = net()
        opt = p2ptrain.DecentralizedOptimizer(adamw(model), model=model, algorithm=AllReduceSGD(comm, average="models"),
                                              comm=comm)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)  # on the wrapper itself
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) if scaled else None
        user_loop(model, opt, rank, steps, scaler=scaler, scheduler=scheduler)
        opt.finish()
        return copy.deepcopy(model.state_dict()), opt.param_groups[0]["lr"]

    results = run_cluster(N, body, options=OPTIONS)
    expected = reference_model_averaging(steps, scaled).state_dict()
    for state, lr in results:
        assert lr == pytest.approx(0.02 * 0.5 ** (steps // 3))  # the scheduler drove the inner optimizer
        for key, value in expected.items():
            torch.testing.assert_close(state[key].float(), value.float(), rtol=1e-5, atol=1e-6, msg=key)


def test_gradient_averaging_is_data_parallel_sgd_and_buffers_end_identical():
    """average=gradients: the mean gradient every step, like DDP; BatchNorm statistics (in the same
    collective) end identical on every node although every shard differs."""
    steps = 6

    def body(rank, comm):
        model = net()
        opt = p2ptrain.DecentralizedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                              model=model, algorithm=AllReduceSGD(comm, average="gradients"),
                                              comm=comm)
        user_loop(model, opt, rank, steps, accumulate=1)
        opt.finish()
        return copy.deepcopy(model.state_dict())

    states = run_cluster(N, body, options=OPTIONS)
    reference = net()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        grads, stats = [], []
        for rank in range(N):
            replica = copy.deepcopy(reference)
            replica.train()
            x, y = batch(rank, step)
            F.mse_loss(replica(x), y).backward()
            torch.nn.utils.clip_grad_norm_(replica.parameters(), 0.5)
            grads.append([p.grad for p in replica.parameters()])
            stats.append({k: v for k, v in replica.state_dict().items() if "running" in k})
        for p, *gs in zip(reference.parameters(), *grads):
            p.grad = torch.stack(gs).mean(0)
        ref_opt.step()
        ref_opt.zero_grad()
        with torch.no_grad():
            for key in stats[0]:
                reference.state_dict()[key].copy_(torch.stack([s[key] for s in stats]).mean(0))
    for state in states:
        for key, value in reference.state_dict().items():
            if value.dtype.is_floating_point:
                torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=key)
    assert all(torch.equal(s["1.running_mean"], states[0]["1.running_mean"]) for s in states)


def test_batchnorm_statistics_converge_under_sgp():
    """Every node's forward pulls its running statistics towards its own shard (shards differ by
    a whole unit per rank); mixed with the model, they end far closer together than unmixed ones."""
    n, steps = 4, 60

    def body(rank, comm):
        model, alone = net(), net()
        sgp = SGP(comm, build_topology("exponential", n), overlap=1)
        opt = p2ptrain.DecentralizedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model=model,
                                              algorithm=sgp, comm=comm)
        for step in range(steps):
            model.train()
            alone.train()
            x, _ = batch(rank, step)
            model(x)
            alone(x)  # the same statistics, never averaged
            opt.step()
        opt.finish()
        return model[1].running_mean.clone(), alone[1].running_mean.clone(), sgp.w

    results = run_cluster(n, body, options=OPTIONS)
    spread = lambda t: float((t - t.mean(0)).abs().max())  # noqa: E731
    mixed, unmixed = torch.stack([r[0] for r in results]), torch.stack([r[1] for r in results])
    assert spread(mixed) < 0.2 * spread(unmixed), (spread(mixed), spread(unmixed))
    assert sum(r[2] for r in results) == pytest.approx(n, abs=1e-9)


def test_overflowed_steps_keep_models_identical_under_gradient_averaging():
    """One node's scaled gradients overflow at step 2: it contributes zeros and applies the same
    average as everyone; the models stay bit-identical and only its scaler backs off."""
    def body(rank, comm):
        model = net()
        opt = p2ptrain.DecentralizedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model=model,
                                              algorithm=AllReduceSGD(comm, average="gradients"), comm=comm)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
        for step in range(4):
            x, y = batch(rank, step)
            loss = F.mse_loss(model(x), y) * (float("inf") if rank == 1 and step == 2 else 1.0)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
        opt.finish()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), opt.skipped_steps, scaler.get_scale()

    results = run_cluster(N, body, options=OPTIONS)
    assert all(torch.equal(r[0], results[0][0]) for r in results)
    assert torch.isfinite(results[0][0]).all()
    assert [r[1] for r in results] == [0, 1, 0]
    assert results[1][2] < results[0][2]


def test_mixed_dtype_models_are_grouped_per_dtype():
    def body(rank, comm):
        with _INIT:
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(DIM, 4), nn.Linear(4, 1).to(torch.bfloat16))
        opt = p2ptrain.DecentralizedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                                              algorithm=AllReduceSGD(comm), comm=comm)
        for step in range(3):
            x, y = batch(rank, step)
            out = model[1](model[0](x).to(torch.bfloat16)).float().squeeze(1)
            F.mse_loss(out, y).backward()
            opt.step()
            opt.zero_grad()
        opt.finish()
        return model[0].weight.detach().clone(), model[1].weight.detach().clone()

    results = run_cluster(N, body, options=OPTIONS)
    assert results[0][1].dtype == torch.bfloat16
    for first, second in results[1:]:
        assert torch.equal(first, results[0][0]) and torch.equal(second, results[0][1])


def test_non_persistent_buffers_are_constants_not_state():
    """A causal mask registered with persistent=False (full of -inf) is neither exchanged nor checked;
    BatchNorm's running statistics are, and integer buffers stay local."""
    from p2ptrain.train.state import ModelState

    model = net()
    model.register_buffer("mask", torch.full((4, 4), float("-inf")).triu(1), persistent=False)
    state = ModelState(model)
    assert state.num_buffers == 2 * 8  # running_mean + running_var, not the mask, not num_batches_tracked
    assert torch.isfinite(state.vector()).all()
    state.load(state.vector() + 1.0)
    assert torch.equal(model.mask, torch.full((4, 4), float("-inf")).triu(1))


def test_clear_errors_at_construction():
    model, other = net(), net(1)
    with pytest.raises(RuntimeError, match=r"call p2ptrain.init\(\) first"):
        p2ptrain.DecentralizedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    with pytest.raises(ValueError, match="not parameters of the model"):
        p2ptrain.DecentralizedOptimizer(torch.optim.SGD(other.parameters(), lr=0.1), model=model,
                                        algorithm=AllReduceSGD(None))
    with pytest.raises(TypeError, match="wraps a torch.optim.Optimizer"):
        p2ptrain.DecentralizedOptimizer("sgd", model=model, algorithm=AllReduceSGD(None))
    split = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))
    with pytest.raises(ValueError, match="several devices"):
        p2ptrain.DecentralizedOptimizer(torch.optim.SGD(split.parameters(), lr=0.1), model=split,
                                        algorithm=AllReduceSGD(None))


def _resumable(algorithm_of):
    """A body running steps [start, stop) of a deterministic run, saving or loading a checkpoint."""
    def run(rank, comm, *, start, stop, checkpoints, save):
        model = net()
        opt = p2ptrain.DecentralizedOptimizer(adamw(model), model=model, algorithm=algorithm_of(comm), comm=comm)
        if start:
            saved = checkpoints[rank]
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["optimizer"])
        times = []
        for step in range(start, stop):
            began = time.monotonic()
            user_loop(model, opt, rank, step + 1, start=step, accumulate=1)
            times.append(time.monotonic() - began)
        if save:
            checkpoints[rank] = {"model": copy.deepcopy(model.state_dict()), "optimizer": opt.state_dict()}
        opt.finish()
        rejected = sum(s.value for m in comm.transport.metrics.registry.collect() for s in m.samples
                       if s.name == "p2ptrain_rejected_messages_total")
        return copy.deepcopy(model.state_dict()), times, getattr(opt.algorithm, "w", 1.0), rejected
    return run


@pytest.mark.parametrize("algorithm", ["allreduce", "allreduce-overlap", "sgp"])
def test_stop_and_resume_from_checkpoints_continues_the_run(algorithm):
    """A cluster stopped at step 5 and restarted from its checkpoints: all-reduce ends identical to
    the uninterrupted run (with overlap=1 the checkpoint carries the correction of the mean still
    in flight); SGP keeps Σ w = n; no resumed step stalls or sees a refused message."""
    steps, stop = 10, 5
    algorithm_of = {"allreduce": lambda comm: AllReduceSGD(comm),
                    "allreduce-overlap": lambda comm: AllReduceSGD(comm, average="models", overlap=1),
                    "sgp": lambda comm: SGP(comm, build_topology("exponential", N), overlap=1)}[algorithm]
    body = _resumable(algorithm_of)
    whole = run_cluster(N, lambda r, c: body(r, c, start=0, stop=steps, checkpoints={}, save=False),
                        options=OPTIONS, metrics=True)
    checkpoints: dict = {}
    first = run_cluster(N, lambda r, c: body(r, c, start=0, stop=stop, checkpoints=checkpoints, save=True),
                        options=OPTIONS, metrics=True)
    resumed = run_cluster(N, lambda r, c: body(r, c, start=stop, stop=steps, checkpoints=checkpoints, save=False),
                          options=OPTIONS, metrics=True)
    assert all(r[3] == 0 for r in first + resumed), "a message was refused around the resume"
    slowest_before = max(max(r[1]) for r in first)
    assert max(max(r[1]) for r in resumed) < max(2.0, 3 * slowest_before), "a resumed step stalled"
    if algorithm.startswith("allreduce"):
        for (state, *_), (expected, *_) in zip(resumed, whole):
            for key, value in expected.items():
                torch.testing.assert_close(state[key].float(), value.float(), rtol=1e-6, atol=1e-6, msg=key)
    else:
        assert sum(r[2] for r in resumed) == pytest.approx(N, abs=1e-9)
        assert sum(c["optimizer"]["algorithm"]["w"] for c in checkpoints.values()) == pytest.approx(N, abs=1e-9)


def test_evaluate_takes_the_users_loss_and_metric():
    """No silent default loss (nll_loss on raw scores went to -2.9e11); regression models pass
    metric=None; the model is left in eval mode, as documented."""
    model = nn.Linear(3, 1)
    loader = [(torch.randn(8, 3), torch.randn(8, 1)) for _ in range(3)]
    with pytest.raises(TypeError, match="loss_fn"):
        p2ptrain.evaluate(model, loader)
    loss, metric = p2ptrain.evaluate(model, loader, loss_fn=F.mse_loss, metric=None)
    expected = sum(F.mse_loss(model(x), y).item() for x, y in loader) / 3
    assert loss == pytest.approx(expected, rel=1e-6) and metric != metric  # NaN: no metric asked for
    assert not model.training
    classifier = nn.Linear(3, 4)
    batches = [(torch.randn(10, 3), torch.randint(0, 4, (10,))) for _ in range(2)]
    _, top1 = p2ptrain.evaluate(classifier, batches, loss_fn=F.cross_entropy)
    assert top1 == pytest.approx(sum((classifier(x).argmax(1) == y).float().mean().item() for x, y in batches) / 2)
    _, custom = p2ptrain.evaluate(classifier, batches, loss_fn=F.cross_entropy,
                                  metric=lambda out, y: (out.argmax(1) != y).float().mean())
    assert custom == pytest.approx(1 - top1)


@pytest.mark.parametrize("algorithm", ["allreduce", "pipesgd"])
def test_gradient_algorithms_apply_the_exact_mean_through_the_engines_gradient_buffer(algorithm):
    """The engine hands an algorithm its one flat gradient buffer (the .grad views); AllReduce
    applies each step's mean, Pipe-SGD the previous step's (its ring still reads step t's gradient
    while step t+1 rewrites that buffer). A linear loss has gradients that do not depend on the
    model, so the final weights are known exactly: w0 - lr * Σ of the applied means."""
    from p2ptrain.algorithms.pipesgd import PipeSGD

    n, dim, steps, lr = 3, 8, 6, 0.1

    def gradient(rank: int, step: int) -> torch.Tensor:
        return torch.arange(dim, dtype=torch.float32) * (rank + 1) + step

    def body(rank, comm):
        model = nn.Linear(dim, 1, bias=False)
        with torch.no_grad():
            model.weight.fill_(1.0)
        algo = AllReduceSGD(comm) if algorithm == "allreduce" else PipeSGD(comm)
        opt = p2ptrain.DecentralizedOptimizer(torch.optim.SGD(model.parameters(), lr=lr), model=model,
                                              algorithm=algo, comm=comm)
        for step in range(steps):
            model(gradient(rank, step).unsqueeze(0)).sum().backward()  # d loss / d w = gradient(rank, step)
            opt.step()
            opt.zero_grad(set_to_none=True)
        opt.finish()
        return model.weight.detach().reshape(-1).clone()

    results = run_cluster(n, body, options=OPTIONS)
    applied = range(steps) if algorithm == "allreduce" else range(steps - 1)  # Pipe-SGD: one step stale
    mean = lambda step: sum(gradient(r, step) for r in range(n)) / n  # noqa: E731
    expected = torch.ones(dim) - lr * sum(mean(step) for step in applied)
    for weights in results:
        torch.testing.assert_close(weights, expected, rtol=0, atol=1e-5)


class _KeepModel(Algorithm):
    """No peers: the model after the local step is the next step's (what checks see, isolated)."""
    name = "keep"

    def setup(self, params):
        return params

    def after_step(self, step, params):
        return params


def test_the_trainer_sums_the_model_once_a_step_and_still_catches_a_nan_put_in_between(monkeypatch):
    """The loss check before backward skips the model pass step() made at the end of the step
    before (the same model): one pass over the model per step, not two. A NaN put into the model
    between steps, or loaded with a checkpoint, is still caught."""
    import p2ptrain.train.optimizer as optimizer_module
    from p2ptrain.train.errors import NonFiniteError
    from p2ptrain.train.trainer import DecentralizedTrainer

    passes = []
    real = optimizer_module.all_finite
    monkeypatch.setattr(optimizer_module, "all_finite", lambda values: passes.append(1) or real(values))
    model = net()
    trainer = DecentralizedTrainer(model, torch.optim.SGD(model.parameters(), lr=0.01), _KeepModel(),
                                   loss_fn=F.mse_loss)
    for step in range(5):
        trainer.train_step(*batch(0, step))
    assert len(passes) == 5 + 1  # step() every step, the loss check only at the first step

    checkpoint = trainer.optimizer.state_dict()
    trainer.optimizer.load_state_dict(checkpoint)
    passes.clear()
    trainer.train_step(*batch(0, 5))
    assert len(passes) == 2  # a loaded model is checked at its first loss check again

    with torch.no_grad():
        model[3].bias.fill_(float("nan"))  # the loss turns NaN: caught at once
    with pytest.raises(NonFiniteError, match="loss"):
        trainer.train_step(*batch(0, 6))
    model = net()
    trainer = DecentralizedTrainer(model, torch.optim.SGD(model.parameters(), lr=0.0), _KeepModel(),
                                   loss_fn=F.mse_loss)
    trainer.train_step(*batch(0, 0))
    with torch.no_grad():
        model[1].running_var[0] = float("inf")  # (train mode normalizes by the batch: the loss stays finite)
    with pytest.raises(NonFiniteError, match="model"):
        trainer.train_step(*batch(0, 1))  # step()'s check at the end of this step
