"""DecentralizedTrainer: a ready-made loop on top of DecentralizedOptimizer, for when you would
rather not write one (p2ptrain.DecentralizedOptimizer is the API for a loop of your own).

It runs forward, backward, optional clipping, the decentralized step, the optional LR scheduler and
AMP (a GradScaler), reports each step's loss to the node, and stops with NonFiniteError when the
loss or the model becomes NaN/Inf. It has no default loss function: you say what it minimizes.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import torch
from torch import nn

from p2ptrain.train.errors import LeftCluster
from p2ptrain.train.evaluate import evaluate
from p2ptrain.train.optimizer import DecentralizedOptimizer


@dataclass
class TrainResult:
    steps: int
    losses: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    left_at: int | None = None  # the node left the cluster (elastic run) before this step

    @property
    def final_loss(self) -> float:
        tail = self.losses[-10:]
        return sum(tail) / len(tail) if tail else math.nan


def cycle(loader: Iterable) -> Iterator:
    """Endless iteration over a DataLoader (a new shuffled epoch each pass)."""
    while True:
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise ValueError("the data loader yields no batches (empty shard?)")


class DecentralizedTrainer:
    """`steps` decentralized steps of `model` with `optimizer` (a torch optimizer, wrapped here)
    minimizing `loss_fn(model(inputs), targets)`. `node` (from p2ptrain.init()) supplies the
    algorithm and records progress; or pass `algorithm` and `comm` directly (in-process tests)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, algorithm=None, *,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], node=None, comm=None,
                 device: torch.device | str | None = None, metrics=None,
                 slowdown: float | Callable[[int], float] = 1.0,
                 inject_nan_at: int | None = None, clip_grad_norm: float | None = None,
                 scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
                 grad_scaler: torch.amp.GradScaler | None = None, sync_buffers: bool = True):
        if not callable(slowdown) and not slowdown >= 1.0:
            raise ValueError(f"slowdown must be >= 1 (1 = full speed), got {slowdown}")
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.model = model.to(self.device)
        self.loss_fn = loss_fn
        self.optimizer = DecentralizedOptimizer(optimizer, model=self.model, node=node, algorithm=algorithm, comm=comm,
                                                metrics=metrics, sync_buffers=sync_buffers)
        self.node = node
        # emulate a slower machine: a factor, or step -> factor (slow windows, launch --slow)
        self.slowdown = slowdown
        self.inject_nan_at = inject_nan_at  # fault injection: make the loss NaN at this step (tests)
        self.clip_grad_norm = clip_grad_norm
        self.scheduler = scheduler
        self.grad_scaler = grad_scaler

    @property
    def algorithm(self):
        return self.optimizer.algorithm

    @property
    def start_step(self) -> int:
        return self.optimizer.start_step

    @property
    def catch_ups(self) -> int:
        return self.optimizer.catch_ups

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """One step at the optimizer's current step; returns the loss."""
        step = self.optimizer.local_step
        started = self._compute_clock()
        self.model.train()
        inputs = inputs.to(self.device, non_blocking=True)
        targets = targets.to(self.device, non_blocking=True)
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, enabled=self.grad_scaler is not None and self.grad_scaler.is_enabled()):
            loss = self.loss_fn(self.model(inputs), targets)
        if step == self.inject_nan_at:
            loss = loss * float("nan")
        value = float(loss.detach())
        self.optimizer.check_finite(step, "loss", value)
        if self.grad_scaler is not None:
            self.grad_scaler.scale(loss).backward()
        else:
            loss.backward()
        slowdown = self.slowdown(step) if callable(self.slowdown) else self.slowdown
        if slowdown > 1.0:  # emulate a slower machine: stretch this step's compute
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            time.sleep((slowdown - 1.0) * (self._compute_clock() - started))
        if self.clip_grad_norm is not None:
            if self.grad_scaler is not None:
                self.grad_scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_grad_norm)
        if self.grad_scaler is not None:
            self.grad_scaler.step(self.optimizer)
            self.grad_scaler.update()
        else:
            self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        if self.node is not None:
            self.node.report(step + 1, loss=value)
        return value

    def _compute_clock(self) -> float:
        """What --slowdown stretches: this thread's CPU time on CPU (a stall, e.g. SIGSTOP, is
        not compute, and stretching it would make a 4 s stall last 12 s), wall time on CUDA."""
        return time.perf_counter() if self.device.type == "cuda" else time.thread_time()

    def fit(self, batches: Iterable, steps: int, *, after_step: Callable[[int], object] | None = None) -> TrainResult:
        """Train until the optimizer has done `steps` steps (a catch-up after a stall may skip some),
        then finish() it (in-flight communication flushed). `after_step(n)` runs after each step
        with the number of steps done (e.g. an evaluation every k steps)."""
        result = TrainResult(steps=steps)
        iterator = iter(batches)
        try:
            while self.optimizer.local_step < steps:
                started = time.perf_counter()
                inputs, targets = next(iterator)
                result.losses.append(self.train_step(inputs, targets))
                result.step_seconds.append(time.perf_counter() - started)
                if after_step is not None:
                    after_step(self.optimizer.local_step)
        except LeftCluster as left:  # SIGTERM in an elastic run: handed over, the others go on
            result.left_at = left.step
        self.optimizer.finish()
        return result

    def evaluate(self, loader: Iterable, *, metric: Callable | None = None) -> tuple[float, float]:
        """(mean loss, mean `metric`) of the current model on `loader` (default metric: accuracy of
        a classifier's argmax; NaN when `metric` is False)."""
        kwargs = {} if metric is None else {"metric": metric or None}
        test_loss, value = evaluate(self.model, loader, self.device, loss_fn=self.loss_fn, **kwargs)
        if math.isnan(test_loss):
            raise ValueError("evaluation set is empty")
        return test_loss, value


__all__ = ["DecentralizedTrainer", "TrainResult", "cycle"]
