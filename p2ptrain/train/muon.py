"""Muon for a model's matrices and AdamW for the rest, as one torch optimizer (MuLoCo's inner
optimizer, arXiv 2505.23725).

Muon orthogonalizes each hidden matrix's update (Newton-Schulz); it is not meant for embeddings,
the output head, biases or norms, which AdamW keeps. `torch.optim.Muon` scales its step to match
AdamW's RMS (`adjust_lr_fn="match_rms_adamw"`), so one learning rate and one schedule serve both
halves. The two share their parameter groups and state with this wrapper, so schedulers, clipping,
state_dict() and p2ptrain's DecentralizedOptimizer see one optimizer.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Iterable

import torch
from torch import nn


def muon_matrices(model: nn.Module, exclude: Iterable[str] = ()) -> list[str]:
    """Names of the parameters Muon takes: 2-D parameters, except embeddings, the output head (the
    last nn.Linear the model registers) and the names in `exclude` (e.g. learned positions)."""
    linears = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    skip = set(exclude)
    skip.update(f"{name}.weight" for name, module in model.named_modules() if isinstance(module, nn.Embedding))
    if linears:
        skip.add(f"{linears[-1]}.weight" if linears[-1] else "weight")
    return [name for name, p in model.named_parameters() if p.dim() == 2 and name not in skip]


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon on `muon_matrices(model)`, AdamW on every other parameter, one learning rate.

    The groups carry `use_muon` (True for Muon's); `weight_decay` applies to Muon's matrices and to
    AdamW's 2-D parameters, not to biases and norms."""

    def __init__(self, model: nn.Module, lr: float = 1e-3, weight_decay: float = 0.1, *,
                 momentum: float = 0.95, betas: tuple[float, float] = (0.9, 0.95), exclude: Iterable[str] = ()):
        names = set(muon_matrices(model, exclude))
        if not names:
            raise ValueError("MuonWithAdamW: the model has no hidden matrices for Muon; use AdamW")
        named = list(model.named_parameters())
        matrices = [p for n, p in named if n in names]
        decayed = [p for n, p in named if n not in names and p.dim() >= 2]
        plain = [p for n, p in named if n not in names and p.dim() < 2]
        self.muon = torch.optim.Muon(matrices, lr=lr, weight_decay=weight_decay, momentum=momentum,
                                     adjust_lr_fn="match_rms_adamw")
        self.adamw = torch.optim.AdamW([{"params": decayed, "weight_decay": weight_decay},
                                        {"params": plain, "weight_decay": 0.0}], lr=lr, betas=betas)
        super().__init__([p for _, p in named], {"lr": lr})
        for group in self.muon.param_groups:
            group["use_muon"] = True
        for group in self.adamw.param_groups:
            group["use_muon"] = False
        self.param_groups = [*self.muon.param_groups, *self.adamw.param_groups]
        self._share_state()

    def _share_state(self) -> None:
        """One state for the wrapper and both halves (their parameters are disjoint)."""
        state = self.state if isinstance(self.state, defaultdict) else defaultdict(dict, self.state)
        self.state = self.muon.state = self.adamw.state = state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        self.adamw.step()
        return loss

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)  # (replaces the wrapper's groups: hand them back to the halves)
        split = len(self.muon.param_groups)
        self.muon.param_groups, self.adamw.param_groups = self.param_groups[:split], self.param_groups[split:]
        self._share_state()


__all__ = ["MuonWithAdamW", "muon_matrices"]
