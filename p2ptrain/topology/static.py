"""Static directed graphs: ring and complete."""
from __future__ import annotations

from p2ptrain.topology.base import Topology


class Ring(Topology):
    """Directed ring: i sends to i+1 (mod n)."""

    name = "ring"

    def out_peers(self, rank: int, step: int) -> list[int]:
        self._check_rank(rank)
        return [] if self.world_size < 2 else [(rank + 1) % self.world_size]

    def period(self) -> int | None:
        return 1


class Complete(Topology):
    """Every node sends to every other node (uniform weights 1/n: plain averaging)."""

    name = "complete"

    def out_peers(self, rank: int, step: int) -> list[int]:
        self._check_rank(rank)
        return [j for j in range(self.world_size) if j != rank]

    def period(self) -> int | None:
        return 1
