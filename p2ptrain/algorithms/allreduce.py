"""AllReduce-SGD: the synchronous baseline of seed 003 (Alg. 3) and seed 000 (AR-SGD).

    x_i^{t+1/2} = x_i^t - γ ∇f_i(x_i^t)                (engine: local optimizer step)
    x_i^{t+1}   = (1/n) Σ_j x_j^{t+1/2}                (ring all-reduce of the model)

`average="models"` is this rule as written; the default, `average="gradients"`, takes the mean of
the gradients before the optimizer step instead (DDP). `overlap=1` (models only) lands the mean of
step t at step t+1 as a correction, x_i^{t+1} = x_i^{t+1/2} + (a^{t-1} - s_i^{t-1}) (after_step).
Invariant: every member ends each average, and finish(), with the same bits. Never: a round that
cannot complete stops the run (the node keeps its local value for that step).
"""
from __future__ import annotations

import concurrent.futures
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from p2ptrain.algorithms.base import Algorithm, Comm, Received, buffer_like
from p2ptrain.algorithms.buckets import BucketedGradients
from p2ptrain.algorithms.collectives import CHUNK_KB_HELP, DEFAULT_CHUNK_KB
from p2ptrain.algorithms.host_allreduce import HOST_MEMORY_HELP
from p2ptrain.algorithms.member_ring import MemberRing
from p2ptrain.algorithms.registry import AlgorithmOptions, AlgorithmSpec, BuildContext, option, register
from p2ptrain.compression import CODEC_HELP, CODEC_NAMES, NEEDS_ERROR_FEEDBACK

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

AVERAGE_WHAT = ("models", "gradients")
OVERLAPS = (0, 1)


def check_overlap(overlap: int, average: str) -> None:
    """What `overlap` allows: 0 or 1, and 1 only for model averaging (a ValueError says why)."""
    if overlap not in OVERLAPS:
        raise ValueError(f"allreduce overlap must be 0 (synchronous) or 1 (the model mean of step t lands at "
                         f"step t+1), got {overlap}")
    if overlap and average != "models":
        raise ValueError("allreduce overlap=1 overlaps the model average (--average models); for gradients "
                         "averaged while the next step computes use --algorithm pipesgd")


@dataclass(frozen=True)
class AllReduceOptions(AlgorithmOptions):
    average: str = option("gradients", "average the gradients before the step (data-parallel SGD, as DDP), or "
                                       "the models after it (seed 003 Alg. 3)", choices=AVERAGE_WHAT)
    compression: str = option("none", CODEC_HELP, choices=CODEC_NAMES)
    ring_chunk_kb: int = option(DEFAULT_CHUNK_KB, CHUNK_KB_HELP)
    buckets_mb: float = option(0.0, "with --average gradients: all-reduce the gradients in buckets of this many MB, "
                                    "launched from backward hooks while backward runs (as DDP); 0 = one flat "
                                    "all-reduce at step()")
    host_memory: bool = option(True, HOST_MEMORY_HELP)
    overlap: int = option(0, "with --average models: 1 = the ring all-reduce of step t's model runs while step t+1 "
                             "computes, and step t+1 adds the correction (mean - snapshot); 0 = synchronous")

    def bounded_delay(self) -> int:
        return self.overlap  # step t's ring messages are consumed at step t+1

    def validate(self, settings) -> None:
        super().validate(settings)
        if self.ring_chunk_kb < 0:
            raise ValueError(f"ring_chunk_kb must be >= 0, got {self.ring_chunk_kb}")
        if self.buckets_mb < 0:
            raise ValueError(f"buckets_mb must be >= 0, got {self.buckets_mb}")
        if self.compression in NEEDS_ERROR_FEEDBACK:
            raise ValueError(f"compression {self.compression} drops most of the tensor and needs error feedback, "
                             "which allreduce does not keep: use it with diloco or gossip-diloco")
        check_overlap(self.overlap, self.average)


