"""Time-varying directed exponential graph of SGP (seed 000, "cyclic strategy").

Node i sends to i + 2^0, i + 2^1, ..., i + 2^floor(log2(n-1)) (mod n), one offset per step,
cycling with the step; with k peers per step it takes the next k offsets of the cycle.
"""
from __future__ import annotations

from p2ptrain.topology.base import Topology


def exponential_offsets(world_size: int) -> list[int]:
    """[2^0, 2^1, ..., 2^floor(log2(n-1))] — the offsets of the exponential graph."""
    if world_size < 2:
        return []
    offsets, hop = [], 1
    while hop <= world_size - 1:
        offsets.append(hop)
        hop *= 2
    return offsets


class ExponentialGraph(Topology):
    name = "exponential"

    def __init__(self, world_size: int, peers_per_step: int = 1):
        super().__init__(world_size)
        self.offsets = exponential_offsets(world_size)
        if peers_per_step < 1:
            raise ValueError(f"peers_per_step must be >= 1, got {peers_per_step}")
        if self.offsets and peers_per_step > len(self.offsets):
            raise ValueError(f"peers_per_step={peers_per_step} exceeds the {len(self.offsets)} "
                             f"distinct exponential offsets of a {world_size}-node graph")
        self.peers_per_step = peers_per_step

    def out_peers(self, rank: int, step: int) -> list[int]:
        self._check_rank(rank)
        if not self.offsets:
            return []
        count = len(self.offsets)
        first = (step * self.peers_per_step) % count
        chosen = {self.offsets[(first + j) % count] for j in range(self.peers_per_step)}
        return sorted((rank + off) % self.world_size for off in chosen)

    def period(self) -> int | None:
        return max(1, len(self.offsets))
