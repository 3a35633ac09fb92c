"""The run folder's files, written the same way by every role (peer nodes, parameter-server workers,
the parameter server): progress lines the launcher tails, a summary, and model snapshots.

    OUT/{name}.progress.jsonl   one JSON object per line, flushed (the launcher reads it live)
    OUT/{name}.json             the summary (non-finite numbers written as null)
    OUT/{name}.snapshots.pt     {"steps": [...], "params": [n, d]} flat models for the consensus plot
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Mapping

import torch

MAX_SNAPSHOTS = 64  # per node: a long run keeps every 2nd, 4th, ... snapshot, not all of them


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


def write_summary(out: Path | None, name: str, summary: Mapping,
                  snapshots: Mapping[int, torch.Tensor] | None = None) -> None:
    """OUT/{name}.json (and OUT/{name}.snapshots.pt when `snapshots` are given)."""
    if out is None:
        return
    out = Path(out)
    if snapshots:
        steps = sorted(snapshots)
        torch.save({"steps": steps, "params": torch.stack([snapshots[s] for s in steps])},
                   out / f"{name}.snapshots.pt")
    (out / f"{name}.json").write_text(json.dumps(finite_or_none(summary), indent=2))


class RunRecorder:
    """What one node writes while it trains: every `log_every` steps a progress line (step, time,
    the scalars reported since, traffic, push-sum weight), a snapshot of the flat model for the
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
        self.snapshots: dict[int, torch.Tensor] = {}
        self.snapshot_every = log_every
        self.started = time.time()
        self.last_step = 0
        self.last_stats: dict = {}

    def report(self, step: int, **scalars: float) -> None:
        """Scalars of `step` (loss, accuracy, perplexity, ...): shown in the next progress line and
        the summary; losses are also averaged over the last ones."""
        values = {k: float(v) for k, v in scalars.items()}
        self.scalars.update(values)
        if "loss" in values:
            self.losses.append(values["loss"])

    def step_done(self, step: int, seconds: float, model: torch.Tensor | None, **stats) -> None:
        """Step `step` (1-based count of steps done) took `seconds`; `stats` go into the line."""
        self.last_step, self.last_stats = step, stats
        self.step_seconds.append(seconds)
        if model is not None and step % self.snapshot_every == 0:
            self.snapshot(step, model)
        if step % self.log_every == 0:
            self.write_line(step, seconds, **stats)

    def write_line(self, step: int, seconds: float, **stats) -> None:
        window = self.losses[-self.log_every:]
        line = {"step": step, "time": time.time(), "step_seconds": seconds, **self.scalars, **stats}
        if window:
            line["loss"] = sum(window) / len(window)
        self.progress.write(**line)

    def event(self, event: str, **fields) -> None:
        self.progress.write(event=event, **fields)

    def summary(self) -> dict:
        """What the run measured: the last value of every scalar, the mean of the last 10 losses,
        step times (all, and without the first 10%: connection set-up and warm-up land there)."""
        tail = self.losses[-10:]
        seconds = self.step_seconds
        skip = min(10, max(1, len(seconds) // 10)) if len(seconds) > 1 else 0
        steady = seconds[skip:]
        return {**self.scalars, "reported": sorted(self.scalars), "steps": self.last_step,
                "final_loss": sum(tail) / len(tail) if tail else math.nan,
                "mean_step_seconds": sum(seconds) / len(seconds) if seconds else math.nan,
                "steady_step_seconds": sum(steady) / len(steady) if steady else math.nan,
                "wall_seconds": time.time() - self.started}

    def finish(self, summary: Mapping, model: torch.Tensor | None = None, **final_stats) -> dict:
        """Write OUT/{name}.json (+ snapshots, the final model included) and the 'done' event; the
        last progress line shows the last step with `final_stats` (e.g. the weight once flushed)."""
        if self.step_seconds and (final_stats or self.last_step % self.log_every):
            self.write_line(self.last_step, self.step_seconds[-1], **{**self.last_stats, **final_stats})
        if model is not None:
            self.snapshot(self.last_step, model, final=True)
        write_summary(self.out, self.name, summary, self.snapshots)
        self.event("done")
        return finite_or_none(summary)

    def close(self) -> None:
        self.progress.close()

    def snapshot(self, step: int, model: torch.Tensor, final: bool = False) -> None:
        """Keep the flat model of `step` (thinning old ones when there are too many)."""
        self.snapshots[step] = model.detach().to("cpu", torch.float32, copy=True)
        if len(self.snapshots) > self.max_snapshots and not final:
            steps = sorted(self.snapshots)
            keep = set(steps[::2]) | {steps[0]}
            self.snapshots = {s: t for s, t in self.snapshots.items() if s in keep}
            self.snapshot_every *= 2


__all__ = ["MAX_SNAPSHOTS", "ProgressWriter", "RunRecorder", "finite_or_none", "write_summary"]