class AllReduceSGD(Algorithm):
    """AllReduce-SGD on one node, over a MemberRing re-formed over each step's members.

    Gradients or models: for SGD with momentum and weight decay the two are the same math (the
    update is linear in the gradient); for a stateful, non-linear optimizer such as AdamW they are
    not: averaging models after local Adam steps normalizes each node's batch-16 gradient by its own
    second moment, which trained a byte-level Transformer to perplexity 8.37 instead of the 6.84 of
    one process with the same total batch (examples/char_lm.py, 4 nodes, 600 steps). Hence the
    default `average="gradients"`; `average="models"` is seed 003's Alg. 3 as written. A codec
    compresses every ring hop (seed 004); gradients tolerate it far better than models do."""

    name = "allreduce"
    elastic = True  # the ring re-forms over each step's members (member_ring.MemberRing)

    @classmethod
    def from_options(cls, comm: Comm, options: AllReduceOptions, context: BuildContext) -> "AllReduceSGD":
        return cls(comm, average=options.average, codec=options.compression, buckets_mb=options.buckets_mb,
                   overlap=options.overlap, chunk_kb=options.ring_chunk_kb, host_memory=options.host_memory)

    def __init__(self, comm: Comm, *, average: str = "gradients", codec: str = "none", buckets_mb: float = 0.0,
                 overlap: int = 0, chunk_kb: int = DEFAULT_CHUNK_KB, host_memory: bool = True):
        if average not in AVERAGE_WHAT:
            raise ValueError(f"average must be one of {AVERAGE_WHAT}, got {average!r}")
        check_overlap(overlap, average)
        self._optimizer_state: tuple[int, torch.dtype] | None = None  # (numel, dtype): watch_optimizer_state
        self.comm = comm
        self.average = average
        self.codec = codec
        self.chunk_kb = chunk_kb
        self.host_memory = host_memory
        self.uses_gradients = self.shares_optimizer_state = average == "gradients"
        self.buckets_mb = buckets_mb
        self.overlap = overlap
        self.allreduce = None
        self.buckets: BucketedGradients | None = None
        self._watched = None  # (parameters, next_step) from the engine, for the buckets
        # overlap=1: s^t (the snapshot the ring reads) and a^t (the ring's output), both allocated once
        # at setup; at most one of the in-flight mean and a pending correction is held.
        self._snapshot: torch.Tensor | None = None
        self._reduced: torch.Tensor | None = None
        self._in_flight: concurrent.futures.Future | None = None  # a^t being reduced into self._reduced
        self._mean: torch.Tensor | None = None  # average="gradients": the ring's output (no backup of the input)
        self._pending: torch.Tensor | None = None  # a^{t-1} - s^{t-1} loaded from a checkpoint
        self.overlapped_averages = 0  # in-flight means folded in (stats, tests)

    def watch_gradients(self, params: list, next_step) -> None:
        self._watched = (params, next_step)

    def setup(self, params: torch.Tensor) -> torch.Tensor:
        self.allreduce = MemberRing(self.comm, params.numel(), params.dtype, codec=self.codec,
                                    resync_deadline=self.comm.peer_timeout, chunk_bytes=self.chunk_kb * 1024,
                                    state=self._optimizer_state, holds_state=self.comm.joined is None,
                                    host_memory=self.host_memory)
        if self.uses_gradients and self.buckets_mb > 0 and self._watched is not None:
            self.buckets = BucketedGradients(self.comm, self.allreduce, *self._watched,
                                             bucket_bytes=int(self.buckets_mb * 2**20), codec=self.codec)
        if self.overlap:
            self._snapshot, self._reduced = buffer_like(params), buffer_like(params)
        if self.uses_gradients:
            self._mean = buffer_like(params)
        self.comm.ready()
        return params

    def reduce_gradients(self, step: int, grads: torch.Tensor) -> torch.Tensor:
        self.comm.set_step(step)
        if self.buckets is not None:
            reduced = self.buckets.reduce(step, grads)
            if reduced is not None:
                return reduced
        return self.allreduce.reduce_or_keep(grads, step, out=self._mean)  # grads itself if it cannot complete

    def watch_optimizer_state(self, numel: int, dtype: torch.dtype) -> None:
        self._optimizer_state = (numel, dtype)  # averaged with the model at every view switch

    def resync_optimizer_state(self, step: int, state: torch.Tensor) -> torch.Tensor:
        """The members' mean optimizer state (with gradients averaged, equal models and unequal
        momentum would part again)."""
        return self.allreduce.resync_state(state, step)

    def members_changed(self, step: int, params: torch.Tensor) -> torch.Tensor:
        """A new view: one model over the re-formed ring before its first round. With overlap, the
        old ring's in-flight mean is completed and dropped on every member (a joiner has none; the
        resync is the consensus it would have corrected towards)."""
        self._drop_correction()
        self.comm.set_step(step)
        return self.allreduce.resync(params, step)

    def after_step(self, step: int, params: torch.Tensor) -> torch.Tensor:
        """With `average="models"`: the mean model, or with `overlap=1` the model plus the correction
        of the step before's mean.

        `overlap=1`: one-step-delayed averaging, as in Overlap Local-SGD (Wang et al. 2020) and DaSGD
        (Zhou et al. 2020). The mean of step t's model is taken on the engine's communication worker
        (Comm.background) while step t+1 computes, and step t+1 adopts it as a correction that keeps
        its own local progress:

            x_i^{t+1/2} = x_i^t - γ ∇f_i(x_i^t)                (engine: local optimizer step)
            x_i^{t+1}   = x_i^{t+1/2} + (a^{t-1} - s_i^{t-1})  (the mean of step t-1 lands; none at t = 0)
            s_i^t       = x_i^{t+1}                            (a snapshot: the ring reads it while the model moves on)
            a^t         = (1/n) Σ_j s_j^t                      (ring all-reduce, while step t+1 computes)

        Unrolled, x_i^{t+1} = a^{t-1} + (x_i^{t+1/2} - x_i^t): the consensus of the step before plus
        this node's last local update, so members differ by one step's local updates, and a^t =
        a^{t-1} + (1/n) Σ_j (x_j^{t+1/2} - x_j^t) moves by the mean update, as the synchronous
        average does. finish() waits for the last mean and returns x^T + (a^{T-1} - s^{T-1}) =
        a^{T-1} (the model has not moved since its snapshot): every member ends with the same bits.
        A round that cannot complete leaves the ring's buffer at s_i^t, a zero correction (the local
        model is kept). Overlapped gradients are pipesgd."""
        if self.uses_gradients:
            return params
        self.comm.set_step(step)
        if not self.overlap:
            return self.allreduce.reduce_or_keep(params, step)
        correction = self._take_correction()  # a^{t-1} - s^{t-1}
        if correction is not None:
            params.add_(correction)   # x^{t+1}
        self._snapshot.copy_(params)  # s^t, read by the ring on the communication worker, which writes a^t
        self._in_flight = self.comm.background(self.allreduce.reduce_or_keep, self._snapshot, step,
                                               out=self._reduced)
        return params

    def adopt_state(self, state: Received, params: torch.Tensor) -> torch.Tensor:
        """Caught up after a stall: the donor's model replaces ours, and the correction towards the
        mean of our stale snapshot with it. Until the next switch average this node holds a
        copy, not the members' state (MemberRing.holds_state)."""
        self._drop_correction()
        self.allreduce.holds_state = False
        return super().adopt_state(state, params)

    def state_dict(self) -> dict:
        """With overlap: the correction a^{t-1} - s^{t-1} of the last step's mean (waited for; it
        stays to be added by the next step), or None at the start."""
        if not self.overlap:
            return {}
        correction = None
        if self._in_flight is not None:
            correction = self._in_flight.result() - self._snapshot
        elif self._pending is not None:
            correction = self._pending.clone()
        return {"pending_correction": correction}

    def load_state_dict(self, state: dict, step: int) -> None:
        """The saved correction is added after the next local step, as it would have been."""
        correction = state.get("pending_correction")
        if not self.overlap:
            if correction is not None:
                log.warning("node %d: the checkpoint's pending correction is ignored: overlap is off", self.comm.rank)
            return None
        self._drop_correction()
        if correction is not None:
            self._pending = self._reduced.copy_(correction.view_as(self._reduced))
        return None

    def finish(self) -> torch.Tensor | None:
        """With overlap: complete the last mean (the peers take part in it) and return the model with
        its correction, x^T + (a^{T-1} - s^{T-1}) = a^{T-1}: nothing moves the model between its
        snapshot and here (a view switch, a catch-up or a load drop the mean in flight), and a^{T-1}
        is the same bits on every member (the ring's all-gather forwards identical bytes)."""
        if self.buckets is not None:
            self.buckets.close()
        if not self.overlap:
            return None
        final = None
        if self._in_flight is not None:
            final = self._in_flight.result()
            self._in_flight = None
            self.overlapped_averages += 1
        elif self._pending is not None:
            log.warning("node %d: finished before a step added the checkpoint's pending correction", self.comm.rank)
            self._pending = None
        return final

    def agree_at_end(self, step: int, params: torch.Tensor) -> torch.Tensor:
        """The members' models, averaged once more if a round failed or was skipped on any of them
        (MemberRing.agree_at_end); untouched in a fault-free run."""
        return self.allreduce.agree_at_end(params, step)

    def apart_at_end(self) -> bool:
        return self.allreduce is not None and self.allreduce.apart

    def shared_state(self, params: torch.Tensor) -> tuple[str, torch.Tensor]:
        """Every member ends with the same model bits (the ring's all-gather forwards identical bytes)."""
        return "model", params

    def stats(self) -> dict[str, float]:
        stats = self.allreduce.stats() if self.allreduce is not None else {}
        if self.buckets is not None:
            stats["bucketed_steps"] = float(self.buckets.bucketed_steps)
        if self.overlap:
            stats["overlapped_averages"] = float(self.overlapped_averages)
        return stats

    # overlap=1 ----------------------------------------------------------------------------------
    def _take_correction(self) -> torch.Tensor | None:
        """a^{t-1} - s^{t-1}: of the mean in flight (waited for; None if its ring could not complete:
        then it hands back s^{t-1} itself) or the loaded one; None at the start. Reuses the ring's
        buffer: valid until the next launch."""
        if self._in_flight is not None:
            averaged = self._in_flight.result()
            self._in_flight = None
            self.overlapped_averages += 1
            return None if averaged is self._snapshot else averaged.sub_(self._snapshot)
        correction, self._pending = self._pending, None
        return correction

    def _drop_correction(self) -> None:
        if self._in_flight is not None:
            self._in_flight.result()  # the peers are part of this round: complete it
            self._in_flight = None
        self._pending = None


register(AlgorithmSpec(
    "allreduce", "ring all-reduce (reduce-scatter + all-gather) of the gradients before each step, as DDP, or of "
                 "the model after it (seed 003 Alg. 3; --overlap 1: the mean lands one step later)",
    AllReduceOptions, AllReduceSGD.from_options, topologies=("ring",)))
