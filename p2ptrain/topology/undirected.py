"""Undirected (symmetric, static) graphs for D-PSGD gossip and RelaySGD trees.

An undirected graph is a Topology whose out- and in-neighbours are the same set at every step, so
it plugs into everything that takes a Topology. D-PSGD (seed 003 Alg. 1) needs a symmetric doubly
stochastic W; Metropolis weights W_ij = 1 / (1 + max(d_i, d_j)) give one on any undirected graph.
"""
from __future__ import annotations

from abc import abstractmethod

from p2ptrain.topology.base import Topology


class UndirectedGraph(Topology):
    """A static undirected graph over ranks 0..n-1 (no self loops)."""

    name = "undirected"

    @abstractmethod
    def neighbors(self, rank: int) -> list[int]:
        """Sorted neighbours of `rank`; j in neighbors(i) iff i in neighbors(j)."""

    def out_peers(self, rank: int, step: int) -> list[int]:
        self._check_rank(rank)
        return self.neighbors(rank)

    def in_peers(self, rank: int, step: int) -> list[int]:
        self._check_rank(rank)
        return self.neighbors(rank)

    def period(self) -> int | None:
        return 1

    def degree(self, rank: int) -> int:
        return len(self.neighbors(rank))

    def metropolis_weights(self, rank: int) -> dict[int, float]:
        """Row `rank` of the Metropolis-Hastings matrix W: {j: W_ij} including j = rank."""
        d_i = self.degree(rank)
        row = {j: 1.0 / (1 + max(d_i, self.degree(j))) for j in self.neighbors(rank)}
        row[rank] = 1.0 - sum(row.values())
        return row

    def metropolis_matrix(self) -> list[list[float]]:
        """The full symmetric doubly stochastic W (for tests and analysis)."""
        n = self.world_size
        matrix = [[0.0] * n for _ in range(n)]
        for i in range(n):
            for j, w in self.metropolis_weights(i).items():
                matrix[i][j] = w
        return matrix

    def edges(self) -> list[tuple[int, int]]:
        return [(i, j) for i in range(self.world_size) for j in self.neighbors(i) if i < j]


class UndirectedRing(UndirectedGraph):
    """i talks to i-1 and i+1 (mod n): the D-PSGD default."""

    name = "ring"

    def neighbors(self, rank: int) -> list[int]:
        self._check_rank(rank)
        n = self.world_size
        return sorted({(rank - 1) % n, (rank + 1) % n} - {rank})


class CompleteGraph(UndirectedGraph):
    """Everyone talks to everyone (Metropolis weights 1/n: exact averaging every step)."""

    name = "complete"

    def neighbors(self, rank: int) -> list[int]:
        self._check_rank(rank)
        return [j for j in range(self.world_size) if j != rank]
