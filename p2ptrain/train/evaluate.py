"""Evaluating a model on a held-out loader: one function for every role (nodes, parameter-server
workers, the parameter server's θ, your own scripts)."""
from __future__ import annotations

import math
from typing import Callable, Iterable

import torch


def accuracy(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Fraction of a batch whose argmax is the target (a classifier's accuracy)."""
    return (output.argmax(dim=1) == targets).float().mean()


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: Iterable, device: torch.device | str = "cpu", *,
             loss_fn: Callable, metric: Callable | None = accuracy) -> tuple[float, float]:
    """(mean loss, mean metric) over `loader`: `loss_fn(output, targets)` and `metric(output,
    targets)` return batch means (torch's default reduction), averaged weighted by batch size.
    There is no default loss (nll_loss on raw scores would be silently wrong); the metric defaults
    to top-1 accuracy, and a regression model passes `metric=None` (then the metric is NaN). NaNs
    for an empty loader. Leaves the model in eval mode."""
    model.eval()
    total_loss, total_metric, count = 0.0, 0.0, 0
    for inputs, targets in loader:
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        output = model(inputs)
        n = targets.shape[0] if targets.dim() else 1
        total_loss += float(loss_fn(output, targets)) * n
        if metric is not None:
            total_metric += float(metric(output, targets)) * n
        count += n
    if not count:
        return math.nan, math.nan
    return total_loss / count, (total_metric / count if metric is not None else math.nan)


__all__ = ["accuracy", "evaluate"]
