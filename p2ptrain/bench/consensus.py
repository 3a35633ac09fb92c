"""Push-sum's exact theory for the simulation (bench/simulate.py): the same recursion as SGP with
τ = 0 and no gradient, x <- P_k x and w <- P_k w over the topology's step-k out-peers, in float64.
A simulated run that loses nothing must match it to rounding, so the measured consensus distance
is checked against what the graph itself promises (on the exponential graph with n a power of two:
exact consensus after log2 n steps)."""
from __future__ import annotations

import math

import torch

from p2ptrain.topology import Topology


def initial_vector(rank: int, dim: int) -> torch.Tensor:
    """Node `rank`'s starting vector: the same in the node and in the theory."""
    return torch.randn(dim, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))


def push_sum_trace(topology: Topology, start: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """z = x / w of every node (rows) after each of `steps` synchronous push-sum steps from x = `start`,
    w = 1: node i keeps p = 1 / (out-degree + 1) of (x, w) and sends p to each out-peer."""
    n = start.shape[0]
    x, w = start.clone(), torch.ones(n, dtype=torch.float64)
    trace = []
    for step in range(steps):
        new_x, new_w = torch.zeros_like(x), torch.zeros_like(w)
        for i in range(n):
            out = topology.out_peers(i, step)
            p = 1.0 / (len(out) + 1)
            for j in [i, *out]:
                new_x[j] += p * x[i]
                new_w[j] += p * w[i]
        x, w = new_x, new_w
        trace.append(x / w[:, None])
    return trace


def consensus_distance(z: torch.Tensor, average: torch.Tensor) -> float:
    """sqrt(mean_i ||z_i - average||^2): how far the nodes are from the exact average."""
    return math.sqrt(float(((z - average) ** 2).sum(dim=1).mean()))


__all__ = ["consensus_distance", "initial_vector", "push_sum_trace"]
