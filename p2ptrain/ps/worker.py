"""Asynchronous parameter-server workers (seed 001, Algorithm 1) and the proxy they are compared to.

    m ← 0;  s ← Pull()
    loop:   Δθ ← −η ∇L(s);   θ ← Pull();   Commit(Ψ(Δθ));   s ← θ

Ψ is p2ptrain.algorithms.gem's rule for `--ps-policy` gem | downpour | adaptive-staleness. Each
commit carries the version of s (the θ its gradient was computed at), so the server's staleness τ
counts every commit applied since then, this worker's own previous one included (run_worker).
`--ps-policy proxy` is the target dynamics the workers are matched to (run_proxy). Both write what
`p2ptrain node` writes, plus the mean staleness τ and median π (_Report).
"""
from __future__ import annotations

import logging
import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.algorithms.gem import build_rule, parse_clamp
from p2ptrain.ps.client import PsClient, PsError
from p2ptrain.ps.server import ps_fingerprint
from p2ptrain.train.evaluate import evaluate
from p2ptrain.train.progress import RunRecorder
from p2ptrain.train.setup import training_setup
from p2ptrain.train.state import ModelState
from p2ptrain.train.trainer import cycle
from p2ptrain.transport.security import security_from_settings

log = logging.getLogger(__name__)


def _training_setup(config):
    """Data shard, loaders, model and device of worker `rank`, exactly as `p2ptrain node` builds them."""
    torch.set_num_threads(config.threads)
    return training_setup(config)


class _Report:
    """Progress lines, summary and snapshots in the launcher's format (p2ptrain.train.progress),
    plus the worker's own: mean staleness τ and median π over the last log_every steps. Written
    like `p2ptrain node`'s: OUT/node{rank}.progress.jsonl (step, time, loss, bytes, plus staleness
    = mean τ and pi_median over the last log_every steps), OUT/node{rank}.json and
    OUT/node{rank}.snapshots.pt (the worker's s every log_every steps)."""

    def __init__(self, config):
        self.config = config
        self.policy = config.algorithm_options.ps_policy
        out = Path(config.out) if config.out else None
        if out:
            out.mkdir(parents=True, exist_ok=True)
        self.recorder = RunRecorder(out, f"node{config.rank}", rank=config.rank, log_every=config.log_every)
        self.staleness: list[float] = []
        self.pi: list[float] = []

    def step(self, step: int, loss: float, seconds: float, staleness: float, pi: float, model: torch.Tensor,
             **extra) -> None:
        """Record finished step `step` (1-based) with the worker's model; a progress line every
        log_every steps."""
        self.staleness.append(staleness)
        self.pi.append(pi)
        every = self.config.log_every
        self.recorder.report(step, loss=loss)
        self.recorder.step_done(step, seconds, model, staleness=_mean(self.staleness[-every:]),
                                pi_median=_median(self.pi[-every:]), **extra)

    def start(self, model: torch.Tensor) -> None:
        self.recorder.snapshot(0, model)

    def finish(self, summary: dict, model: torch.Tensor) -> dict:
        return self.recorder.finish({"rank": self.config.rank, "role": "worker", "policy": self.policy,
                                     **self.recorder.summary(), "steps": self.config.steps,
                                     "mean_staleness": _mean(self.staleness), "pi_median": _median(self.pi),
                                     **summary}, model=model)

    def error(self, exc: BaseException) -> None:
        self.recorder.event("error", message=f"{type(exc).__name__}: {exc}")

    def close(self) -> None:
        self.recorder.close()


