"""Flat parameter buffer: all of a model's parameters as views into one contiguous tensor.

Algorithms then exchange and average a single vector, and loading a new model is one copy_.
The Parameter objects stay the same, so an optimizer created before or after keeps working.
"""
from __future__ import annotations

import torch
from torch import nn


class FlatParameters:
    def __init__(self, model: nn.Module):
        params = [p for p in model.parameters()]
        if not params:
            raise ValueError("model has no parameters")
        devices = {p.device for p in params}
        dtypes = {p.dtype for p in params}
        if len(devices) != 1 or len(dtypes) != 1:
            raise ValueError(f"all parameters must share one device and dtype, got {devices} / {dtypes}")
        self.params = params
        self.buffer = torch.cat([p.detach().reshape(-1) for p in params])
        offset = 0
        for p in params:
            n = p.numel()
            p.data = self.buffer[offset:offset + n].view_as(p)
            offset += n

    @property
    def numel(self) -> int:
        return self.buffer.numel()

    def get(self) -> torch.Tensor:
        """The live flat buffer (a view shared with the model; clone before keeping it)."""
        return self.buffer

    def grads(self) -> torch.Tensor:
        """All gradients as one flat tensor (a copy; zeros where a parameter got no gradient)."""
        return torch.cat([p.grad.reshape(-1) if p.grad is not None else torch.zeros_like(p).reshape(-1)
                          for p in self.params])

    def load_grads(self, values: torch.Tensor) -> None:
        """Write a flat gradient back into every parameter's .grad (what the optimizer applies)."""
        if values.shape != self.buffer.shape:
            raise ValueError(f"flat gradient size mismatch: {tuple(values.shape)} vs {tuple(self.buffer.shape)}")
        offset = 0
        for p in self.params:
            n = p.numel()
            chunk = values[offset:offset + n].view_as(p)
            if p.grad is None:
                p.grad = chunk.clone()
            else:
                p.grad.copy_(chunk)
            offset += n

    def load(self, values: torch.Tensor) -> None:
        if values.shape != self.buffer.shape:
            raise ValueError(f"flat parameter size mismatch: {tuple(values.shape)} vs {tuple(self.buffer.shape)}")
        if values.data_ptr() != self.buffer.data_ptr():
            self.buffer.copy_(values)
