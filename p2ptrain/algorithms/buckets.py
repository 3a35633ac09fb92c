"""Bucketed gradient all-reduce launched from backward hooks, as DDP's reducer does: the ring
all-reduce of the last layers' gradients runs on the engine's communication worker
(Comm.background) while backward still computes the first layers'. It must never change what
AllReduce-SGD computes: the result is the flat all-reduce's mean, cut into pieces (equal to it up
to float summation order: each bucket is its own ring, so segment boundaries differ).

Buckets are launched strictly in index order, so no two nodes wait on different rings, and if any
bucket fails the whole step keeps the local gradient. When hooks cannot know that this backward is
the one step() follows, buckets switch off for the run, on every node at the same step, and the
flat all-reduce takes over (BucketedGradients._usable says when).
"""
from __future__ import annotations

import concurrent.futures
import logging
from typing import TYPE_CHECKING, Callable

from p2ptrain.algorithms.base import Comm
from p2ptrain.algorithms.collectives import CollectiveIncomplete, RingAllReduce
from p2ptrain.algorithms.member_ring import MemberRing

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class _Bucket:
    """Parameters whose gradients fill flat[start:end], and the ring that reduces that range."""

    def __init__(self, index: int, start: int, end: int, params: list):
        self.index, self.start, self.end = index, start, end
        self.params = params
        self.ring: RingAllReduce | None = None


