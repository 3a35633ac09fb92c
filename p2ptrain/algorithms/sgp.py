"""Stochastic Gradient Push (seed 000 Alg. 1, seed 002) with τ-overlap.

Per node i and step k, in the seed's notation:
    x_i^{k+1/2} = x_i^k - γ ∇F_i(z_i^k)                 (engine: local optimizer step at z)
    send (p x_i^{k+1/2}, p w_i^k) to each out-neighbour,  p = 1 / (out-degree + 1)
    x_i^{k+1} = p x_i^{k+1/2} + Σ_j received x-shares,   w_i^{k+1} = p w_i^k + Σ_j received w-shares
    z_i^{k+1} = x_i^{k+1} / w_i^{k+1}
With overlap τ ≥ 1 the shares sent at step k are mixed in at step k+τ (the loop waits only if they
are not there by then); τ = 0 is synchronous. Push-sum mass is never lost (Σ_i w_i = n, counting
the shares in flight, is what makes the de-biased z_i converge to the average):
- a share is waited for at most the link deadline; one that comes later is folded in at the next mix
  (and awaited once more in finish());
- the transport retransmits a lost share with the same message id (the receiver drops a duplicate),
  so a share is delivered at most once;
- a share the receiver definitively refuses, or that cannot be delivered because the receiver is
  dead, is re-absorbed by the sender;
- dead peers are skipped (p = 1 / (live out-degree + 1)); a rejoining peer gets half of a donor's
  (x, w), which keeps Σ w and z of the donor unchanged;
- a peer that acknowledges none of our last τ + 1 shares within a link deadline (it stalled: GC
  pause, swap, a stopped VM) gets no further share until it does, and a peer that lags more than
  the lag limit behind gets none at all: nobody keeps pushing mass into a node that cannot push
  back (its w would drain everyone else's towards 0, and z = x / w with it);
- a share whose send failed after bytes left is *settled* with the receiver before it is
  re-absorbed (the transport asks which it delivered; the rest it voids), so a stalled peer that
  wakes up with our shares in its socket never lets the same mass count twice;
- a node that stalled and was excluded catches up by merging half of a donor's (x, w) into its own
  (adopt_state): its own mass is not thrown away;
- a share that would make w exceed n (mass never does) or whose de-biased values are absurd is
  dropped, so a hostile or broken peer cannot poison the model.

The engine computes with z and applies the optimizer there; the resulting change z' - z is applied
to x, which is exactly x - γ d for any optimizer direction d (momentum included).
"""
from __future__ import annotations

import concurrent.futures
import logging
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from p2ptrain.algorithms.base import Algorithm, Comm, Kind
from p2ptrain.algorithms.registry import AlgorithmOptions, AlgorithmSpec, BuildContext, option, register
from p2ptrain.topology import Topology, build_topology

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
KIND = Kind.PUSH_SUM
FINISH_WAIT_SECONDS = 10.0  # finish(): how long to wait in all for shares that missed their deadline
PLAUSIBLE_SCALE = 1e4  # a share's de-biased values may exceed ours (or 1) by at most this factor


@dataclass(frozen=True)
class SGPOptions(AlgorithmOptions):
    overlap: int = option(0, "bounded delay τ: shares sent at step k are mixed in by step k+τ; 0 = synchronous",
                          metavar="TAU")
    peers_per_step: int = option(1, "out-peers per step (exponential graph), max out-degree (random graph)")

    def bounded_delay(self) -> int:
        return self.overlap

    def validate(self, settings) -> None:
        if self.overlap < 0:
            raise ValueError(f"overlap τ must be >= 0, got {self.overlap}")
        if self.peers_per_step < 1:
            raise ValueError("peers_per_step must be >= 1")
        if settings is not None and self.overlap >= settings.step_window:
            raise ValueError("overlap τ must be smaller than step_window")


