"""Stochastic Gradient Push (seed 000 Alg. 1, seed 002) with τ-overlap.

Per node i and step k, in the seed's notation:
    x_i^{k+1/2} = x_i^k - γ ∇F_i(z_i^k)                 (engine: local optimizer step at z)
    send (p x_i^{k+1/2}, p w_i^k) to each out-neighbour,  p = 1 / (out-degree + 1)
    x_i^{k+1} = p x_i^{k+1/2} + Σ_j received x-shares,   w_i^{k+1} = p w_i^k + Σ_j received w-shares
    z_i^{k+1} = x_i^{k+1} / w_i^{k+1}
With overlap τ ≥ 1 the shares sent at step k are mixed in at step k+τ (the loop waits only if they
are not there by then); τ = 0 is synchronous. Shares that arrive even later (or were sent in steps
whose receive point has passed) are folded in at the next mix: push-sum mass is never dropped.
A share the receiver definitively refuses is re-absorbed by the sender for the same reason.

The engine computes with z and applies the optimizer there; the resulting change z' - z is applied
to x, which is exactly x - γ d for any optimizer direction d (momentum included).
"""
from __future__ import annotations

import logging
from collections import deque

import torch

from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.algorithms.base import Algorithm
from p2ptrain.topology import Topology

log = logging.getLogger(__name__)
KIND = pb.MESSAGE_KIND_PUSH_SUM


class SGP(Algorithm):
    name = "sgp"

    def __init__(self, comm, topology: Topology, overlap: int = 0):
        if overlap < 0:
            raise ValueError(f"overlap τ must be >= 0, got {overlap}")
        self.comm = comm
        self.topology = topology
        self.tau = overlap
        self.rank = comm.rank
        self.x: torch.Tensor | None = None
        self.w = 1.0
        self.z: torch.Tensor | None = None
        self._outbox: deque = deque()  # (future of Ack, x-share, w-share) until acknowledged
        self.refused_shares = 0
        self._last_step = -1

    def setup(self, params: torch.Tensor) -> torch.Tensor:
        self.x = params.detach().clone()
        self.w = 1.0
        self.comm.expect(KIND, params.dtype, params.numel())
        self.comm.ready()
        self.z = self.x.clone()
        return self.z

    def after_step(self, step: int, params: torch.Tensor) -> torch.Tensor:
        self.comm.set_step(step)
        self.x.add_(params - self.z)  # x^{k+1/2} = x^k + (z' - z)
        self._push(step)
        self._reabsorb_refused()
        if step >= self.tau:
            self._mix(step - self.tau)
        return self._debias()

    def finish(self) -> torch.Tensor:
        """Receive the shares still in flight (the last τ steps) so no mass is left on the wire."""
        last = self._last_step
        for step in range(max(0, last - self.tau + 1), last + 1):
            self._mix(step)
        for future, _, _ in self._outbox:
            future.exception()  # wait for every ack
        self._reabsorb_refused()
        return self._debias()

    def stats(self) -> dict[str, float]:
        return {"ps_weight": self.w}

    # The seed's steps --------------------------------------------------------------------------
    def _push(self, step: int) -> None:
        self._last_step = step
        peers = self.topology.out_peers(self.rank, step)
        p = 1.0 / (len(peers) + 1)  # uniform weights: column i of P^(k)
        share_w = p * self.w
        for peer in peers:
            share_x = self.x * p  # a fresh tensor per peer: ownership passes to the transport
            future = self.comm.send(peer, share_x, kind=KIND, step=step, ps_weight=share_w, reliable=True)
            self._outbox.append((future, share_x, share_w))
        self.x.mul_(p)
        self.w *= p

    def _mix(self, step: int) -> None:
        """Add the step-`step` shares of all in-neighbours (waiting for them) and any late ones."""
        senders = self.topology.in_peers(self.rank, step)
        arrived = list(self.comm.recv(KIND, step, senders).values())
        arrived += self.comm.take(KIND, step)  # shares of earlier steps that came late
        for share in arrived:
            self.x.add_(share.tensor)
            self.w += share.ps_weight
            share.release()

    def _reabsorb_refused(self) -> None:
        """Acks come back in order of sending; re-absorb shares the receiver refused."""
        while self._outbox and self._outbox[0][0].done():
            future, share_x, share_w = self._outbox.popleft()
            exc = future.exception()
            if exc is not None:
                raise RuntimeError(f"node {self.rank}: sending a push-sum share failed: {exc}") from exc
            ack = future.result()
            if ack.status == pb.Ack.STATUS_REJECTED:
                log.warning("node %d: share refused (%s: %s); re-absorbing it", self.rank, ack.reason, ack.detail)
                self.x.add_(share_x)
                self.w += share_w
                self.refused_shares += 1

    def _debias(self) -> torch.Tensor:
        self.z = self.x / self.w
        return self.z
