"""A model's state as the one flat vector the algorithms exchange: its parameters, then (unless
left out) its floating-point buffers, such as BatchNorm's running statistics.

Layout: vector() = [parameters (P) | buffers (B)]; gradient_vector() = [gradients (P) | buffers (B)],
so algorithms that average gradients make the buffers identical in the same collective. Buffers
travel because a BatchNorm model whose weights are averaged but whose running statistics are not
evaluates with statistics that belong to no model (ModelState). Integer buffers stay local.
Parameters on several devices, complex, integer or sparse ones are refused at construction.
"""
from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

from p2ptrain import large_pages

_COMMUNICATION_DTYPE = torch.float32  # mixed-dtype models exchange a float32 vector


class ModelState:
    """The flat [parameters | buffers] of `model` (`buffers=False`: the parameters alone).

    Why buffers: a BatchNorm model whose weights are averaged but whose running statistics are not
    evaluates with statistics that belong to no model (all-reduce runs ended at 0.30 / 0.08 / 0.08
    test accuracy with identical weights). With buffers in the vector, averaging algorithms average
    them with the model (SGP weighted by push-sum, like the parameters) and all-reduce algorithms
    make them identical. Integer buffers (BatchNorm's num_batches_tracked) stay local: they count
    this node's steps and only matter when a BatchNorm has no momentum.

    When every tensor shares one dtype and device (the common case), parameters and buffers become
    views into a single contiguous buffer: vector() is that buffer and costs nothing, and load() is
    one copy. With several floating dtypes (e.g. float32 with bfloat16), each dtype keeps its own
    flat buffer of views and the vector is a float32 copy made on demand. Anything else (parameters
    on several devices, complex or integer parameters, sparse tensors) is refused here."""

    def __init__(self, model: nn.Module, *, buffers: bool = True):
        self.params = [p for p in model.parameters()]
        if not self.params:
            raise ValueError("the model has no parameters")
        self.buffers = [b for _, b in _named_float_buffers(model)] if buffers else []
        tensors = self.params + self.buffers
        devices = {t.device for t in tensors}
        if len(devices) != 1:
            raise ValueError(f"the model's tensors live on several devices ({sorted(map(str, devices))}); p2ptrain "
                             "keeps one model replica per process on one device: move it with model.to(device) "
                             "before wrapping the optimizer")
        for name, p in model.named_parameters():
            if p.is_sparse or p.is_complex() or not p.dtype.is_floating_point:
                raise ValueError(f"parameter {name} has dtype {p.dtype}{' (sparse)' if p.is_sparse else ''}: only "
                                 "dense floating-point parameters can be averaged")
        self.device = devices.pop()
        self.num_params = sum(p.numel() for p in self.params)
        self.num_buffers = sum(b.numel() for b in self.buffers)
        self._groups: dict[torch.dtype, torch.Tensor] = {}  # dtype -> flat buffer its tensors view into
        members = [(None, p) for p in self.params]  # owner None: a parameter
        if buffers:
            members += list(_float_buffer_owners(model))
        by_dtype: dict[torch.dtype, list] = defaultdict(list)
        for owner, tensor in members:
            by_dtype[tensor.dtype].append((owner, tensor))
        for dtype, members in by_dtype.items():
            flat = torch.cat([t.detach().reshape(-1) for _, t in members])
            self._groups[dtype] = flat
            offset = 0
            for owner, tensor in members:
                n = tensor.numel()
                view = flat[offset:offset + n].view_as(tensor)
                if owner is None:  # a parameter: the optimizer keeps its Parameter object, now a view
                    tensor.data = view
                else:  # a buffer: its module now holds the view
                    module, name = owner
                    module._buffers[name] = view
                offset += n
        self.dtype = next(iter(self._groups)) if len(self._groups) == 1 else _COMMUNICATION_DTYPE
        self.buffers = [b for _, b in _named_float_buffers(model)] if buffers else []  # the views
        self._single = len(self._groups) == 1
        self._grads: torch.Tensor | None = None  # [gradients | buffers], .grad views into it (single dtype)

    @property
    def numel(self) -> int:
        return self.num_params + self.num_buffers

    # The algorithms' vector ----------------------------------------------------------------------
    def vector(self) -> torch.Tensor:
        """[parameters | buffers]: the live buffer itself for a single-dtype model (do not keep it
        across steps without clone()), else a float32 copy."""
        if self._single:
            return next(iter(self._groups.values()))
        return torch.cat([t.detach().reshape(-1).to(_COMMUNICATION_DTYPE) for t in self.params + self.buffers])

    def load(self, values: torch.Tensor) -> None:
        """Set parameters and buffers from [parameters | buffers]."""
        if values.numel() != self.numel:
            raise ValueError(f"flat model size mismatch: {values.numel()} values for {self.numel}")
        if self._single:
            flat = next(iter(self._groups.values()))
            if values.data_ptr() != flat.data_ptr():
                flat.copy_(values.reshape(-1))
            return
        self._scatter(values.reshape(-1), self.params + self.buffers)

    def gradient_vector(self) -> torch.Tensor:
        """[gradients | buffers] (zeros where a parameter got no gradient). For a single-dtype model
        it is one flat buffer that every .grad becomes a view of once the reduced gradient is loaded
        (load_gradient_vector), as DDP's gradient_as_bucket_view does: a backward that accumulates
        into those views (the optimizer's zero_grad keeps them) costs no copy here; a fresh .grad is
        copied in (and left in place until then: hooks may still compare it). Else a fresh tensor."""
        if not self._single:
            grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(self.dtype)
                     for p in self.params]
            return torch.cat(grads + [b.detach().reshape(-1).to(self.dtype) for b in self.buffers])
        if self._grads is None:
            self._grads = large_pages.zeros(self.numel, self.dtype, self.device)  # (the ring sends from it)
        offset = 0
        for p in self.params:
            view = self._grads[offset:offset + p.numel()].view_as(p)
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
            offset += p.numel()
        for b in self.buffers:
            self._grads[offset:offset + b.numel()].copy_(b.detach().reshape(-1))
            offset += b.numel()
        return self._grads

    def load_gradient_vector(self, values: torch.Tensor) -> None:
        """Set every parameter's .grad (what the optimizer applies) and the buffers from
        [gradients | buffers]."""
        if values.numel() != self.numel:
            raise ValueError(f"flat gradient size mismatch: {values.numel()} values for {self.numel}")
        values = values.reshape(-1)
        if self._single and self._grads is not None:
            if values.data_ptr() != self._grads.data_ptr():
                self._grads.copy_(values)
            offset = 0
            for p in self.params:  # (a .grad replaced since gradient_vector() becomes the view again)
                view = self._grads[offset:offset + p.numel()].view_as(p)
                if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                    p.grad = view
                offset += p.numel()
            self._scatter(self._grads[self.num_params:], self.buffers)
            return
        offset = 0
        for p in self.params:
            chunk = values[offset:offset + p.numel()].view_as(p).to(p.dtype)
            if p.grad is None:
                p.grad = chunk.clone()
            else:
                p.grad.copy_(chunk)
            offset += p.numel()
        self._scatter(values[offset:], self.buffers)

    def zero_gradients(self) -> bool:
        """Zero the flat gradient buffer in place, keeping .grad the views into it (no new tensors
        for the next backward); False when there is none (the caller zeroes the usual way)."""
        if self._grads is None:
            return False
        self._grads.zero_()
        offset = 0
        for p in self.params:
            view = self._grads[offset:offset + p.numel()].view_as(p)
            if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                p.grad = view
            offset += p.numel()
        return True

    def parameter_vector(self) -> torch.Tensor:
        """The parameters alone (a view for a single-dtype model)."""
        return self.vector()[:self.num_params] if self._single else torch.cat(
            [p.detach().reshape(-1).to(_COMMUNICATION_DTYPE) for p in self.params])

    @staticmethod
    def _scatter(values: torch.Tensor, tensors: list[torch.Tensor]) -> None:
        offset = 0
        for t in tensors:
            t.data.copy_(values[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def _float_buffer_owners(model: nn.Module):
    """((module, name), buffer) for every persistent floating-point buffer, each buffer once.

    Non-persistent buffers (register_buffer(..., persistent=False): a causal mask full of -inf, a
    rotary table) are constants the model recomputes, not state: averaging them is meaningless and
    a mask's -inf would fail the finite checks."""
    persistent = {id(t) for t in model.state_dict(keep_vars=True).values()}
    seen: set[int] = set()
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if (buffer is not None and buffer.dtype.is_floating_point and id(buffer) in persistent
                    and id(buffer) not in seen):
                seen.add(id(buffer))
                yield (module, name), buffer


def _named_float_buffers(model: nn.Module):
    for (module, name), buffer in _float_buffer_owners(model):
        yield name, module._buffers[name]


__all__ = ["ModelState"]