class SGP(Algorithm):
    name = "sgp"

    @classmethod
    def from_options(cls, comm: Comm, options: SGPOptions, context: BuildContext) -> "SGP":
        graph = build_topology(context.topology, comm.world_size, peers_per_step=options.peers_per_step,
                               seed=context.seed)
        return cls(comm, graph, overlap=options.overlap)

    def __init__(self, comm: Comm, topology: Topology, overlap: int = 0):
        if overlap < 0:
            raise ValueError(f"overlap τ must be >= 0, got {overlap}")
        self.comm = comm
        self.topology = topology
        self.tau = overlap
        self.rank = comm.rank
        self.x: torch.Tensor | None = None
        self.w = 1.0
        self.z: torch.Tensor | None = None
        self._outbox: deque = deque()  # (future of Ack, x-share, w-share, receiver, step) until acknowledged
        self.refused_shares = 0
        self.dropped_shares = 0   # implausible shares refused at the fold (hostile or broken senders)
        self._z_scale = 1.0       # max |z| of the last de-biased model, for the plausibility check
        self.min_w = 1.0          # the smallest w this node ever had (a drained node would show here)
        self._last_step = -1
        self._mixed_through = -1  # shares of steps up to this one were all folded in (a checkpoint's flush)
        self._missing: set[tuple[int, int]] = set()  # (sender, step) shares awaited in vain so far
        self.ledger: list[tuple] | None = None  # set to [] to record every mass movement (tests)

    def setup(self, params: torch.Tensor) -> torch.Tensor:
        joined = self.comm.joined
        self.w = joined.ps_weight if joined is not None else 1.0  # a rejoined node: its share of a donor's w
        self.x = params.detach().clone() * self.w  # (params are z; the donor sent its x / 2 = z w / 2)
        self.comm.expect(KIND, params.dtype, params.numel())
        self.comm.ready()
        self.z = self.x / self.w
        return self.z

    def after_step(self, step: int, params: torch.Tensor) -> torch.Tensor:
        self.comm.set_step(step)
        self.x.add_(params - self.z)  # x^{k+1/2} = x^k + (z' - z)
        self._push(step)
        self._reabsorb_refused(step)
        if step - self.tau > self._mixed_through:
            self._mix(step - self.tau, step)
        self._record("w", step, self.w)
        return self._debias()

    def finish(self) -> torch.Tensor:
        """Receive the shares still in flight (the last τ steps, and earlier ones that missed their
        deadline) so no mass is left on the wire; wait for every ack (re-absorbing refusals)."""
        self._flush()
        self._record("w", self._last_step + 1, self.w)
        return self._debias()

    def state_dict(self) -> dict:
        """(x, w) after folding in everything in flight up to the last step (every node checkpoints
        at the same step, so Σ w = n holds in the checkpoints themselves)."""
        self._flush()
        self._debias()
        return {"x": self.x.detach().clone(), "w": self.w, "step": self._last_step}

    def load_state_dict(self, state: dict, step: int) -> torch.Tensor:
        """Resume at `step` with the checkpoint's (x, w); returns z = x / w, the model to load."""
        self.x.copy_(state["x"].to(self.x.device, self.x.dtype))
        self.w = float(state["w"])
        self._last_step = self._mixed_through = step - 1  # everything before was folded in when saved
        self._missing.clear()
        return self._debias()

    def _flush(self) -> None:
        last = self._last_step
        after = last + 1  # the ledger books what the flush receives after the last step
        for step in range(max(0, last - self.tau + 1, self._mixed_through + 1), last + 1):
            self._mix(step, after)
        # A live sender's share does come (it is re-sent until acknowledged, or re-absorbed only if
        # the sender thinks we are dead): worth a longer wait than one step's deadline.
        budget = min(self.comm.peer_timeout, max(self.comm.link_deadline, FINISH_WAIT_SECONDS))
        end = time.monotonic() + budget  # one budget for all of them
        for sender, step in sorted(self._missing, key=lambda m: m[1]):
            if (sender, step) in self._missing:
                wait = max(0.0, end - time.monotonic())
                self._fold(self.comm.gather(KIND, step, [sender], deadline=wait).values(), after)
        self._fold(self.comm.take(KIND, last), after)
        concurrent.futures.wait([entry[0] for entry in self._outbox], timeout=max(0.0, end - time.monotonic()))
        self._reabsorb_refused(after)
        if self._outbox:  # their receivers stalled or died and never settled: that mass is theirs now
            log.warning("node %d: %d share(s) (w %.4g in all) still unacknowledged at the end", self.rank,
                        len(self._outbox), sum(entry[2] for entry in self._outbox))
        self._mixed_through = last

    def adopt_state(self, state, params: torch.Tensor) -> torch.Tensor:
        """Catch up after a stall: merge the donor's half (x_d / 2, w_d / 2), sent as z_d with weight
        w_d / 2, into our own (x, w). Σ w is conserved and z moves to the weighted mean."""
        self.x.add_(state.tensor.view_as(self.x), alpha=state.ps_weight)
        self.w += state.ps_weight
        self._missing.clear()  # shares of steps before the rejoin: the senders had excluded us
        self._record("mix", self._last_step + 1, state.ps_weight, state.sender, state.step)
        state.release()
        return self._debias()

    def donate_state(self, peer: int, step: int, params: torch.Tensor) -> torch.Tensor:
        """Give a (re)joining peer half of (x, w): Σ w is conserved and both have this node's z."""
        share_x, share_w = self.x * 0.5, self.w * 0.5
        future = self.comm.send(peer, share_x / share_w, kind=Kind.STATE, step=step,
                                ps_weight=share_w, reliable=True, settle=True)  # sent as z: a model to load
        self._outbox.append((future, share_x, share_w, peer, step))
        self.x.mul_(0.5)
        self.w *= 0.5
        self._record("send", step, share_w, peer)
        return self._debias()

    def stats(self) -> dict[str, float]:
        return {"ps_weight": self.w, "min_ps_weight": self.min_w, "dropped_shares": float(self.dropped_shares)}

    # The seed's steps --------------------------------------------------------------------------
    def _push(self, step: int) -> None:
        self._last_step = step
        window = self.tau + 1  # a share per step of the bounded delay may be on its way
        peers = [peer for peer in self.comm.live(self.topology.out_peers(self.rank, step))
                 if self.comm.make_room(peer, window)]
        p = 1.0 / (len(peers) + 1)  # uniform weights: column i of P^(k), over the peers that take a share
        share_w = p * self.w
        for peer in peers:
            share_x = self.x * p  # a fresh tensor per peer: ownership passes to the transport
            future = self.comm.send(peer, share_x, kind=KIND, step=step, ps_weight=share_w, reliable=True,
                                    settle=True)
            self._outbox.append((future, share_x, share_w, peer, step))
            self._record("send", step, share_w, peer)
        self.x.mul_(p)
        self.w *= p

    def _mix(self, step: int, now: int) -> None:
        """Add the step-`step` shares of the in-neighbours that arrive within the link deadline, and
        any late ones that arrived meanwhile; remember the missing ones (they are folded in later)."""
        senders = self.topology.in_peers(self.rank, step)
        arrived = self.comm.gather(KIND, step, senders)
        self._missing.update((s, step) for s in self.comm.live(senders) if s not in arrived)
        self._fold(arrived.values(), now)
        self._fold(self.comm.take(KIND, step), now)  # shares of earlier steps that came late

    def _fold(self, shares, now: int) -> None:
        for share in shares:
            problem = self._implausible(share)
            if problem:
                log.error("node %d: dropped node %d's step-%d share: %s", self.rank, share.sender, share.step, problem)
                self.dropped_shares += 1
                self._missing.discard((share.sender, share.step))
                share.release()
                continue
            self.x.add_(share.tensor)
            self.w += share.ps_weight
            self._missing.discard((share.sender, share.step))
            self._record("mix", now, share.ps_weight, share.sender, share.step)
            share.release()

    def _implausible(self, share) -> str:
        """Why a share cannot be honest push-sum mass ("" if it can)."""
        n = self.comm.world_size
        if not 0.0 < share.ps_weight <= n:
            return f"weight {share.ps_weight!r} outside (0, {n}]"
        if self.w + share.ps_weight > n * (1 + 1e-9):
            return f"w would become {self.w + share.ps_weight:.6g} > n = {n} (push-sum mass never exceeds n)"
        scale = float(share.tensor.abs().max()) / share.ps_weight if share.tensor.numel() else 0.0
        if not math.isfinite(scale) or scale > PLAUSIBLE_SCALE * max(1.0, self._z_scale):
            return f"de-biased values up to {scale:.3g}, ours up to {self._z_scale:.3g}"
        return ""

    def _reabsorb_refused(self, now: int) -> None:
        """Re-absorb the shares that did not get through: the receiver refused them, voided them when
        settling, or was dead before they left. Acks may complete in any order (a stalled peer's
        wait while later ones land), so every finished entry is looked at."""
        pending: deque = deque()
        for entry in self._outbox:
            future, share_x, share_w, peer, sent = entry
            if not future.done():
                pending.append(entry)
                continue
            if future.cancelled():
                log.warning("node %d: step-%d share for node %d: outcome unknown (send cancelled)", self.rank,
                            sent, peer)
                continue
            exc = future.exception()
            if exc is None and future.result().delivered:
                continue  # accepted, or a duplicate of a retransmission that was accepted
            why = f"{type(exc).__name__}: {exc}" if exc is not None else \
                f"{future.result().reason}: {future.result().detail}"
            log.warning("node %d: step-%d share for node %d not delivered (%s); re-absorbing it", self.rank,
                        sent, peer, why)
            self.x.add_(share_x)
            self.w += share_w
            self.refused_shares += 1
            self._record("reabsorb", now, share_w, peer, sent)
        self._outbox = pending

    def _record(self, event: str, step: int, weight: float, peer: int = -1, sent: int = -1) -> None:
        if self.ledger is not None:
            self.ledger.append((event, step, weight, peer, sent))

    def _debias(self) -> torch.Tensor:
        self.min_w = min(self.min_w, self.w)
        self.z = self.x / self.w
        self._z_scale = float(self.z.abs().max()) if self.z.numel() else 0.0
        return self.z


register(AlgorithmSpec(
    "sgp", "push-sum gossip: keep and push p = 1/(out-degree+1) of (x, w), compute at z = x/w (seeds 000, 002)",
    SGPOptions, SGP.from_options, topologies=("exponential", "ring", "complete", "random", "chain", "binary-tree")))