class BucketedGradients:
    """Gradient all-reduce in buckets over `ring`'s members; declare (construct) before comm.ready().

    Buckets are contiguous ranges of the flat gradient vector: parameters in reverse order (the
    order backward finishes them), grouped until `bucket_bytes`. A parameter's
    post-accumulate-grad hook copies its gradient into the bucket's slice; a bucket whose
    parameters all reported is launched, buckets strictly in index order (every node runs them in
    the same order on its one worker, so no two nodes wait on different rings). Each bucket has its
    own RingAllReduce (tag `b<k>.`), re-formed over each step's members like the flat ring
    (MemberRing.members_for); if any bucket fails, the whole step keeps the local gradient and the
    failure counts as one failed round (MemberRing.round_failed)."""

    def __init__(self, comm: Comm, ring: MemberRing, params: list, next_step: Callable[[], int], *,
                 bucket_bytes: int, codec=None):
        import torch

        from p2ptrain import large_pages

        self.comm, self.ring, self.next_step = comm, ring, next_step
        self.params = list(params)
        self.num_params = sum(p.numel() for p in self.params)
        dtypes = {p.dtype for p in self.params}
        self.dtype = dtypes.pop() if len(dtypes) == 1 else None
        self.enabled = self.dtype is not None
        self.why_off = "" if self.enabled else "parameters of several dtypes"
        # on the parameters' device: the gradient hooks copy into it and the rings sum into it there
        device = self.params[0].device if self.params else None
        self.flat = large_pages.zeros(self.num_params, self.dtype or torch.float32, device)
        self.buckets = self._cut(bucket_bytes)
        for bucket in self.buckets:
            bucket.ring = RingAllReduce(comm, bucket.end - bucket.start, self.flat.dtype, codec=codec,
                                        tag=f"b{bucket.index}.", elastic=True)
        self._offset = {}
        offset = 0
        for p in self.params:
            self._offset[p] = offset
            offset += p.numel()
        self._bucket_of = {p: bucket for bucket in self.buckets for p in bucket.params}
        self._hooks = []
        self._reset()
        if self.enabled:
            self._hooks = [p.register_post_accumulate_grad_hook(self._on_gradient)
                           for p in self.params if p.requires_grad]
        self.bucketed_steps = 0  # steps reduced in buckets (stats, tests)

    def _cut(self, bucket_bytes: int) -> list[_Bucket]:
        """Parameters from the last to the first, in buckets of about `bucket_bytes` each."""
        buckets, current, end, size = [], [], self.num_params, 0
        offset = self.num_params
        for p in reversed(self.params):
            offset -= p.numel()
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= bucket_bytes:
                buckets.append(_Bucket(len(buckets), offset, end, current))
                current, end, size = [], offset, 0
        if current:
            buckets.append(_Bucket(len(buckets), 0, end, current))
        return buckets

    def _reset(self) -> None:
        self._step: int | None = None         # the step this backward's buckets belong to
        self._members: tuple[int, ...] | None = None
        self._reported: dict = {}             # param -> (grad object, its version when copied)
        self._waiting = {b.index: len(b.params) for b in self.buckets}
        self._launched: list[concurrent.futures.Future] = []
        self._accumulated = False

    # Backward hooks -------------------------------------------------------------------------------
    def _on_gradient(self, param) -> None:
        if not self.enabled:
            return
        if param in self._reported:  # a second backward before step(): gradient accumulation
            self._accumulated = True
            return
        if self._step is None:
            self._step = self.next_step()
            self._members = self._plan(self._step)
        offset = self._offset[param]
        self.flat[offset:offset + param.numel()].copy_(param.grad.detach().reshape(-1))
        self._reported[param] = (param.grad, param.grad._version)
        bucket = self._bucket_of[param]
        self._waiting[bucket.index] -= 1
        self._launch_ready()

    def _plan(self, step: int) -> tuple[int, ...] | None:
        """The members to reduce this step's buckets over, or None: leave the step to the flat path."""
        if self.comm.membership.switches_at(step):
            return None
        return self.ring.members_for(step)

    def _launch_ready(self) -> None:
        """Launch complete buckets in index order (every node in the same order)."""
        if self._members is None:
            return
        while len(self._launched) < len(self.buckets) and self._waiting[len(self._launched)] == 0:
            bucket = self.buckets[len(self._launched)]
            if not self._launched:
                self.comm.set_step(self._step)
            self._launched.append(self.comm.background(self._reduce, bucket, self._step, self._members))

    def _reduce(self, bucket: _Bucket, step: int, members: tuple[int, ...]) -> CollectiveIncomplete | None:
        try:
            bucket.ring(self.flat[bucket.start:bucket.end], step, average=True, members=members, restore=False)
        except CollectiveIncomplete as exc:
            return exc
        return None

    # At step() ------------------------------------------------------------------------------------
    def reduce(self, step: int, grads: torch.Tensor) -> torch.Tensor | None:
        """The mean gradient from this backward's buckets (launching those no hook completed, e.g.
        parameters without a gradient), `grads` when the step kept its local value, or None when
        buckets do not apply to this step (the caller runs the flat all-reduce)."""
        try:
            usable = self._usable(step, grads)
            if usable and self._members is not None:
                for bucket in self.buckets:  # parameters no hook reported (no gradient): as step() sees them
                    for p in bucket.params:
                        if p not in self._reported:
                            offset = self._offset[p]
                            self.flat[offset:offset + p.numel()].copy_(grads[offset:offset + p.numel()])
                    self._waiting[bucket.index] = 0
                self._launch_ready()
            failures = [exc for exc in (f.result() for f in self._launched) if exc is not None]
            if not usable or self._members is None or self._step != step:
                return None
            if failures:
                self.ring.round_failed(failures[0])
                return grads
            self.ring.round_completed()
            grads[:self.num_params].copy_(self.flat)
            self.bucketed_steps += 1
            return grads
        finally:
            self._reset()

    def _usable(self, step: int, grads: torch.Tensor) -> bool:
        """Whether buckets can stand for this step's gradient; the first time not, they switch off
        for the run and the flat all-reduce takes over, on every node at the same step since every
        node runs the same loop: a second backward before step() (gradient accumulation),
        gradients changed after backward (clip_grad_norm_, GradScaler's unscale: the version counter
        moves even when the values do not, so nodes agree), or a model with floating buffers in the
        vector. (A step that re-forms the ring is left to the flat all-reduce too, that step only:
        _plan.) Buckets launched on that step still complete (peers take part) and are thrown
        away."""
        why = ""
        if grads.numel() != self.num_params:
            why = "the model's floating buffers travel with the gradient"
        elif self._accumulated:
            why = "gradient accumulation (several backward passes per step)"
        elif self._changed_since_backward():
            why = "gradients changed between backward and step() (clipping, GradScaler)"
        if why and self.enabled:
            self.switch_off(why)
            log.info("node %d: gradient buckets off from step %d: %s; the flat all-reduce takes over",
                     self.comm.rank, step, why)
        return self.enabled

    def _changed_since_backward(self) -> bool:
        """A gradient was replaced or written after backward reported it. Gradients that view one
        flat buffer (the engine's, see ModelState.gradient_vector) share one version counter, so
        theirs must still be the last version backward left on that buffer."""
        def counter(grad) -> int:
            return id(grad._base) if grad._base is not None else id(grad)

        last: dict[int, int] = {}
        for grad, version in self._reported.values():
            last[counter(grad)] = max(last.get(counter(grad), -1), version)
        return any(p.grad is not grad or p.grad._version != last[counter(grad)]
                   for p, (grad, version) in self._reported.items())

    def switch_off(self, why: str) -> None:
        self.enabled, self.why_off = False, why
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def close(self) -> None:
        """Wait for the buckets launched (the peers take part in their rings)."""
        for future in self._launched:
            future.result()
