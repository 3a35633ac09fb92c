"""ψ: the push-sum weight every node has when no mass is missing, from the schedule alone.

The weights of push-sum do not depend on the model: with the column-stochastic P^(k) of the
topology (p_j = 1 / (out-degree_j + 1)) and overlap τ,

    ψ ← diag(P^(k)) ψ,   then + offdiag(P^(k-τ)) ψ^(k-τ)      (the shares sent τ steps earlier),
    ψ^(0) = 1,

and every node knows the schedule, so each one can run this recursion for all nodes and read its own
entry. SGP scales its local update by min(1, w / ψ_self) (`scale`): exactly 1 in a run where nothing
is missing, on every graph. It never sends anything and never touches x; it costs O(arcs) per step
(numpy), nothing per model parameter.
"""
from __future__ import annotations

from collections import deque

import numpy as np

from p2ptrain.topology import Topology

ROUNDING = 1e-9  # w and ψ add the same shares in another order: relative differences of a few ulps


class FaultFreeWeights:
    """ψ of every rank of `topology`, advanced on demand to the step a node asks about. It mirrors
    the node's own bookkeeping step for step (SGP's after_step, _flush and resume), view switches
    included (_switch)."""

    def __init__(self, topology: Topology, overlap: int):
        if overlap < 0:
            raise ValueError(f"overlap τ must be >= 0, got {overlap}")
        self.topology, self.tau = topology, overlap
        self._members = set(topology.members(0))
        self._seen: tuple[int, ...] | None = None  # the members tuple last compared with _members
        self.psi = np.zeros(topology.world_size)  # weight held at each node (shares in flight excluded)
        self.psi[sorted(self._members)] = 1.0
        self.in_flight: deque[tuple[int, np.ndarray, np.ndarray]] = deque()  # (step, receivers, weights)
        self.next_step = 0        # the push of this step has not been simulated yet
        self.mixed_through = -1   # shares of steps up to this one were all folded in (a flush)

    def at_update(self, rank: int, step: int) -> float:
        """ψ_rank when the node makes its local update of `step` (after step - 1's push and mix)."""
        self.advance(step)
        return float(self.psi[rank])

    def scale(self, w: float, rank: int, step: int) -> float:
        """min(1, w / ψ): exactly 1 when w is ψ up to float rounding. A node that trains while the
        schedule has it outside the members (ψ = 0: a joiner whose view came late, a node the others
        finished without) pushes to nobody and holds its own unit at most: ψ = 1 for it, so a
        drained w cannot multiply its learning rate by 1 / w (a joiner left at w = 1/96 diverged).

        In a run where nothing is missing w = ψ_self and the factor is exactly 1 on every graph
        (irregular in- and out-degrees, nodes that push to nobody at some steps, any τ), so the
        update is the seed's x ← x − γ∇f(z); where a crashed node took mass away, or a frozen one
        holds shares, w < ψ_self and the update shrinks with it. (A w_steady computed from a node's
        own out-degree is exact only on regular graphs: elsewhere it made Σ x move by γ Σ s_i ∇f_i
        with unequal s_i, a weighted objective.)"""
        psi = self.at_update(rank, step)
        if psi <= 0.0:
            psi = 1.0
        if w >= psi * (1.0 - ROUNDING):
            return 1.0
        return max(0.0, w / psi)

    def advance(self, step: int) -> None:
        """Simulate the pushes and mixes of every step before `step`."""
        while self.next_step < step:
            self._step(self.next_step)
            self.next_step += 1

    def flush(self, last: int) -> None:
        """Every share in flight arrives (the node flushed at `last`: a checkpoint or the end)."""
        self.advance(last + 1)
        while self.in_flight:
            _, receivers, weights = self.in_flight.popleft()
            np.add.at(self.psi, receivers, weights)
        self.mixed_through = max(self.mixed_through, last)

    def resume(self, step: int) -> None:
        """Resuming at `step` from a checkpoint that flushed everything through step - 1."""
        self.flush(step - 1)

    def _step(self, k: int) -> None:
        members = self.topology.members(k)
        if members is not self._seen:  # (the same tuple object while the view holds: no O(n) set)
            self._seen = members
            if set(members) != self._members:
                self._switch(set(members))
        senders, receivers = self.topology.arc_arrays(k)
        psi = self.psi
        if senders.size:
            keep = 1.0 / (np.bincount(senders, minlength=psi.size) + 1.0)
            self.in_flight.append((k, receivers, keep[senders] * psi[senders]))
            psi *= keep
        if k - self.tau > self.mixed_through:
            while self.in_flight and self.in_flight[0][0] <= k - self.tau:
                _, receivers, weights = self.in_flight.popleft()
                np.add.at(psi, receivers, weights)

    def _switch(self, members: set[int]) -> None:
        """A view switch: joiners start with one unit, leavers' weight (and what was on its way to
        them) goes, and the members' weights are scaled to sum to the member count, as the real Σ w
        does (welcome / take_over). The weights it then predicts are those of a run that started at
        the switch with today's profile: exact on regular graphs, a transient that decays with the
        graph's mixing elsewhere."""
        for rank in members - self._members:
            self.psi[rank] = 1.0
        gone = np.array(sorted(self._members - members), dtype=np.int64)
        if gone.size:
            self.psi[gone] = 0.0
            for _, receivers, weights in self.in_flight:
                weights[np.isin(receivers, gone)] = 0.0
        total = float(self.psi.sum()) + sum(float(weights.sum()) for _, _, weights in self.in_flight)
        if total > 0 and members:
            factor = len(members) / total
            self.psi *= factor
            for _, _, weights in self.in_flight:
                weights *= factor
        self._members = members


__all__ = ["FaultFreeWeights", "ROUNDING"]
