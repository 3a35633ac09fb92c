"""Graphs over the members of a step: the same schedules, on a cluster whose nodes come and go.

In an elastic run (transport/membership/views.py) the nodes training together at step k are a
sorted list of ranks, `members_at(k)`. Member i of that list plays rank i of the k-node graph of the run's
topology, so every node derives the same graph from the same view, and a node that is not a member
at a step has no edges then. With the initial view (all ranks, never changed) this is the run's
topology itself.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Callable

import numpy as np

from p2ptrain.topology.base import Topology
from p2ptrain.topology.undirected import UndirectedGraph

MembersAt = Callable[[int], tuple[int, ...]]


class MemberTopology(Topology):
    """The directed schedule `build(k)` over the k members of each step (SGP, gossip-DiLoCo)."""

    def __init__(self, world_size: int, build: Callable[[int], Topology], members_at: MembersAt):
        super().__init__(world_size)
        self._build = lru_cache(maxsize=None)(build)
        self.members_at = members_at
        self.name = self._build(world_size).name
        self._ranks = lru_cache(maxsize=8)(member_ranks)  # members tuple -> its ranks as an array

    def _graph(self, step: int) -> tuple[tuple[int, ...], Topology]:
        members = self.members_at(step)
        return members, self._build(len(members))

    def out_peers(self, rank: int, step: int) -> list[int]:
        members, graph = self._graph(step)
        if rank not in members:
            return []
        return sorted(members[j] for j in graph.out_peers(members.index(rank), step))

    def in_peers(self, rank: int, step: int) -> list[int]:
        members, graph = self._graph(step)
        if rank not in members:
            return []
        return sorted(members[j] for j in graph.in_peers(members.index(rank), step))

    def members(self, step: int) -> tuple[int, ...]:
        return tuple(self.members_at(step))

    def arcs(self, step: int) -> tuple[tuple[int, int], ...]:
        members, graph = self._graph(step)  # the k-node graph's arcs are cached by its own period
        return tuple((members[i], members[j]) for i, j in graph.arcs(step))

    def arc_arrays(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """The k-node graph's arrays (cached by its period) mapped to the members' ranks: no Python
        loop over the members, each step of a thousand-node run."""
        members, graph = self._graph(step)
        senders, receivers = graph.arc_arrays(step)
        ranks = self._ranks(members)
        mapped = ranks[senders], ranks[receivers]
        for column in mapped:
            column.setflags(write=False)
        return mapped

    def period(self) -> int | None:
        return None  # members change: no in-table is reused across steps

    def neighbourhood(self, rank: int, step: int = 0) -> frozenset[int] | None:
        """The members `rank` sends to or hears from over one cycle of the graph of `step`'s
        members (a later view may bring others: they are met when first sent to)."""
        members, graph = self._graph(step)
        if rank not in members:
            return frozenset()
        near = graph.neighbourhood(members.index(rank), step)
        return None if near is None else frozenset(members[j] for j in near)


def member_ranks(members: tuple[int, ...]) -> np.ndarray:
    return np.array(members, dtype=np.int64)


class MemberGraph:
    """The undirected graph `build(k)` over the k members of each step, with its Metropolis
    weights (D-PSGD): W stays symmetric and doubly stochastic over every view."""

    def __init__(self, build: Callable[[int], UndirectedGraph], members_at: MembersAt):
        self._build = lru_cache(maxsize=None)(build)
        self.members_at = members_at

    @classmethod
    def fixed(cls, graph: UndirectedGraph) -> "MemberGraph":
        """`graph` itself at every step (a run whose members never change)."""
        everyone = tuple(range(graph.world_size))
        return cls(lambda k: graph, lambda step: everyone)

    def neighbors(self, rank: int, step: int) -> list[int]:
        members = self.members_at(step)
        if rank not in members:
            return []
        graph = self._build(len(members))
        return sorted(members[j] for j in graph.neighbors(members.index(rank)))

    def metropolis_weights(self, rank: int, step: int) -> dict[int, float]:
        members = self.members_at(step)
        if rank not in members:
            return {}
        graph = self._build(len(members))
        return {members[j]: w for j, w in graph.metropolis_weights(members.index(rank)).items()}


__all__ = ["MemberTopology", "MemberGraph"]
