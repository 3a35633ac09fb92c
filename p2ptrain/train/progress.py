"""The run folder's files, written the same way by every role (peer nodes, parameter-server workers,
the parameter server): progress lines the launcher tails, a summary, and model snapshots.

    OUT/{name}.progress.jsonl   one JSON object per line, flushed (the launcher reads it live)
    OUT/{name}.json             the summary (non-finite numbers written as null)
    OUT/{name}.snapshots.pt     {"steps": [...], "params": [n, d], "coordinates": [d, P]} flat models
                                (or a fixed sample of d of their P coordinates) for the consensus plot
"""
from __future__ import annotations

import json
import math
import os
import statistics
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Mapping

import torch

MAX_SNAPSHOTS = 32  # per node: a long run keeps every 2nd, 4th, ... snapshot, not all of them
# Larger models are snapshotted as this many coordinates, the same ones on every node (a fixed seed),
# scaled by sqrt(P / d) so distances and norms estimate the full model's: a run folder holds at most
# (MAX_SNAPSHOTS + 1) x 512 KB of snapshots per node, whatever the model.
SNAPSHOT_COORDINATES = 1 << 17
_SAMPLE_SEED = 20_250_401


class ProgressWriter:
    """Appends progress lines (JSON per line, flushed) to OUT/{name}.progress.jsonl; every record
    carries `fields` (e.g. the rank); no file when `out` is None."""

    def __init__(self, out: Path | None, name: str, **fields):
        self.fields = fields
        self._file = open(Path(out) / f"{name}.progress.jsonl", "a", buffering=1) if out else None

    def write(self, **record) -> None:
        if self._file is not None:
            self._file.write(json.dumps({**self.fields, **record}, allow_nan=True) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def finite_or_none(summary: Mapping) -> dict:
    """The summary with NaN/Inf floats as None (strict JSON)."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in summary.items()}


class SnapshotSampler:
    """The coordinates a snapshot keeps of a P-element model: all of them up to `limit`, else a
    fixed random `limit` of them (the same on every node, which all have the same P) scaled by
    sqrt(P / limit), so that squared distances between nodes are unbiased estimates of the full ones."""

    def __init__(self, limit: int = SNAPSHOT_COORDINATES):
        self.limit = limit
        self.total: int | None = None
        self._index: torch.Tensor | None = None
        self._scale = 1.0

    def __call__(self, model: torch.Tensor) -> torch.Tensor:
        flat = model.detach().reshape(-1)
        if self.total != flat.numel():
            self.total = flat.numel()
            if self.total > self.limit:
                generator = torch.Generator().manual_seed(_SAMPLE_SEED)
                self._index = torch.randperm(self.total, generator=generator)[:self.limit].sort().values
                self._scale = math.sqrt(self.total / self.limit)
            else:
                self._index, self._scale = None, 1.0
        if self._index is None:
            return flat.to("cpu", torch.float32, copy=True)
        return flat[self._index.to(flat.device)].to("cpu", torch.float32) * self._scale

    @property
    def coordinates(self) -> list[int] | None:
        """[kept, of P] once a model was seen."""
        return None if self.total is None else [min(self.total, self.limit), self.total]


class SnapshotSeries:
    """Flat-model snapshots for the consensus plot, bounded in number and size: one every `every`
    steps; when more than `max_snapshots` are held, every other one is dropped and the interval
    doubles (every node thins at the same steps, so they keep sharing steps); each is a
    SnapshotSampler sample. A final snapshot is always kept."""

    def __init__(self, every: int, max_snapshots: int = MAX_SNAPSHOTS, sample: SnapshotSampler | None = None):
        if every < 1:
            raise ValueError(f"snapshot interval must be >= 1, got {every}")
        self.every = every
        self.max_snapshots = max_snapshots
        self.sample = sample or SnapshotSampler()
        self.by_step: dict[int, torch.Tensor] = {}

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def add(self, step: int, model: torch.Tensor, final: bool = False) -> None:
        self.by_step[step] = self.sample(model)
        if len(self.by_step) > self.max_snapshots and not final:
            steps = sorted(self.by_step)
            keep = set(steps[::2])
            self.by_step = {s: t for s, t in self.by_step.items() if s in keep}
            self.every *= 2

    def copy(self) -> "SnapshotSeries":
        """A copy whose list of snapshots later additions do not change (the tensors are shared:
        they are never written)."""
        twin = SnapshotSeries(self.every, self.max_snapshots, self.sample)
        twin.by_step = dict(self.by_step)
        return twin

    def __len__(self) -> int:
        return len(self.by_step)

    def save(self, path: Path) -> None:
        steps = sorted(self.by_step)
        blob = {"steps": steps, "params": torch.stack([self.by_step[s] for s in steps])}
        if self.sample.coordinates is not None:
            blob["coordinates"] = self.sample.coordinates
        torch.save(blob, path)


def write_summary(out: Path | None, name: str, summary: Mapping, snapshots: SnapshotSeries | None = None) -> None:
    """OUT/{name}.json (and OUT/{name}.snapshots.pt when there are `snapshots`)."""
    if out is None:
        return
    out = Path(out)
    if snapshots:
        snapshots.save(out / f"{name}.snapshots.pt")
    (out / f"{name}.json").write_text(json.dumps(finite_or_none(summary), indent=2))


def percentile(values: list[float], q: int) -> float:
    """The q-th percentile (1 <= q <= 99) of `values`, linear between order statistics (as
    numpy's default); NaN when empty."""
    if len(values) < 2:
        return values[0] if values else math.nan
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


_PAGE_MB = os.sysconf("SC_PAGE_SIZE") / 2**20 if hasattr(os, "sysconf") else 4096 / 2**20


def resident_mb() -> float | None:
    """This process's resident memory (RSS) in MB now, from /proc/self/statm (one small read; a
    progress line carries it, so the chaos verdicts can tell a leak); None where there is no /proc."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return round(int(statm.read().split()[1]) * _PAGE_MB, 1)
    except (OSError, ValueError, IndexError):
        return None


def process_cpu_seconds() -> float:
    """CPU seconds (user + system, all threads) this process has used so far."""
    t = os.times()
    return t.user + t.system


class StepClock:
    """Wall and CPU time per training step: `lap()` returns what passed since the last lap (or the
    start). Work done inside `off_the_clock()` (an evaluation between steps) is charged to no step,
    so step times and CPU per step say what training costs. `cpu`: the CPU-seconds reading (default
    this process's; a trainer with helper processes passes one that adds theirs)."""

    def __init__(self, cpu: Callable[[], float] = process_cpu_seconds):
        self._read_cpu = cpu
        self.restart()

    def restart(self) -> None:
        self._wall, self._cpu = time.perf_counter(), self._read_cpu()

    def lap(self) -> tuple[float, float]:
        """(wall seconds, CPU seconds) since the last lap."""
        wall, cpu = time.perf_counter(), self._read_cpu()
        lap = (wall - self._wall, cpu - self._cpu)
        self._wall, self._cpu = wall, cpu
        return lap

    @contextmanager
    def off_the_clock(self):
        """Yields a dict that receives the block's `seconds` and `cpu_seconds` when it ends."""
        wall, cpu = time.perf_counter(), self._read_cpu()
        spent: dict[str, float] = {}
        try:
            yield spent
        finally:
            spent["seconds"] = time.perf_counter() - wall
            spent["cpu_seconds"] = self._read_cpu() - cpu
            self._wall += spent["seconds"]
            self._cpu += spent["cpu_seconds"]


class RunRecorder:
    """What one node writes while it trains: every `log_every` steps a progress line (step, time,
    the mean loss since the last line, the longest step since the last line, resident memory,
    traffic, push-sum weight); a line of their own, at their step,
    for other reported scalars (accuracy, perplexity: a value is plotted where it was measured, not
    repeated on every line after); a snapshot of the flat model for the
    consensus plot (at most MAX_SNAPSHOTS: when full, every other one is dropped and the interval
    doubles, so a 1,500-step run does not write 70 MB per node), and at the end the summary."""

    def __init__(self, out: Path | None, name: str, *, log_every: int = 10, max_snapshots: int = MAX_SNAPSHOTS,
                 **fields):
        self.out, self.name, self.log_every, self.max_snapshots = (Path(out) if out else None), name, log_every, \
            max_snapshots
        self.progress = ProgressWriter(self.out, name, **fields)
        self.scalars: dict[str, float] = {}       # the latest value of every reported scalar
        self.losses: list[float] = []             # every reported loss, for the summary
        self.step_seconds: list[float] = []
        self.step_cpu_seconds: list[float] = []
        self.interval_max_seconds = 0.0  # the longest step since the last progress line
        self.training_started: float | None = None  # unix time the first recorded step began
        self.snapshots = SnapshotSeries(log_every, max_snapshots)
        self.started = time.time()
        self.last_step = 0
        self.last_stats: dict = {}

    def report(self, step: int, *, line: Mapping | None = None, **scalars: float) -> None:
        """Scalars of `step` (loss, accuracy, perplexity, ...): shown in the next progress line and
        the summary; losses are also averaged over the last ones. `line`: more fields for this
        scalar line only (e.g. how long an evaluation took), not scalars of the run."""
        values = {k: float(v) for k, v in scalars.items()}
        self.scalars.update(values)
        if "loss" in values:
            self.losses.append(values.pop("loss"))
        if values:
            self.progress.write(step=step, time=time.time(), **values, **(line or {}))

    def step_done(self, step: int, seconds: float, model: torch.Tensor | None, *, cpu_seconds: float | None = None,
                  **stats) -> None:
        """Step `step` (1-based count of steps done) took `seconds` (and `cpu_seconds` of this
        process's CPU); `stats` go into the line."""
        if self.training_started is None:
            self.training_started = time.time() - seconds
        self.last_step, self.last_stats = step, stats
        self.step_seconds.append(seconds)
        self.interval_max_seconds = max(self.interval_max_seconds, seconds)
        if cpu_seconds is not None:
            self.step_cpu_seconds.append(cpu_seconds)
        if model is not None and self.snapshots.due(step):
            self.snapshots.add(step, model)
        if step % self.log_every == 0:
            self.write_line(step, seconds, **stats)

    def write_line(self, step: int, seconds: float, **stats) -> None:
        window = self.losses[-self.log_every:]
        line = {"step": step, "time": time.time(), "step_seconds": seconds,
                "max_step_seconds": max(self.interval_max_seconds, seconds), "rss_mb": resident_mb(), **stats}
        self.interval_max_seconds = 0.0
        if window:
            line["loss"] = sum(window) / len(window)
        self.progress.write(**line)

    def event(self, event: str, **fields) -> None:
        self.progress.write(event=event, **fields)

    def summary(self) -> dict:
        """What the run measured: the last value of every scalar, the mean of the last 10 losses,
        step times (all, and without the first 10%: connection set-up and warm-up land there; mean,
        median, 95th percentile and maximum), CPU seconds per step (without the first 10%), when
        training began."""
        tail = self.losses[-10:]
        seconds = self.step_seconds
        skip = min(10, max(1, len(seconds) // 10)) if len(seconds) > 1 else 0
        steady = seconds[skip:]
        steady_cpu = self.step_cpu_seconds[skip:] if len(self.step_cpu_seconds) > 1 else self.step_cpu_seconds
        return {**self.scalars, "reported": sorted(self.scalars), "steps": self.last_step,
                "final_loss": sum(tail) / len(tail) if tail else math.nan,
                "mean_step_seconds": sum(seconds) / len(seconds) if seconds else math.nan,
                "steady_step_seconds": sum(steady) / len(steady) if steady else math.nan,
                "median_step_seconds": statistics.median(steady) if steady else math.nan,
                "p95_step_seconds": percentile(steady, 95),
                "max_step_seconds": max(steady) if steady else math.nan,
                "cpu_seconds_per_step": sum(steady_cpu) / len(steady_cpu) if steady_cpu else math.nan,
                "training_started": self.training_started,
                "wall_seconds": time.time() - self.started}

    def finish(self, summary: Mapping, model: torch.Tensor | None = None, **final_stats) -> dict:
        """Write OUT/{name}.json (+ snapshots, the final model included) and the 'done' event; the
        last progress line shows the last step with `final_stats` (e.g. the weight once flushed)."""
        if self.step_seconds and (final_stats or self.last_step % self.log_every):
            self.write_line(self.last_step, self.step_seconds[-1], **{**self.last_stats, **final_stats})
        if model is not None:
            self.snapshots.add(self.last_step, model, final=True)
        write_summary(self.out, self.name, summary, self.snapshots)
        self.event("done")
        return finite_or_none(summary)

    def close(self) -> None:
        self.progress.close()

    def snapshot(self, step: int, model: torch.Tensor) -> None:
        """Keep the flat model of `step` now (e.g. the starting model, step 0)."""
        self.snapshots.add(step, model)


__all__ = ["MAX_SNAPSHOTS", "SNAPSHOT_COORDINATES", "ProgressWriter", "RunRecorder", "SnapshotSampler",
           "SnapshotSeries", "finite_or_none", "resident_mb", "write_summary"]
