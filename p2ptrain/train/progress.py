"""The run folder's files, written the same way by every role (peer nodes, parameter-server workers,
the parameter server): progress lines the launcher tails, a summary, and model snapshots.

    OUT/{name}.progress.jsonl   one JSON object per line, flushed (the launcher reads it live)
    OUT/{name}.json             the summary (non-finite numbers written as null)
    OUT/{name}.snapshots.pt     {"steps": [...], "params": [n, d]} flat models for the consensus plot
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Mapping

import torch


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


__all__ = ["ProgressWriter", "finite_or_none", "write_summary"]
