"""D-PSGD (seed 003 Alg. 1): gossip with a symmetric doubly stochastic W on an undirected graph.

    x_i^{t+1/2} = Σ_j W_ij x_j^t
    x_i^{t+1}   = x_i^{t+1/2} - γ ∇f_i(x_i^t)

W are Metropolis weights W_ij = 1 / (1 + max(d_i, d_j)). The gradient is taken at the node's own
x_i^t, so the averaging of x^t runs while it computes (DPSGD.after_step). Invariant: each row of W
sums to 1, also when a neighbour's model misses the link deadline or its node is dead (W_ij then
stays on x_i). Models are sent unreliably: a lost model is not mass, so nothing needs to be re-sent,
and one that comes later than its step is stale and dropped.
"""
from __future__ import annotations

import concurrent.futures
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from p2ptrain.algorithms.base import Algorithm, Comm, Kind, send_failure
from p2ptrain.algorithms.registry import AlgorithmOptions, AlgorithmSpec, BuildContext, register
from p2ptrain.topology import MemberGraph, build_undirected, member_graph
from p2ptrain.topology.undirected import UndirectedGraph

if TYPE_CHECKING:
    import torch

KIND = Kind.GOSSIP
SEND_WINDOW = 2  # models in flight to one neighbour, at most (each is a copy of the model)
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DPSGDOptions(AlgorithmOptions):
    """D-PSGD takes no options: the graph (--topology) fixes its Metropolis weights."""


class DPSGD(Algorithm):
    name = "dpsgd"
    elastic = True  # joins, leaves (SIGTERM) and view switches: topology over each step's members

    @classmethod
    def from_options(cls, comm: Comm, options: DPSGDOptions, context: BuildContext) -> "DPSGD":
        build_undirected(context.topology, comm.world_size)  # (a bad name fails here, before any view)
        return cls(comm, member_graph(context.topology, comm.membership.placed))

    def __init__(self, comm: Comm, graph: UndirectedGraph | MemberGraph):
        if isinstance(graph, UndirectedGraph):
            if graph.world_size != comm.world_size:
                raise ValueError(f"graph has {graph.world_size} nodes, cluster {comm.world_size}")
            graph = MemberGraph.fixed(graph)
        if not isinstance(graph, MemberGraph):
            raise ValueError(f"D-PSGD needs an undirected graph (symmetric W), got {graph!r}")
        self.comm = comm
        self.rank = comm.rank
        self.graph = graph  # over each step's members (elastic runs), W symmetric in every view
        self.x: torch.Tensor | None = None  # x_i^t, the model the step's gradient was taken at
        self._acks: list[concurrent.futures.Future] = []
        self._next_step = 0

    def setup(self, params: torch.Tensor) -> torch.Tensor:
        self.comm.expect(KIND, params.dtype, params.numel())
        self.comm.ready()
        self.x = params.detach().clone()
        self._share(0)
        return params

    def after_step(self, step: int, params: torch.Tensor) -> torch.Tensor:
        """Mix the neighbours' x_j^t into this node's step. The gradient is taken at the node's own
        x_i^t, so the averaging of x^t can run while it computes (the seed notes this). The engine
        hands us x_i^t - γ d_i (its local optimizer step), hence

            x_i^{t+1} = (x_i^t - γ d_i) + Σ_{j≠i} W_ij (x_j^t - x_i^t)         (rows of W sum to 1)

        A neighbour whose x_j^t misses the link deadline (or is dead) is left out of that step's
        mix, its weight W_ij staying on x_i (the row still sums to 1); a model that comes later is
        stale and dropped."""
        self.comm.set_step(step)
        mixed = params.clone()
        weights = self.graph.metropolis_weights(self.rank, step)
        for sender, message in self.comm.gather(KIND, step, self.graph.neighbors(self.rank, step)).items():
            mixed.add_(message.tensor - self.x, alpha=weights[sender])
            message.release()
        for stale in self.comm.take(KIND, step):  # models that missed their step: out of date now
            stale.release()
        self.x = mixed
        self._share(step + 1)
        return mixed

    def state_dict(self) -> dict:
        """x^t, the model the next step's gradient is taken at and the neighbours mix with."""
        return {"x": self.x.detach().clone()}

    def load_state_dict(self, state: dict, step: int) -> None:
        """Resume at `step`: share x^step again (what the neighbours mix in at that step)."""
        self.x = state["x"].to(self.x.device, self.x.dtype).clone()
        self._share(step)

    def finish(self) -> None:
        """Consume the neighbours' last (unused) models and wait for our own sends to land."""
        neighbors = self.graph.neighbors(self.rank, self._next_step)
        for message in self.comm.gather(KIND, self._next_step, neighbors).values():
            message.release()
        for stale in self.comm.take(KIND, self._next_step):
            stale.release()
        self._check_acks(wait=True)
        return None

    def _share(self, step: int) -> None:
        """Send x^step to the live neighbours as soon as it is known, i.e. while step `step` computes;
        unreliably: a lost model is not mass, nothing needs to be re-sent."""
        self._check_acks(wait=False)
        self._next_step = step
        snapshot = self.x.clone()  # read-only from here on, shared by all sends
        for peer in self.comm.membership.live(self.graph.neighbors(self.rank, step)):
            if self.comm.make_room(peer, SEND_WINDOW):  # a stalled neighbour must not pile up our models
                self._acks.append(self.comm.send(peer, snapshot, kind=KIND, step=step))

    def _check_acks(self, wait: bool) -> None:
        if wait:  # lost models need no resend: give the last ones one link deadline, not forever
            concurrent.futures.wait(self._acks, timeout=self.comm.link_deadline)
        pending = []
        for future in self._acks:
            if not future.done():
                pending.append(future)
                continue
            exc = send_failure(future)
            if exc is not None:  # lost on the link, or the peer is dead: it mixes without us
                log.debug("node %d: a D-PSGD model was not delivered: %s", self.rank, exc)
            elif not future.result().delivered:
                outcome = future.result()
                log.warning("node %d: D-PSGD model refused: %s: %s", self.rank, outcome.reason, outcome.detail)
        self._acks = pending


register(AlgorithmSpec(
    "dpsgd", "gossip x ← Σ_j W_ij x_j with Metropolis weights on an undirected graph (seed 003 Alg. 1)",
    DPSGDOptions, DPSGD.from_options, topologies=("ring", "complete", "chain", "binary-tree")))
