"""Stochastic Gradient Push (seed 000 Alg. 1, seed 002) with τ-overlap.

Per node i and step k, in the seed's notation:
    x_i^{k+1/2} = x_i^k - γ ∇F_i(z_i^k)                 (engine: local optimizer step at z)
    send (p x_i^{k+1/2}, p w_i^k) to each out-neighbour,  p = 1 / (out-degree + 1)
    x_i^{k+1} = p x_i^{k+1/2} + Σ_j received x-shares,   w_i^{k+1} = p w_i^k + Σ_j received w-shares
    z_i^{k+1} = x_i^{k+1} / w_i^{k+1}
With overlap τ ≥ 1 the shares sent at step k are mixed in at step k+τ; τ = 0 is synchronous. This
file is the schedule (which peers at which step, the τ-overlap) and the step guard; the mass rules
and their invariant Σ_i w_i = n are pushsum.py's (PushSum, shared with gossip-DiLoCo). Never: push
into a peer that cannot push back, or step by γ / w while mass is missing (SGP.after_step).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from p2ptrain import compression
from p2ptrain.algorithms.base import Algorithm, Comm, Kind
from p2ptrain.algorithms.fault_free_weights import FaultFreeWeights
from p2ptrain.algorithms.pushsum import FINISH_WAIT_SECONDS, PLAUSIBLE_SCALE, PushSum
from p2ptrain.algorithms.registry import AlgorithmOptions, AlgorithmSpec, BuildContext, option, register
from p2ptrain.topology import Topology, member_topology

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
KIND = Kind.PUSH_SUM
DRAINED = 1e-3  # w below this fraction of ψ: push nothing until in-shares refill it (see SGP)
VOID_REACH = 64  # steps back whose out-peers are remembered, for peers a late view names (SGP._tell_skipped)


@dataclass(frozen=True)
class SGPOptions(AlgorithmOptions):
    overlap: int = option(0, "bounded delay τ: shares sent at step k are mixed in by step k+τ; 0 = synchronous",
                          metavar="TAU")
    peers_per_step: int = option(1, "out-peers per step (exponential graph), max out-degree (random graph)")
    share_compression: str = option("none", "codec of the pushed x-shares (w travels exact): trunc16/fp16/bf16 halve "
                                    "the bytes, int8 / int4 cut them to 1/4 / 1/8; what a share loses stays with the "
                                    "sender and goes out with its next share (error feedback)",
                                    choices=tuple(c for c in compression.CODEC_NAMES
                                                  if c not in compression.NEEDS_ERROR_FEEDBACK))

    def bounded_delay(self) -> int:
        return self.overlap

    def validate(self, settings) -> None:
        super().validate(settings)
        if self.overlap < 0:
            raise ValueError(f"overlap τ must be >= 0, got {self.overlap}")
        if self.peers_per_step < 1:
            raise ValueError("peers_per_step must be >= 1")
        if settings is not None and self.overlap >= settings.step_window:
            raise ValueError("overlap τ must be smaller than step_window")


class SGP(Algorithm):
    """SGP on one node: which peers get a share at which step, when shares are mixed in (τ steps
    later; the loop waits only if they are not there by then, at most the link deadline), and the
    step guard. Dead peers are skipped (p = 1 / (live out-degree + 1)); a fresh process (joiner or
    restart) gets a new unit at a donor's z, and a node that stalled and was excluded catches up by
    merging half of a donor's (x, w) into its own (adopt_state): its own mass is not thrown away.

    The drain guard: a node whose w fell below DRAINED ψ_i pushes to nobody (p = 1) until in-shares
    refill it. A node that runs ahead of peers that take its shares but send none back (they lag,
    restart, or die after acknowledging) halves w at every push: 2^-40 was seen under dense churn,
    and at 1e-45 the float32 x underflows and z = x / w is no longer finite. Without a fault w = ψ_i:
    the guard is never active."""

    name = "sgp"
    elastic = True  # joins, leaves (SIGTERM) and view switches: topology over each step's members
    holds_mass = True

    @classmethod
    def from_options(cls, comm: Comm, options: SGPOptions, context: BuildContext) -> "SGP":
        graph = member_topology(context.topology, comm.world_size, comm.membership.placed,
                                peers_per_step=options.peers_per_step, seed=context.seed)
        return cls(comm, graph, overlap=options.overlap, codec=options.share_compression)

    def __init__(self, comm: Comm, topology: Topology, overlap: int = 0, codec: str = "none"):
        if overlap < 0:
            raise ValueError(f"overlap τ must be >= 0, got {overlap}")
        self.comm = comm
        self.topology = topology
        self.tau = overlap
        self.rank = comm.rank
        self.mass = PushSum(comm, kind=KIND, codec=compression.get_codec(codec), log=log)
        self.fault_free = FaultFreeWeights(topology, overlap)  # ψ: the w of each node when nothing is missing
        self._last_step = -1
        self._mixed_through = -1  # shares of steps up to this one were all folded in (a checkpoint's flush)
        self.drained_steps = 0    # steps this node pushed nothing because its w had drained (DRAINED)
        self._scheduled: dict[int, frozenset[int]] = {}  # step -> our out-peers then, as our views had it
        self._views_seen: tuple[int, int] | None = None  # the latest view's order when those were last checked

    # The push-sum state, as tests and stats read it
    x = property(lambda self: self.mass.x)
    w = property(lambda self: self.mass.w)
    z = property(lambda self: self.mass.z)
    min_w = property(lambda self: self.mass.min_w)
    refused_shares = property(lambda self: self.mass.refused_shares)
    dropped_shares = property(lambda self: self.mass.dropped_shares)

    @property
    def ledger(self) -> list[tuple] | None:
        return self.mass.ledger

    @ledger.setter
    def ledger(self, value: list[tuple] | None) -> None:  # set to [] to record every mass movement (tests)
        self.mass.ledger = value

    def setup(self, params: torch.Tensor) -> torch.Tensor:
        joined = self.comm.joined
        # a rejoined node: its share of a donor's w (params are z; the donor sent its x / 2 = z w / 2)
        z = self.mass.start(params, joined.ps_weight if joined is not None else 1.0, delivered=joined is not None)
        if joined is not None:
            self.mass.record("mix", joined.step, joined.ps_weight, joined.sender, joined.step)
            self.mass.record("w", joined.step, self.mass.w)
        self.mass.expect(params)
        self.comm.expect(Kind.LEAVE, params.dtype, params.numel(), preallocate=0)  # mass of nodes that leave
        self.comm.ready(self.topology.neighbourhood(self.rank))
        return z

    def after_step(self, step: int, params: torch.Tensor) -> torch.Tensor:
        """Push, re-absorb refusals, mix the shares of step - τ, and return z.

        The engine computes with z and applies the optimizer there; the resulting change z' - z is
        applied to x, which is exactly x - γ d for any optimizer direction d (momentum included).

        The step guard: the local update is scaled by min(1, w / ψ_i), where ψ_i is the w node i has
        at that point in a run where no mass is missing: the push-sum recursion of the weights alone
        over the known schedule, with the same τ (fault_free_weights.py). With the seed's unscaled
        update z steps γ / w, so once mass is gone with a crashed node, or held by a frozen one until
        it answers, every node's learning rate grows with the mass missing (3.4x seen, and the
        models diverged). Without a fault w = ψ_i and the factor is exactly 1 on every graph: the
        seed's update."""
        self.comm.set_step(step)
        self._tell_skipped(step)
        # x^{k+1/2} = x^k + (z' - z), scaled by min(1, w / ψ) (1 unless mass is missing), then pushed
        self._push(step, update=(params, self.fault_free.scale(self.mass.w, self.rank, step)))
        self.mass.reabsorb_refused(step)
        if step - self.tau > self._mixed_through:
            self._mix(step - self.tau, step)
        self.mass.take_over(step)
        self.mass.record("w", step, self.mass.w)
        return self.mass.debias(out=params)  # z straight into the model the engine loads

    def finish(self) -> torch.Tensor:
        """Receive the shares still in flight (the last τ steps, and earlier ones that missed their
        deadline) so no mass is left on the wire; wait for every ack (re-absorbing refusals)."""
        self._flush()
        self.mass.close(self._last_step + 1)
        self.mass.fold_residual()
        self.mass.take_over_at_end(self._last_step + 1)
        self.mass.record("w", self._last_step + 1, self.mass.w)
        return self.mass.debias()

    def state_dict(self) -> dict:
        """(x, w) after folding in everything in flight up to the last step (every node checkpoints
        at the same step, so Σ w = n holds in the checkpoints themselves)."""
        self._flush()
        self.mass.fold_residual()
        self.mass.debias()
        return {"x": self.mass.x.detach().clone(), "w": self.mass.w, "step": self._last_step}

    def load_state_dict(self, state: dict, step: int) -> torch.Tensor:
        """Resume at `step` with the checkpoint's (x, w); returns z = x / w, the model to load."""
        self.mass.restore(state["x"], float(state["w"]))
        self._last_step = self._mixed_through = step - 1  # everything before was folded in when saved
        self.fault_free.resume(step)
        self.mass.missing.clear()
        return self.mass.debias()

    def _flush(self) -> None:
        """Fold in every share of the steps not mixed yet, and the late ones (PushSum.flush)."""
        last = self._last_step
        unmixed = [(self.topology.in_peers(self.rank, step), step)
                   for step in range(max(0, last - self.tau + 1, self._mixed_through + 1), last + 1)]
        self.mass.flush(unmixed, last)
        self.fault_free.flush(last)
        self._mixed_through = last

    def adopt_state(self, state, params: torch.Tensor) -> torch.Tensor:
        """Catch up after a stall: merge the donor's half (x_d / 2, w_d / 2), sent as z_d with weight
        w_d / 2, into our own (x, w). Σ w is conserved and z moves to the weighted mean. Before
        its first step a fresh process merges a second donor's answer: a new unit (welcome)."""
        return self.mass.merge(state, self._last_step + 1, new_unit=self._last_step < 0)

    def donate_state(self, peer: int, step: int, params: torch.Tensor) -> torch.Tensor:
        """Give a (re)joining peer half of (x, w): Σ w is conserved and both have this node's z."""
        return self.mass.split(peer, step)

    def welcome(self, peer: int, step: int, params: torch.Tensor) -> None:
        """A fresh process (a joiner or a restarted node) starts with a new unit of mass at our z
        (Σ w = the member count)."""
        self.mass.welcome(peer, step)

    def hand_over(self, members: list[int], step: int) -> None:
        """This node leaves (after finish()): its whole (x, w) goes to a member that stays, which
        retires one unit of it."""
        self.mass.hand_over(members, step)

    def watch_mass(self, sink) -> None:
        self.mass.sink = sink

    def stats(self) -> dict[str, float]:
        return {**self.mass.stats(), "drained_steps": float(self.drained_steps),
                "voided_shares": float(self.mass.voids_sent)}

    def mass_flows(self) -> dict[str, float]:
        return self.mass.flow_totals()

    # The seed's steps --------------------------------------------------------------------------
    def _push(self, step: int, update: tuple[torch.Tensor, float]) -> None:
        """Push to the live out-peers of `step` that have room. A peer that acknowledges none of our
        last τ + 1 shares within a link deadline (it stalled: GC pause, swap, a stopped VM) gets no
        further share until it does, and a peer that lags more than the lag limit behind gets none
        at all: nobody keeps pushing mass into a node that cannot push back (its w would drain
        everyone else's towards 0, and z = x / w with it)."""
        self._last_step = step
        window = self.tau + 1  # a share per step of the bounded delay may be on its way
        scheduled = self.topology.out_peers(self.rank, step)
        peers = [peer for peer in self.comm.membership.live(scheduled) if self.comm.make_room(peer, window)]
        if peers and self._drained(step):
            peers = []
        self.mass.push(peers, step, update=update)
        self._scheduled[step] = frozenset(scheduled)
        self._scheduled.pop(step - VOID_REACH, None)

    def _tell_skipped(self, step: int) -> None:
        """A view that reached us after its switch can make peers our out-peers at steps we already
        pushed by the view before it: they would wait a link deadline for a share that went to
        another node (which folds it in late: no mass is lost). Tell them at once that none comes
        (PushSum.void). Only a newly adopted view sets this off, and one that came in time leaves
        every past step's out-peers as they were: without a late view no notice is ever sent."""
        order = self.comm.membership.view_order()
        if order == self._views_seen:
            return
        self._views_seen = order
        live = self.comm.membership.live
        for past, scheduled in list(self._scheduled.items()):
            owed = [peer for peer in live(self.topology.out_peers(self.rank, past)) if peer not in scheduled]
            if owed and past < step:
                self.mass.void(owed, past)
                self._scheduled[past] = scheduled | frozenset(owed)

    def _drained(self, step: int) -> bool:
        """w < DRAINED ψ_i (ψ = 1 for a node outside the schedule's members): keep all mass this step."""
        psi = self.fault_free.at_update(self.rank, step)
        drained = self.mass.w < DRAINED * (psi if psi > 0.0 else 1.0)
        if drained:
            if not self.drained_steps or self.drained_steps % 1000 == 0:
                log.warning("node %d: push-sum weight drained to %.3g (%.3g of the fault-free %.3g) at step %d: "
                            "pushing nothing until in-shares refill it", self.rank, self.mass.w,
                            self.mass.w / (psi or 1.0), psi, step)
            self.drained_steps += 1
        return drained

    def _mix(self, step: int, now: int) -> None:
        """Add the step-`step` shares of the in-neighbours that arrive within the link deadline, and
        any late ones that arrived meanwhile; remember the missing ones (they are folded in later)."""
        self.mass.mix(self.topology.in_peers(self.rank, step), step, now,
                      senders_now=lambda: self.topology.in_peers(self.rank, step))


register(AlgorithmSpec(
    "sgp", "push-sum gossip: keep and push p = 1/(out-degree+1) of (x, w), compute at z = x/w (seeds 000, 002)",
    SGPOptions, SGP.from_options, topologies=("exponential", "ring", "complete", "random", "chain", "binary-tree")))

__all__ = ["FINISH_WAIT_SECONDS", "PLAUSIBLE_SCALE", "SGP", "SGPOptions"]
