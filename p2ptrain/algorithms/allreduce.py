"""AllReduce-SGD: the synchronous baseline of seed 003 (Alg. 3) and seed 000 (AR-SGD).

    x_i^{t+1/2} = x_i^t - γ ∇f_i(x_i^t)                (engine: local optimizer step)
    x_i^{t+1}   = (1/n) Σ_j x_j^{t+1/2}                (ring all-reduce of the model)

The default, `average="gradients"`, takes the mean over gradients before the optimizer step instead:
classic data-parallel SGD, what DDP does. For SGD with momentum and weight decay the two are the
same math (the update is linear in the gradient); for a stateful, non-linear optimizer such as
AdamW they are not: averaging models after local Adam steps normalizes each node's batch-16
gradient by its own second moment, which trained a byte-level Transformer to perplexity 8.37
instead of the 6.84 of one process with the same total batch (examples/char_lm.py, 4 nodes, 600
steps). `average="models"` is seed 003's Alg. 3 as written. A codec compresses every ring hop
(seed 004); gradients tolerate it far better than models do.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from p2ptrain.algorithms.base import Algorithm, Comm
from p2ptrain.algorithms.buckets import BucketedGradients
from p2ptrain.algorithms.collectives import CHUNK_KB_HELP, DEFAULT_CHUNK_KB, MemberRing
from p2ptrain.algorithms.registry import AlgorithmOptions, AlgorithmSpec, BuildContext, option, register
from p2ptrain.compression import CODEC_HELP, CODEC_NAMES, NEEDS_ERROR_FEEDBACK

if TYPE_CHECKING:
    import torch

AVERAGE_WHAT = ("models", "gradients")


@dataclass(frozen=True)
class AllReduceOptions(AlgorithmOptions):
    average: str = option("gradients", "average the gradients before the step (data-parallel SGD, as DDP), or "
                                       "the models after it (seed 003 Alg. 3)", choices=AVERAGE_WHAT)
    compression: str = option("none", CODEC_HELP, choices=CODEC_NAMES)
    ring_chunk_kb: int = option(DEFAULT_CHUNK_KB, CHUNK_KB_HELP)
    buckets_mb: float = option(0.0, "with --average gradients: all-reduce the gradients in buckets of this many MB, "
                                    "launched from backward hooks while backward runs (as DDP); 0 = one flat "
                                    "all-reduce at step()")

    def validate(self, settings) -> None:
        super().validate(settings)
        if self.ring_chunk_kb < 0:
            raise ValueError(f"ring_chunk_kb must be >= 0, got {self.ring_chunk_kb}")
        if self.buckets_mb < 0:
            raise ValueError(f"buckets_mb must be >= 0, got {self.buckets_mb}")
        if self.compression in NEEDS_ERROR_FEEDBACK:
            raise ValueError(f"compression {self.compression} drops most of the tensor and needs error feedback, "
                             "which allreduce does not keep: use it with diloco or gossip-diloco")


class AllReduceSGD(Algorithm):
    name = "allreduce"
    elastic = True  # the ring re-forms over each step's members (collectives.MemberRing)

    @classmethod
    def from_options(cls, comm: Comm, options: AllReduceOptions, context: BuildContext) -> "AllReduceSGD":
        return cls(comm, average=options.average, codec=options.compression, buckets_mb=options.buckets_mb,
                   chunk_kb=options.ring_chunk_kb)

    def __init__(self, comm: Comm, *, average: str = "gradients", codec: str = "none", buckets_mb: float = 0.0,
                 chunk_kb: int = DEFAULT_CHUNK_KB):
        if average not in AVERAGE_WHAT:
            raise ValueError(f"average must be one of {AVERAGE_WHAT}, got {average!r}")
        self.comm = comm
        self.average = average
        self.codec = codec
        self.chunk_kb = chunk_kb
        self.uses_gradients = average == "gradients"
        self.buckets_mb = buckets_mb
        self.allreduce = None
        self.buckets: BucketedGradients | None = None
        self._watched = None  # (parameters, next_step) from the engine, for the buckets

    def watch_gradients(self, params: list, next_step) -> None:
        self._watched = (params, next_step)

    def setup(self, params: torch.Tensor) -> torch.Tensor:
        self.allreduce = MemberRing(self.comm, params.numel(), params.dtype, codec=self.codec,
                                    resync_deadline=self.comm.peer_timeout, chunk_bytes=self.chunk_kb * 1024)
        if self.uses_gradients and self.buckets_mb > 0 and self._watched is not None:
            self.buckets = BucketedGradients(self.comm, self.allreduce, *self._watched,
                                             bucket_bytes=int(self.buckets_mb * 2**20), codec=self.codec)
        self.comm.ready()
        return params

    def reduce_gradients(self, step: int, grads: torch.Tensor) -> torch.Tensor:
        self.comm.set_step(step)
        if self.buckets is not None:
            reduced = self.buckets.reduce(step, grads)
            if reduced is not None:
                return reduced
        return self.allreduce.reduce_or_keep(grads, step)

    def members_changed(self, step: int, params: torch.Tensor) -> torch.Tensor:
        """A new view: one model over the re-formed ring before its first round."""
        self.comm.set_step(step)
        return self.allreduce.resync(params, step)

    def after_step(self, step: int, params: torch.Tensor) -> torch.Tensor:
        if self.uses_gradients:
            return params
        self.comm.set_step(step)
        return self.allreduce.reduce_or_keep(params, step)

    def finish(self) -> None:
        if self.buckets is not None:
            self.buckets.close()
        return None

    def stats(self) -> dict[str, float]:
        stats = {"ring_resyncs": float(self.allreduce.resyncs)} if self.allreduce is not None else {}
        if self.buckets is not None:
            stats["bucketed_steps"] = float(self.buckets.bucketed_steps)
        return stats


register(AlgorithmSpec(
    "allreduce", "ring all-reduce (reduce-scatter + all-gather) of the gradients before each step, as DDP, or of "
                 "the model after it (seed 003 Alg. 3)",
    AllReduceOptions, AllReduceSGD.from_options, topologies=("ring",)))
