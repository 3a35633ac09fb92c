"""D-PSGD (seed 003 Alg. 1): gossip with a symmetric doubly stochastic W on an undirected graph.

    x_i^{t+1/2} = Σ_j W_ij x_j^t
    x_i^{t+1}   = x_i^{t+1/2} - γ ∇f_i(x_i^t)

The gradient is taken at the node's own x_i^t, so the averaging of x^t can run while it computes
(the seed notes this). The engine hands us x_i^t - γ d_i (its local optimizer step), hence

    x_i^{t+1} = (x_i^t - γ d_i) + Σ_{j≠i} W_ij (x_j^t - x_i^t)         (rows of W sum to 1)

Node i sends x_i^{t+1} to its neighbours as soon as it has it, i.e. while step t+1 computes.
W are Metropolis weights W_ij = 1 / (1 + max(d_i, d_j)).
"""
from __future__ import annotations

import concurrent.futures

import torch

from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.algorithms.base import Algorithm
from p2ptrain.topology.undirected import UndirectedGraph

KIND = pb.MESSAGE_KIND_GOSSIP


class DPSGD(Algorithm):
    name = "dpsgd"

    def __init__(self, comm, graph: UndirectedGraph):
        if not isinstance(graph, UndirectedGraph):
            raise ValueError(f"D-PSGD needs an undirected graph (symmetric W), got {graph!r}")
        if graph.world_size != comm.world_size:
            raise ValueError(f"graph has {graph.world_size} nodes, cluster {comm.world_size}")
        self.comm = comm
        self.rank = comm.rank
        self.neighbors = graph.neighbors(self.rank)
        self.weights = graph.metropolis_weights(self.rank)
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
        self.comm.set_step(step)
        mixed = params.clone()
        for sender, message in self.comm.recv(KIND, step, self.neighbors).items():
            mixed.add_(message.tensor - self.x, alpha=self.weights[sender])
            message.release()
        self.x = mixed
        self._share(step + 1)
        return mixed

    def finish(self) -> None:
        """Consume the neighbours' last (unused) models and wait for our own sends to land."""
        for message in self.comm.recv(KIND, self._next_step, self.neighbors).values():
            message.release()
        self._check_acks(wait=True)
        return None

    def _share(self, step: int) -> None:
        self._check_acks(wait=False)
        self._next_step = step
        snapshot = self.x.clone()  # read-only from here on, shared by all sends
        for peer in self.neighbors:
            self._acks.append(self.comm.send(peer, snapshot, kind=KIND, step=step, reliable=True))

    def _check_acks(self, wait: bool) -> None:
        pending = []
        for future in self._acks:
            if not wait and not future.done():
                pending.append(future)
                continue
            ack = future.result()
            if ack.status == pb.Ack.STATUS_REJECTED:
                raise RuntimeError(f"node {self.rank}: D-PSGD model refused: {ack.reason}: {ack.detail}")
        self._acks = pending
