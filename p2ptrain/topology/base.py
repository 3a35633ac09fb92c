"""Topology schedules: who sends to whom at step k, and the mixing weights.

A topology is a pure function of (rank, step): every node computes the same graph without talking
to anyone, which is what lets in_peers() be derived from out_peers() of all ranks.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from functools import lru_cache

import numpy as np


class Topology(ABC):
    """A time-varying directed graph over ranks 0..world_size-1 (no self loops)."""

    name: str = "topology"

    def __init__(self, world_size: int):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        # Per-instance caches of the in-neighbour table and the arcs; steps repeat for periodic schedules.
        self._in_table = lru_cache(maxsize=256)(self._compute_in_table)
        self._arcs = lru_cache(maxsize=256)(self._compute_arcs)
        self._arc_arrays = lru_cache(maxsize=256)(self._compute_arc_arrays)

    @abstractmethod
    def out_peers(self, rank: int, step: int) -> list[int]:
        """Ranks `rank` sends to at `step` (sorted, distinct, never `rank` itself)."""

    def in_peers(self, rank: int, step: int) -> list[int]:
        """Ranks that send to `rank` at `step` (sorted)."""
        self._check_rank(rank)
        return list(self._in_table(self._cache_key(step))[rank])

    def members(self, step: int) -> tuple[int, ...]:
        """The ranks that take part at `step` (all of them; an elastic schedule says fewer)."""
        return tuple(range(self.world_size))

    def arcs(self, step: int) -> tuple[tuple[int, int], ...]:
        """Every (sender, receiver) pair of `step`, senders in rank order: the whole graph at once, for
        what simulates every node (push-sum's fault-free weights) rather than asks for one."""
        return self._arcs(self._cache_key(step))

    def arc_arrays(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """arcs(step) as two read-only int64 arrays, (senders, receivers): cached like the arcs, so
        what simulates every node each step pays no Python loop over the graph."""
        return self._arc_arrays(self._cache_key(step))

    def mixing_weight(self, rank: int, step: int) -> float:
        """Uniform push weight: `rank` keeps and sends p = 1 / (out-degree + 1) of its mass."""
        return 1.0 / (len(self.out_peers(rank, step)) + 1)

    def mixing_matrix(self, step: int) -> list[list[float]]:
        """Column-stochastic P(step) with P[j][i] = weight node i gives to node j (for tests/analysis)."""
        n = self.world_size
        matrix = [[0.0] * n for _ in range(n)]
        for i in range(n):
            p = self.mixing_weight(i, step)
            matrix[i][i] = p
            for j in self.out_peers(i, step):
                matrix[j][i] = p
        return matrix

    def period(self) -> int | None:
        """Length of the schedule's cycle, or None when it never repeats (random graphs)."""
        return None

    def neighbourhood(self, rank: int, step: int = 0) -> frozenset[int] | None:
        """Every rank that `rank` sends to or hears from over one cycle from `step`: the only peers
        it must meet (TransportOptions.meet); None when the schedule never repeats."""
        period = self.period()
        if period is None:
            return None
        return frozenset(peer for k in range(step, step + period)
                         for peer in self.out_peers(rank, k) + self.in_peers(rank, k))

    def _cache_key(self, step: int) -> int:
        period = self.period()
        return step % period if period else step

    def _compute_in_table(self, step: int) -> tuple[tuple[int, ...], ...]:
        incoming: list[list[int]] = [[] for _ in range(self.world_size)]
        for sender in range(self.world_size):
            for receiver in self.out_peers(sender, step):
                incoming[receiver].append(sender)
        return tuple(tuple(sorted(peers)) for peers in incoming)

    def _compute_arcs(self, step: int) -> tuple[tuple[int, int], ...]:
        return tuple((sender, receiver) for sender in range(self.world_size)
                     for receiver in self.out_peers(sender, step))

    def _compute_arc_arrays(self, key: int) -> tuple[np.ndarray, np.ndarray]:
        return read_only_columns(self._arcs(key))

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside 0..{self.world_size - 1}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(world_size={self.world_size})"


def read_only_columns(arcs) -> tuple[np.ndarray, np.ndarray]:
    """(senders, receivers) of `arcs` as read-only int64 arrays (shared by every caller of a cache)."""
    columns = np.array(arcs, dtype=np.int64).reshape(-1, 2).T.copy()
    columns.setflags(write=False)
    return columns[0], columns[1]