def run_worker(config) -> dict:
    """Worker `rank` of `world_size` against the parameter server at `ps_address` (Algorithm 1);
    `--ps-policy proxy` runs run_proxy instead. Returns (and writes) the summary.

    Each commit carries the version of s, so the server's staleness τ counts every commit applied
    since then, including this worker's own previous one (s was pulled before it was applied: with
    one worker τ = 1). The authors' code instead evaluates the next gradient at θ + the worker's
    own update; we follow Algorithm 1 as written."""
    options = config.algorithm_options
    if options.ps_policy == "proxy":
        return run_proxy(config)
    from p2ptrain.metrics import WorkerMetrics

    report = _Report(config)
    metrics_server = None
    client = None
    try:
        loader, test_loader, model, device = _training_setup(config)
        rule = build_rule(options.ps_policy, kappa=options.gem_kappa, momentum=config.momentum,
                          epsilon=options.gem_epsilon, clamp=parse_clamp(options.gem_clamp))
        scaling = pb.COMMIT_SCALING_STALENESS if rule.server_scales_by_staleness else pb.COMMIT_SCALING_NONE
        metrics = WorkerMetrics(config.rank, algorithm=options.ps_policy)
        metrics_port = None
        if config.metrics_port is not None:
            metrics_server, _ = metrics.serve(config.metrics_port, addr=config.metrics_bind_host)
            metrics_port = metrics_server.server_port
        client = PsClient(config.ps_address, config.rank, chunk_bytes=config.chunk_bytes,
                          fingerprint=ps_fingerprint(config), timeout=config.peer_timeout,
                          security=security_from_settings(config.security))
        flat = ModelState(model, buffers=False)  # θ is the parameters alone
        nbytes = flat.numel * 4
        host = torch.empty(flat.numel, dtype=torch.float32, pin_memory=device.type == "cuda")
        theta = host if device.type == "cpu" else torch.empty(flat.numel, dtype=torch.float32, device=device)
        lr, wd = config.learning_rate, config.weight_decay

        def pull() -> int:
            _, version = client.pull(host)
            metrics.on_received("ps", nbytes)
            if theta is not host:
                theta.copy_(host, non_blocking=True)
            return version

        s_version = pull()  # s ← Pull()
        flat.load(theta)
        s = flat.vector()  # s is the model's own flat buffer: the gradient below is ∇L(s)
        report.start(s)
        batches = iter(cycle(loader))
        rejected = 0
        version = s_version
        for step in range(config.steps):
            started = time.perf_counter()
            inputs, targets = next(batches)
            inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            model.train()
            model.zero_grad(set_to_none=True)
            loss = F.nll_loss(model(inputs), targets)
            loss.backward()
            delta = flat.gradient_vector()
            if wd:
                delta.add_(s, alpha=wd)
            delta.mul_(-lr)  # Δθ ← −η ∇L(s)
            version = pull()  # θ ← Pull()
            update, pi = rule(delta, theta, s)
            reply = client.commit(update.to("cpu", torch.float32).contiguous(), s_version, scaling=scaling)
            if reply.ack.status == pb.Ack.STATUS_REJECTED:
                if reply.ack.reason != "non_finite":  # anything else is a bug or a misconfiguration
                    raise PsError(f"worker {config.rank}: the parameter server rejected a commit: "
                                  f"{reply.ack.reason}: {reply.ack.detail}", reply.ack.reason)
                rejected += 1  # a diverged worker: its NaN/Inf update is dropped, θ stays finite
                if rejected == 1 or rejected % 100 == 0:
                    log.warning("worker %d: %d non-finite updates rejected (diverging?)", config.rank, rejected)
                staleness = math.nan
            else:
                metrics.on_sent("ps", nbytes)
                staleness = reply.staleness
                if rule.server_scales_by_staleness:
                    pi = reply.scale
                metrics.on_commit(pi, staleness)
            flat.load(theta)  # s ← θ
            s_version = version
            seconds = time.perf_counter() - started
            loss_value = float(loss.detach())
            metrics.on_step(step + 1, seconds, loss_value)
            report.step(step + 1, loss_value, seconds, staleness, pi, s, version=version,
                        bytes_sent=metrics.bytes_sent_total, bytes_received=metrics.bytes_received_total,
                        rejected=rejected)
        final_version = pull()  # evaluate the central variable as it is when this worker stops
        flat.load(theta)
        client.done(config.steps)
        test_loss, test_accuracy = evaluate(model, test_loader, device, loss_fn=F.nll_loss)
        return report.finish({
            "test_accuracy": test_accuracy, "test_loss": test_loss, "final_version": final_version,
            "commits": config.steps - rejected, "rejected_commits": rejected,
            "bytes_sent": metrics.bytes_sent_total, "bytes_received": metrics.bytes_received_total,
            "device": device.type, "metrics_port": metrics_port, "ps_address": config.ps_address,
        }, s)
    except BaseException as exc:
        report.error(exc)
        raise
    finally:
        if client is not None:
            client.close()
        if metrics_server is not None:
            metrics_server.shutdown()
        report.close()


def run_proxy(config) -> dict:
    """The target proxy: momentum SGD (η = lr, μ = momentum) on this one process, no server.

    It is the target dynamics the workers are matched to (§3.1, eq. 14): synchronous momentum SGD,
    torch.optim.SGD(lr=η, momentum=μ), on one process with batch --batch-size (the worker batch b
    the proxy energy is estimated from, eq. 23; pass --batch-size n·b for the paper's large-batch
    comparison B = n·b). It needs no parameter server and writes the same files."""
    from p2ptrain.metrics import NodeMetrics

    report = _Report(config)
    metrics_server = None
    try:
        loader, test_loader, model, device = _training_setup(config)
        metrics = NodeMetrics(config.rank, algorithm="proxy")
        metrics_port = None
        if config.metrics_port is not None:
            metrics_server, _ = metrics.serve(config.metrics_port, addr=config.metrics_bind_host)
            metrics_port = metrics_server.server_port
        optimizer = torch.optim.SGD(model.parameters(), lr=config.learning_rate, momentum=config.momentum,
                                    weight_decay=config.weight_decay)
        flat = ModelState(model, buffers=False)  # θ is the parameters alone
        report.start(flat.vector())
        batches = iter(cycle(loader))
        for step in range(config.steps):
            started = time.perf_counter()
            inputs, targets = next(batches)
            inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            model.train()
            optimizer.zero_grad(set_to_none=True)
            loss = F.nll_loss(model(inputs), targets)
            loss.backward()
            optimizer.step()
            seconds = time.perf_counter() - started
            loss_value = float(loss.detach())
            metrics.on_step(step + 1, seconds, loss_value)
            report.step(step + 1, loss_value, seconds, 0.0, math.nan, flat.vector(), version=step + 1, bytes_sent=0,
                        bytes_received=0)
        test_loss, test_accuracy = evaluate(model, test_loader, device, loss_fn=F.nll_loss)
        return report.finish({"test_accuracy": test_accuracy, "test_loss": test_loss, "bytes_sent": 0,
                              "bytes_received": 0, "device": device.type, "metrics_port": metrics_port},
                             flat.vector())
    except BaseException as exc:
        report.error(exc)
        raise
    finally:
        if metrics_server is not None:
            metrics_server.shutdown()
        report.close()


def _mean(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else math.nan


def _median(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return statistics.median(finite) if finite else math.nan


__all__ = ["run_worker", "run_proxy"]
