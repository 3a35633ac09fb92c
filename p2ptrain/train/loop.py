"""The training engine: local steps on the de-biased model, the algorithm's hook after each.

This is also the public Python API: hand in any torch model, optimizer, batches and an algorithm
(see examples/). The engine owns the loop and timing; the algorithm owns communication math.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from p2ptrain.train.device import pick_device  # noqa: F401 (re-exported: p2ptrain.train.pick_device)
from p2ptrain.train.evaluate import evaluate
from p2ptrain.train.flat import FlatParameters
from p2ptrain.transport.runtime import PeerError

log = logging.getLogger(__name__)


class NonFiniteError(FloatingPointError):
    """The loss or the model became NaN/Inf at `step`: the run has failed (the summary says where)."""

    def __init__(self, rank: int, step: int, what: str):
        super().__init__(f"node {rank}: non-finite {what} at step {step}")
        self.rank, self.step, self.what = rank, step, what


@dataclass
class StepRecord:
    step: int
    loss: float
    seconds: float


@dataclass
class TrainResult:
    steps: int
    losses: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    snapshots: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def final_loss(self) -> float:
        tail = self.losses[-10:]
        return sum(tail) / len(tail) if tail else math.nan

    @property
    def mean_step_seconds(self) -> float:
        return sum(self.step_seconds) / len(self.step_seconds) if self.step_seconds else math.nan

    @property
    def steady_step_seconds(self) -> float:
        """Mean step time without the first 10% of steps (at least 1, at most 10): connection
        set-up, allocator and cache warm-up land there, not in the steady state."""
        skip = min(10, max(1, len(self.step_seconds) // 10)) if len(self.step_seconds) > 1 else 0
        tail = self.step_seconds[skip:]
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
    """Runs `steps` local SGD steps with the algorithm's hooks (see p2ptrain.algorithms.base)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, algorithm, *,
                 loss_fn: Callable = F.nll_loss, device: torch.device | str | None = None, metrics=None,
                 slowdown: float = 1.0, inject_nan_at: int | None = None, comm=None):
        if not slowdown >= 1.0:
            raise ValueError(f"slowdown must be >= 1 (1 = full speed), got {slowdown}")
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.model = model.to(self.device)
        self.flat = FlatParameters(self.model)
        self.optimizer = optimizer
        self.algorithm = algorithm
        self.loss_fn = loss_fn
        self.metrics = metrics
        self.slowdown = slowdown
        self.inject_nan_at = inject_nan_at  # fault injection: make the loss NaN at this step (tests)
        self.start_step = 0
        self.catch_ups = 0            # state transfers taken after stalling (see _catch_up)
        self._catch_up_after = 0      # no new catch-up attempt before this step (after a failed one)
        self._directions: torch.Tensor | None = None
        self.comm = comm  # the node's Communicator: rejoining, catching up and serving joiners need it
        comm = self.comm
        if comm is not None and comm.joining:  # a restarted node: resume from a live peer's state
            params = self.flat.get()
            state = comm.fetch_state(params.numel(), params.dtype)
            self.flat.load(state.tensor)
            self.start_step = state.step + 1
        self.flat.load(self.algorithm.setup(self.flat.get()))
        self._adopt_late_states()

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.device, non_blocking=True)

    def train_step(self, step: int, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        started = time.perf_counter()
        self.model.train()
        inputs, targets = self._to_device(inputs), self._to_device(targets)
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model(inputs), targets)
        if step == self.inject_nan_at:
            loss = loss * float("nan")
        loss.backward()
        if self.slowdown > 1.0:  # emulate a slower machine: stretch this step's compute
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            time.sleep((self.slowdown - 1.0) * (time.perf_counter() - started))
        if self.algorithm.uses_gradients:
            grads = self.algorithm.reduce_gradients(step, self.flat.grads())
            if grads is None:  # e.g. the first pipelined Pipe-SGD step: nothing aggregated yet
                self.flat.load(self.algorithm.after_step(step, self.flat.get()))
                return float(loss.detach())
            self.flat.load_grads(grads)
        self.optimizer.step()
        self.flat.load(self.algorithm.after_step(step, self.flat.get()))
        self._serve_joiners(step)
        return float(loss.detach())

    def _catch_up(self, step: int) -> int:
        """After step `step`: if this node stalled (a peer excluded it, or it trails the cluster by
        more than the lag limit), take a state transfer from a peer that saw it leave and merge it
        (Algorithm.adopt_state); returns the step to continue at."""
        comm = self.comm
        if comm is None or step < self._catch_up_after or not comm.must_catch_up():
            return step + 1
        params = self.flat.get()
        timeout = max(5.0, 3 * comm.transport.options.link_deadline)
        log.warning("node %d: fell behind at step %d (excluded by %s, %d steps behind the cluster); catching up",
                    comm.rank, step, sorted(comm.transport.membership.excluded_by()),
                    comm.transport.membership.behind())
        try:
            state = comm.fetch_state(params.numel(), params.dtype, timeout=timeout)
        except (PeerError, TimeoutError) as exc:  # e.g. the others have finished: train on alone
            log.warning("node %d: could not catch up (%s); training on from step %d", comm.rank, exc, step + 1)
            comm.transport.membership.rejoined()
            self._catch_up_after = step + comm.transport.options.max_lag
            return step + 1
        self.flat.load(self.algorithm.adopt_state(state, self.flat.get()))
        self._adopt_late_states()
        self.catch_ups += 1
        self._check_finite(state.step, "model after catching up")
        return max(step + 1, state.step + 1)

    def _adopt_late_states(self) -> None:
        """States that reached us while rejoining besides the one used (an earlier donor answered
        late): for push-sum they are mass, merged like the first."""
        comm = self.comm
        while comm is not None and comm.late_states:
            self.flat.load(self.algorithm.adopt_state(comm.late_states.pop(0), self.flat.get()))

    def _check_finite(self, step: int, what: str, loss: float | None = None) -> None:
        if loss is not None and not math.isfinite(loss):
            raise NonFiniteError(self.comm.rank if self.comm is not None else 0, step, "loss")
        if not bool(torch.isfinite(self.flat.get()).all()):
            raise NonFiniteError(self.comm.rank if self.comm is not None else 0, step, what)

    def _serve_joiners(self, step: int) -> None:
        """Give (re)joining peers this node's state, at a step boundary where it is consistent."""
        comm = self.comm
        if comm is None:
            return
        for peer in comm.state_requests():
            changed = self.algorithm.donate_state(peer, step, self.flat.get())
            if changed is not None:
                self.flat.load(changed)
            if self.metrics is not None:
                self.metrics.on_state_transfer(peer)
            log.info("step %d: sent this node's state to rejoining peer %d", step, peer)

    def model_projection(self, directions: int = 4) -> list[float]:
        """<params, v_k> for fixed Gaussian directions v_k (seeded, identical on every node): for two
        nodes, E[(<x_i, v> - <x_j, v>)^2] = |x_i - x_j|^2, so the spread across nodes estimates the
        consensus distance without moving any model (exported as p2ptrain_model_projection)."""
        params = self.flat.get().detach().float()
        if self._directions is None or self._directions.shape[0] != directions:
            generator = torch.Generator().manual_seed(20261121)
            self._directions = torch.randn(directions, params.numel(), generator=generator).to(params.device)
        return (self._directions @ params).tolist()

    def fit(self, batches: Iterable, steps: int, *,
            on_log: Callable[[StepRecord, "DecentralizedTrainer"], None] | None = None,
            log_every: int = 10, snapshot_every: int | None = None) -> TrainResult:
        """Train for `steps`; `on_log` is called every `log_every` steps and at the end; the de-biased
        flat model is snapshotted at step 0, every `snapshot_every` steps and at the end."""
        result = TrainResult(steps=steps)
        snapshot_every = snapshot_every or log_every
        result.snapshots[self.start_step] = self.flat.get().detach().cpu().clone()
        iterator = iter(batches)
        step = self.start_step
        while step < steps:
            start = time.perf_counter()
            inputs, targets = next(iterator)
            loss = self.train_step(step, inputs, targets)
            self._check_finite(step, "model", loss)
            next_step = self._catch_up(step) if step + 1 < steps else steps
            seconds = time.perf_counter() - start
            result.losses.append(loss)
            result.step_seconds.append(seconds)
            if self.metrics is not None:
                self.metrics.on_step(step + 1, seconds, loss)
                for key, value in self.algorithm.stats().items():
                    if key == "ps_weight":
                        self.metrics.set_ps_weight(value)
            done = step + 1
            last = next_step >= steps  # (a catch-up may jump past the end)
            if last:
                final = self.algorithm.finish()
                if final is not None:
                    self.flat.load(final)
                self._check_finite(done, "final model")
            if done % snapshot_every == 0 or last:
                result.snapshots[done] = self.flat.get().detach().cpu().clone()
            if self.metrics is not None and (done % log_every == 0 or last):
                self.metrics.set_model_projection(self.model_projection())
            if on_log is not None and (done % log_every == 0 or last):
                window = result.losses[-log_every:]
                on_log(StepRecord(done, sum(window) / len(window), seconds), self)
            step = next_step
        return result

    def evaluate(self, loader: Iterable) -> tuple[float, float]:
        """(mean loss, accuracy) of the current (de-biased) model on `loader`."""
        test_loss, accuracy = evaluate(self.model, loader, self.device, loss_fn=self.loss_fn)
        if math.isnan(accuracy):
            raise ValueError("evaluation set is empty")
        return test_loss, accuracy
