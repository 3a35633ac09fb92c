"""Pipe-SGD (seed 004 Alg. 1) with pipeline width K = 2.

    computation thread, step t:  g_local[t] = ∇f(w[t]);  hand g_local[t] to the comm worker;
                                 wait for g_sum[t-1];    w[t+1] = w[t] - γ g_sum[t-1]
    communication worker:        g_sum[t] = AllReduce(g_local[t])   (ring, optionally compressed)

(the worker is the engine's, Comm.background)
so the all-reduce of step t runs while step t+1 computes, and every update uses the aggregated
gradient one iteration stale (the seed's K-1 = 1). The seed starts from g_sum = 0 for the first
K-1 iterations; we skip that update instead (a zero gradient would still apply weight decay).
`warmup` steps of plain synchronous all-reduce SGD come first (the seed's warm-up epochs).
The aggregated gradient is the mean, not the sum, so learning rates match single-node training.
"""
from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from typing import TYPE_CHECKING

from p2ptrain.algorithms.base import Algorithm, Comm, buffer_like
from p2ptrain.algorithms.collectives import CHUNK_KB_HELP, DEFAULT_CHUNK_KB
from p2ptrain.algorithms.host_allreduce import HOST_MEMORY_HELP
from p2ptrain.algorithms.member_ring import MemberRing
from p2ptrain.algorithms.registry import AlgorithmOptions, AlgorithmSpec, BuildContext, option, register
from p2ptrain.compression import CODEC_HELP, CODEC_NAMES, NEEDS_ERROR_FEEDBACK

if TYPE_CHECKING:
    import torch

WIDTH = 2  # K: the seed shows K = 2 is optimal under limited resources


@dataclass(frozen=True)
class PipeSGDOptions(AlgorithmOptions):
    compression: str = option("none", CODEC_HELP, choices=CODEC_NAMES)
    ring_chunk_kb: int = option(DEFAULT_CHUNK_KB, CHUNK_KB_HELP)
    warmup_steps: int = option(0, "synchronous all-reduce steps before pipelining")
    host_memory: bool = option(True, HOST_MEMORY_HELP)

    def validate(self, settings) -> None:
        super().validate(settings)
        if self.ring_chunk_kb < 0:
            raise ValueError(f"ring_chunk_kb must be >= 0, got {self.ring_chunk_kb}")
        if self.compression in NEEDS_ERROR_FEEDBACK:
            raise ValueError(f"compression {self.compression} drops most of the tensor and needs error feedback, "
                             "which pipesgd does not keep: use it with diloco or gossip-diloco")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")


