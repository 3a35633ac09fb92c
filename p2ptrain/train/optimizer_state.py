"""The inner optimizer's per-parameter state (SGD's momentum, Adam's moments and step) as one flat
vector in a layout every node shares, so that a ring can average it when its members change.

Why: rings (AllReduce, Pipe-SGD) average the model when a view switches, which makes the members'
models equal again after a restart, a join or rounds that failed. With gradients averaged, equal
models and equal mean gradients still move apart for good if the optimizers' momentum differs
(a restarted node starts with none; a node whose rounds failed accumulated its own). Averaging the
state too at the switch makes the members bit-identical from then on, as torchft heals with the
optimizer state as well as the model.

State is materialized as a first step would (zeros, step 0); optimizers other than SGD, Adam,
AdamW and MuonWithAdamW (train/muon.py) are left alone (`of` returns None).
"""
from __future__ import annotations

import torch

_ADAM = (torch.optim.Adam, torch.optim.AdamW)


class OptimizerStateVector:
    """A view of `optimizer`'s state as one vector of `dtype` (read with vector(), write with load())."""

    def __init__(self, optimizer: torch.optim.Optimizer, layout: list[tuple[torch.Tensor, str, bool]],
                 dtype: torch.dtype):
        self.optimizer = optimizer
        self.layout = layout  # (parameter, state key, True for a per-element tensor / False for a scalar)
        self.dtype = dtype
        self.numel = sum(p.numel() if full else 1 for p, _, full in layout)

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer) -> "OptimizerStateVector | None":
        """The state vector of an SGD (with momentum), Adam, AdamW or MuonWithAdamW optimizer; None
        otherwise (or when it holds no state worth averaging, e.g. plain SGD)."""
        layout: list[tuple[torch.Tensor, str, bool]] = []
        for group in optimizer.param_groups:
            if group.get("use_muon"):
                keys = [("momentum_buffer", True)]
            elif isinstance(optimizer, _ADAM) or group.get("use_muon") is False:
                keys = [("step", False), ("exp_avg", True), ("exp_avg_sq", True)]
                keys += [("max_exp_avg_sq", True)] if group.get("amsgrad") else []
            elif type(optimizer) is torch.optim.SGD and group.get("momentum", 0):
                keys = [("momentum_buffer", True)]
            else:
                return None
            layout += [(p, key, full) for p in group["params"] for key, full in keys]
        if not layout:
            return None
        dtype = next(p.dtype for p, _, _ in layout)
        return cls(optimizer, layout, dtype if dtype.is_floating_point else torch.float32)

    def _tensor(self, param: torch.Tensor, key: str, full: bool) -> torch.Tensor:
        state = self.optimizer.state[param]
        value = state.get(key)
        if value is None:  # not created yet (before the first step): what that step would create
            value = torch.zeros_like(param, memory_format=torch.preserve_format) if full else \
                torch.zeros((), dtype=torch.float32, device=param.device if param.is_cuda else "cpu")
            state[key] = value
        elif not torch.is_tensor(value):  # a step kept as a number
            value = torch.tensor(float(value), dtype=torch.float32)
            state[key] = value
        return value

    def vector(self) -> torch.Tensor:
        """The state as one flat vector (a copy)."""
        # on the parameters' device (a step count may be a CPU scalar even when the model is on CUDA)
        parts = [self._tensor(p, key, full).detach().reshape(-1).to(p.device, self.dtype)
                 for p, key, full in self.layout]
        return torch.cat(parts) if parts else torch.empty(0, dtype=self.dtype)

    def load(self, values: torch.Tensor) -> None:
        """Write a vector of vector()'s layout back into the optimizer's state."""
        if values.numel() != self.numel:
            raise ValueError(f"optimizer state vector has {values.numel()} values, expected {self.numel}")
        offset = 0
        with torch.no_grad():
            for p, key, full in self.layout:
                target = self._tensor(p, key, full)
                n = target.numel()
                target.copy_(values[offset:offset + n].view_as(target).to(target.device, target.dtype))
                offset += n


__all__ = ["OptimizerStateVector"]
