"""Evaluating a model on a held-out loader: one function for every role (nodes, parameter-server
workers, the parameter server's θ)."""
from __future__ import annotations

import math
from typing import Callable, Iterable

import torch
import torch.nn.functional as F


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: Iterable, device: torch.device | str = "cpu", *,
             loss_fn: Callable = F.nll_loss) -> tuple[float, float]:
    """(mean loss, accuracy) of a classifier on `loader`; `loss_fn(output, targets, reduction="sum")`
    (default: NLL of log-probabilities, what the built-in models output). NaNs for an empty loader.
    Leaves the model in eval mode."""
    model.eval()
    total, correct, count = 0.0, 0, 0
    for inputs, targets in loader:
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        output = model(inputs)
        total += float(loss_fn(output, targets, reduction="sum"))
        correct += int((output.argmax(dim=1) == targets).sum())
        count += targets.numel()
    return (total / count, correct / count) if count else (math.nan, math.nan)


__all__ = ["evaluate"]