class PipeSGD(Algorithm):
    name = "pipesgd"
    uses_gradients = True
    shares_optimizer_state = True
    elastic = True  # the ring re-forms over each step's members (member_ring.MemberRing)

    @classmethod
    def from_options(cls, comm: Comm, options: PipeSGDOptions, context: BuildContext) -> "PipeSGD":
        return cls(comm, warmup=options.warmup_steps, codec=options.compression, chunk_kb=options.ring_chunk_kb,
                   host_memory=options.host_memory)

    def __init__(self, comm: Comm, *, warmup: int = 0, codec: str = "none", chunk_kb: int = DEFAULT_CHUNK_KB,
                 host_memory: bool = True):
        if warmup < 0:
            raise ValueError(f"warmup must be >= 0 steps, got {warmup}")
        self._optimizer_state: tuple[int, torch.dtype] | None = None  # (numel, dtype): watch_optimizer_state
        self.comm = comm
        self.warmup = warmup
        self.codec = codec
        self.chunk_kb = chunk_kb
        self.host_memory = host_memory
        self.allreduce = None
        self._in_flight: concurrent.futures.Future | None = None  # g_sum[t-1] being reduced
        # the ring writes g_sum into these in turn: the engine applies g_sum[t-1] from one while
        # g_sum[t] is reduced into the other (and the ring only reads g_local[t]: no backup of it)
        self._sums: tuple[torch.Tensor, torch.Tensor] | None = None
        # g_local[t], kept while its all-reduce runs during step t+1 (the engine's buffer is rewritten)
        self._locals: tuple[torch.Tensor, torch.Tensor] | None = None
        self._turn = 0

    def setup(self, params: torch.Tensor) -> torch.Tensor:
        self.allreduce = MemberRing(self.comm, params.numel(), params.dtype, codec=self.codec,
                                    resync_deadline=self.comm.peer_timeout, chunk_bytes=self.chunk_kb * 1024,
                                    state=self._optimizer_state, holds_state=self.comm.joined is None,
                                    host_memory=self.host_memory)
        self._sums = (buffer_like(params), buffer_like(params))
        self._locals = (buffer_like(params), buffer_like(params))
        self.comm.ready()
        return params

    def reduce_gradients(self, step: int, grads: torch.Tensor) -> torch.Tensor | None:
        self.comm.set_step(step)
        out, local = self._sums[self._turn], self._locals[self._turn]
        self._turn = 1 - self._turn
        if step < self.warmup:
            return self.allreduce.reduce_or_keep(grads, step, out=out)  # synchronous warm-up
        previous = self._in_flight
        local.copy_(grads)  # (the ring of step t-1 reads the other one until previous.result())
        self._in_flight = self.comm.background(self.allreduce.reduce_or_keep, local, step, out=out)
        return previous.result() if previous is not None else None

    def watch_optimizer_state(self, numel: int, dtype: torch.dtype) -> None:
        self._optimizer_state = (numel, dtype)  # averaged with the model at every view switch

    def resync_optimizer_state(self, step: int, state: torch.Tensor) -> torch.Tensor:
        """The members' mean optimizer state (with gradients averaged, equal models and unequal
        momentum would part again)."""
        return self.allreduce.resync_state(state, step)

    def members_changed(self, step: int, params: torch.Tensor) -> torch.Tensor:
        """A new view: the old ring's in-flight mean is dropped on every member (a joiner has
        none, so all skip this step's update, as at the pipeline's start), then one model over the
        re-formed ring before its first round."""
        if self._in_flight is not None:
            self._in_flight.result()
            self._in_flight = None
        self.comm.set_step(step)
        return self.allreduce.resync(params, step)

    def after_step(self, step: int, params: torch.Tensor) -> torch.Tensor:
        return params

    def adopt_state(self, state, params: torch.Tensor) -> torch.Tensor:
        """Caught up after a stall: the donor's model replaces ours; until the next switch average
        this node holds a copy, not the members' state (MemberRing.holds_state)."""
        self.allreduce.holds_state = False
        return super().adopt_state(state, params)

    def state_dict(self) -> dict:
        """The aggregated gradient of the last step, which the next update applies (one step stale)."""
        previous = self._in_flight.result() if self._in_flight is not None else None
        self._in_flight = _done(previous) if previous is not None else None
        return {"stale_gradient": None if previous is None else previous.detach().clone()}

    def load_state_dict(self, state: dict, step: int) -> None:
        stale = state.get("stale_gradient")
        self._in_flight = _done(stale) if stale is not None else None

    def finish(self) -> None:
        """The last all-reduce has no update left to feed, but peers are part of it: complete it."""
        if self._in_flight is not None:
            self._in_flight.result()
            self._in_flight = None
        return None

    def agree_at_end(self, step: int, params: torch.Tensor) -> torch.Tensor:
        """The members' models, averaged once more if a round failed or was skipped on any of them
        (MemberRing.agree_at_end); untouched in a fault-free run."""
        return self.allreduce.agree_at_end(params, step)

    def apart_at_end(self) -> bool:
        return self.allreduce is not None and self.allreduce.apart

    def shared_state(self, params: torch.Tensor) -> tuple[str, torch.Tensor]:
        """Every member applies the same averaged gradient to the same model: the same bits."""
        return "model", params

    def stats(self) -> dict[str, float]:
        return self.allreduce.stats() if self.allreduce is not None else {}


def _done(value) -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_result(value)
    return future


register(AlgorithmSpec(
    "pipesgd", "the all-reduce of step t's gradient overlaps step t+1; update with the one-step-stale mean "
    "(seed 004 Alg. 1, K = 2)", PipeSGDOptions, PipeSGD.from_options, topologies=("ring",)))
