"""gossip-DiLoCo (in no paper): DiLoCo whose outer averaging is push-sum gossip over a time-varying
directed graph instead of an all-reduce: no global collective, and SGP's fault rules.

Per node i, every H inner steps, at the s-th outer step (notation of outer.py and pushsum.py):
    x_i ← w_i [θ_i^anchor ; Δ_i],   Δ_i = θ_i^anchor - θ_i      (+ what the codec lost earlier)
    push-sum: keep p (x_i, w_i), push p (x_i, w_i) to the out-neighbours of graph step s,
              p = 1 / (out-degree + 1); x_i += received x-shares, w_i += received w-shares
    [z_i^anchor ; z_i^Δ] = x_i / w_i    (de-biased means of the neighbourhood's anchors and
                                         pseudo-gradients)
    θ_i^anchor ← OuterNesterov(z_i^anchor, z_i^Δ);   θ_i ← θ_i^anchor
With exact mixing this is DiLoCo's outer step. Re-basing x keeps w: Σ_i w_i = n (with the shares in
flight) at every outer step. It never opens a socket and never lets a share count twice.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from p2ptrain import compression
from p2ptrain.algorithms.base import Algorithm, Comm, Kind
from p2ptrain.algorithms.outer import UNKNOWN, OuterNesterov, OuterOptions, OuterStateChannel
from p2ptrain.algorithms.pushsum import PushSum
from p2ptrain.algorithms.registry import AlgorithmSpec, BuildContext, option, register
from p2ptrain.topology import Topology, member_topology

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
KIND = Kind.PUSH_SUM
TAG = "gossip-diloco."
# codecs that go on the pseudo-gradient half of a share only, the anchor half in int8: sparsifying
# anchors would bias x / w (a receiver gets p w of weight but a few entries of p w θ^anchor)
SPARSE_SHARES = ("sparseloco", "dct-topk")


@dataclass(frozen=True)
class GossipDiLoCoOptions(OuterOptions):
    peers_per_step: int = option(1, "out-peers per step (exponential graph), max out-degree (random graph)")

    def validate(self, settings) -> None:
        super().validate(settings)
        if self.peers_per_step < 1:
            raise ValueError("peers_per_step must be >= 1")
        # A dense codec compresses a share whole, scaled by the anchors' magnitudes: 16-bit or int8 (with
        # error feedback) serve; int4, fp4 and global top-k would drown the pseudo-gradients. The chunked
        # sparse codecs take the pseudo-gradient half only (SPARSE_SHARES).
        if self.compression in ("topk", "int4", "fp4"):
            raise ValueError(f"gossip-diloco pushes anchors with its pseudo-gradients, and compression "
                             f"{self.compression} scaled by the anchors would drown them: use none, trunc16, fp16, "
                             f"bf16, int8, or {' or '.join(SPARSE_SHARES)} (pseudo-gradients only)")


class GossipDiLoCo(Algorithm):
    """gossip-DiLoCo on one node. It keeps SGP's guarantees: bounded delay, dropped links, stalled
    and dead peers, no push-sum mass lost. A share that misses the link deadline is folded into a
    later outer step, never lost; one that is refused or cannot be delivered is re-absorbed by its
    sender; a peer that acknowledges nothing (it stalled) is skipped (pushsum.py has the rules).

    A (re)joining node takes a donor's anchor and half of its push-sum weight (the donor keeps z),
    then asks the donor for its momentum with an offer request (outer.py), answered at the donor's
    next step (_serve)."""

    name = "gossip-diloco"
    elastic = True  # a joiner gets a new unit of mass at our anchor, a leaver hands its mass over (as SGP)
    holds_mass = True

    @classmethod
    def from_options(cls, comm: Comm, options: GossipDiLoCoOptions, context: BuildContext) -> "GossipDiLoCo":
        H, members = options.inner_steps, comm.membership.placed
        # the graph's schedule counts outer steps; who is a member is known by the training step
        # (outer step s runs after training step (s + 1) H - 1)
        graph = member_topology(context.topology, comm.world_size, lambda s: members((s + 1) * H - 1),
                                peers_per_step=options.peers_per_step, seed=context.seed)
        return cls(comm, graph, **options.outer_settings())

    def __init__(self, comm: Comm, topology: Topology, *, inner_steps: int, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, compression: str = "none", topk_fraction: float = 0.01,
                 value_bits: int = 2):
        GossipDiLoCoOptions(inner_steps=inner_steps, outer_lr=outer_lr, outer_momentum=outer_momentum,
                            compression=compression, topk_fraction=topk_fraction, value_bits=value_bits).validate(None)
        self.comm = comm
        self.rank = comm.rank
        self.topology = topology
        self.H = inner_steps
        self.outer = OuterNesterov(outer_lr, outer_momentum)
        self.codec_name, self.topk_fraction, self.value_bits = compression, topk_fraction, value_bits
        self.mass: PushSum | None = None
        self.anchor: torch.Tensor | None = None
        self.momentum: torch.Tensor | None = None
        self.version = 0           # outer steps applied (UNKNOWN until a donor's momentum came)
        self.state: OuterStateChannel | None = None
        self.ledger: list[tuple] | None = None  # set to [] before setup to record every mass movement (tests)
        self._donor: int | None = None  # asked for its outer state
        self._sink = None  # watch_mass's, given to the push-sum mass made at setup
        self._params: torch.Tensor | None = None
        self._last_step = -1

    # The push-sum state, as tests and stats read it
    w = property(lambda self: self.mass.w)
    min_w = property(lambda self: self.mass.min_w)
    refused_shares = property(lambda self: self.mass.refused_shares)
    dropped_shares = property(lambda self: self.mass.dropped_shares)

    # Hooks ------------------------------------------------------------------------------------------
    def setup(self, params: torch.Tensor) -> torch.Tensor:
        codec = compression.make_codec(self.codec_name, topk_fraction=self.topk_fraction, value_bits=self.value_bits)
        if self.codec_name in SPARSE_SHARES:  # [θ^anchor ; Δ]: dense anchors, sparse pseudo-gradients
            codec = compression.Halves(compression.get_codec("int8"), codec)
        self.mass = PushSum(self.comm, kind=KIND, codec=codec, log=log)
        self.mass.ledger, self.mass.sink = self.ledger, self._sink
        joined = self.comm.joined  # a rejoined node: the donor's anchor (loaded as params) and half its w
        numel = params.numel()
        self.mass.start(params.new_zeros(2 * numel), joined.ps_weight if joined is not None else 1.0,
                        delivered=joined is not None)
        self.anchor = params.detach().clone()
        self.momentum = params.new_zeros(params.shape)
        self.mass.expect(self.mass.x)
        self.comm.expect(Kind.LEAVE, params.dtype, 2 * numel, preallocate=0)  # mass of nodes that leave
        self.state = OuterStateChannel(self.comm, params.numel(), params.dtype, tag=TAG, kind=KIND)
        self.comm.ready()
        if joined is not None:
            self._ask(joined.sender, joined.step)
        self._params = params
        return params

    def after_step(self, step: int, params: torch.Tensor) -> torch.Tensor:
        self.comm.set_step(step)
        self._last_step, self._params = step, params
        self._serve(step, params)
        if (step + 1) % self.H == 0:
            self._outer_step(step, (step + 1) // self.H - 1, params)
        self.mass.take_over(step)
        return params

    def finish(self) -> torch.Tensor | None:
        """A last outer step if the run ended between two (every node decides alike), then receive the
        shares still in flight, wait for every ack (re-absorbing refusals): no mass is left on the wire."""
        params = self._params
        if params is None:
            return None
        last = self._last_step
        if (last + 1) % self.H:
            self._outer_step(last + 1, (last + 1) // self.H, params)
            last += 1
        self.mass.finish([], last)
        self.mass.take_over_at_end(last + 1)
        return params

    def donate_state(self, peer: int, step: int, params: torch.Tensor) -> None:
        """Give a (re)joining peer our anchor and half of our push-sum mass (Σ w is conserved; our z
        stays); it asks for our momentum next."""
        self.mass.split(peer, step, model=self.anchor)
        return None

    def welcome(self, peer: int, step: int, params: torch.Tensor) -> None:
        """A fresh process (a joiner or a restarted node) starts with a new unit of mass at our
        anchor (Σ w = the member count)."""
        self.mass.welcome(peer, step, model=self.anchor)

    def hand_over(self, members: list[int], step: int) -> None:
        """This node leaves (after finish()): its whole mass goes to a member that stays, which
        retires one unit of it."""
        self.mass.hand_over(members, step)

    def adopt_state(self, state, params: torch.Tensor) -> torch.Tensor:
        """Caught up after a stall: the donor's anchor replaces ours, its half of the mass joins ours,
        and its momentum is asked for."""
        self.anchor.copy_(state.tensor.view_as(self.anchor))
        sender, sent = state.sender, state.step
        self.mass.merge(state, self._last_step + 1, x_share=self.mass.z * state.ps_weight,  # (releases state)
                        new_unit=self._last_step < 0)  # a fresh process's second donor: a new unit
        params.copy_(self.anchor)
        self._ask(sender, sent)
        return params

    def watch_mass(self, sink) -> None:
        self._sink = sink
        if self.mass is not None:
            self.mass.sink = sink

    def stats(self) -> dict[str, float]:
        return {**self.mass.stats(), "outer_steps": float(max(self.version, 0))}

    def mass_flows(self) -> dict[str, float]:
        return self.mass.flow_totals()

    # The outer step ---------------------------------------------------------------------------------
    def _outer_step(self, step: int, s: int, params: torch.Tensor) -> None:
        """The s-th outer step: push-sum of x = w [θ^anchor ; Δ], then the outer step from the
        de-biased mean anchor with the de-biased mean pseudo-gradient.

        The anchors are averaged by plain push-sum (a contraction) and only the pseudo-gradients go
        through the momentum, so the anchors stay together: mixing pseudo-gradients alone lets them
        drift apart (each node then trains on little more than its own shard: 0.75 accuracy instead
        of 0.92 on the reproduction's task), and an outer step on θ^anchor - z^θ (mixing only
        models) puts the anchors' disagreement through the momentum too (0.80). A share is two model
        sizes, about what a ring all-reduce sends per node."""
        mass = self.mass
        n = self.anchor.numel()
        mass.x[:n].copy_(self.anchor)
        mass.x[n:].copy_(self.anchor).sub_(params)
        mass.x.mul_(mass.w)  # x = w [θ^anchor ; Δ]: Σ w unchanged (push adds what the codec lost earlier)
        peers = [peer for peer in self.comm.membership.live(self.topology.out_peers(self.rank, s))
                 if self.comm.make_room(peer, 1)]
        mass.push(peers, step)
        mass.reabsorb_refused(step)
        mass.mix(self.topology.in_peers(self.rank, s), step, step,
                 senders_now=lambda: self.topology.in_peers(self.rank, s))
        mass.record("w", step, mass.w)
        z = mass.debias()
        self.anchor.copy_(z[:n])
        self.outer.step(self.anchor, z[n:], self.momentum)
        if self.version != UNKNOWN:
            self.version += 1
        params.copy_(self.anchor)

    # Outer state for (re)joining peers ----------------------------------------------------------------
    def _ask(self, donor: int, step: int) -> None:
        self.version, self._donor = UNKNOWN, donor
        self.state.announce([donor], step, UNKNOWN)

    def _serve(self, step: int, params: torch.Tensor) -> None:
        """Answer offer requests; take the outer state we asked for when it came."""
        for peer, _ in self.state.requests(step + self.H):
            self.state.offer(peer, step, self.anchor, self.momentum, self.version)
        for offer in self.state.offers(step + self.H):
            if self.version == UNKNOWN and offer.sender == self._donor:
                params.add_(offer.anchor - self.anchor)  # keep the progress made since the donor's anchor
                self.anchor.copy_(offer.anchor)
                self.momentum.copy_(offer.momentum)
                self.version = max(offer.version, 0)
                log.info("node %d: took node %d's outer state (version %d)", self.rank, offer.sender, offer.version)


register(AlgorithmSpec(
    "gossip-diloco", "DiLoCo whose outer averaging is push-sum gossip: H local AdamW steps, push-sum of the models, "
    "then an outer Nesterov step on the de-biased pseudo-gradient anchor - x/w (no global collective)",
    GossipDiLoCoOptions,
    GossipDiLoCo.from_options, topologies=("exponential", "ring", "complete", "random"), default_optimizer="adamw"))

__all__ = ["GossipDiLoCo", "GossipDiLoCoOptions"]
