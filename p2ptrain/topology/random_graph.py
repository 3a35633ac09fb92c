"""Seeded random directed graph with per-node, per-step out-degrees.

Each node draws its own number of out-peers every step, so in-degrees differ and push-sum
weights drift away from 1 — the regime where de-biasing z = x / w actually matters.
Every node derives the same graph from (seed, step, rank), so no coordination is needed.
"""
from __future__ import annotations

import numpy as np

from p2ptrain.topology.base import Topology


class RandomGraph(Topology):
    name = "random"

    def __init__(self, world_size: int, max_out_degree: int = 2, seed: int = 0):
        super().__init__(world_size)
        if max_out_degree < 1:
            raise ValueError(f"max_out_degree must be >= 1, got {max_out_degree}")
        self.max_out_degree = min(max_out_degree, max(world_size - 1, 1))
        self.seed = seed

    def out_peers(self, rank: int, step: int) -> list[int]:
        self._check_rank(rank)
        if self.world_size < 2:
            return []
        rng = np.random.default_rng([self.seed, step, rank])
        degree = int(rng.integers(1, self.max_out_degree + 1))
        others = [j for j in range(self.world_size) if j != rank]
        return sorted(int(j) for j in rng.choice(others, size=degree, replace=False))
