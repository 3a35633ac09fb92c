"""Time-varying directed exponential graph of SGP (seed 000, "cyclic strategy"), with k peers per
step as in FAIR's reference code (NPeerDynamicDirectedExponentialGraph, gossip/graph_manager.py of
facebookresearch/stochastic_gradient_push).

Every node has the same phone book of offsets: j (k+1)^i mod n for i = 0..floor(log_{k+1}(n-1))
and j = 1..k, in that order (i outer), each kept only the first time it comes up. At step t node r
sends to r + the k entries starting at entry t k (mod the book's length), so the book is walked k
entries a step, wrapping around. With k = 1 the book is 2^0, 2^1, ..., 2^floor(log2(n-1)), one
offset per step: the seed's graph.

Every edge between nodes is FAIR's; a slot holding the node itself sends nothing (FAIR loses that
share), and the book's length is computed exactly (ExponentialGraph says where FAIR's is not).
"""
from __future__ import annotations

import math

from p2ptrain.topology.base import Topology


def exponential_offsets(world_size: int, peers_per_step: int = 1) -> list[int]:
    """The phone book: j (k+1)^i mod n for i = 0..floor(log_{k+1}(n-1)), j = 1..k, first
    occurrences in order; 0 is the node's own slot (it sends nothing there). k = 1 gives the seed's
    [2^0, 2^1, ..., 2^floor(log2(n-1))]."""
    if world_size < 2:
        return []
    offsets: list[int] = []
    hop = 1  # (k+1)^i, kept in integers so the last power <= n-1 is never lost to rounding
    while hop <= world_size - 1:
        for j in range(1, peers_per_step + 1):
            offset = j * hop % world_size
            if offset not in offsets:
                offsets.append(offset)
        hop *= peers_per_step + 1
    return offsets


def max_peers_per_step(world_size: int) -> int:
    """The largest k the graph takes: every other node (k = n-1 sends to all of them each step)."""
    return max(1, world_size - 1)


class ExponentialGraph(Topology):
    """The exponential graph with `peers_per_step` = k out-peers per step.

    Where FAIR and this graph differ:
    - n dividing j (k+1)^i puts offset 0, the node itself, in FAIR's book (e.g. n = 6, k = 2: 1, 2,
      3, 0). FAIR then "sends" to itself over a one-member group and the share is lost; here that
      slot sends nothing, the node keeps the share (push weight 1/(out-degree + 1) with one peer
      fewer that step), and every other slot, hence every edge between nodes, is FAIR's.
    - FAIR takes floor(log_{k+1}(n-1)) in floating point, which comes out one short when n-1 is a
      power of k+1 that the division rounds down (n = 244 with k = 2, n = 1001 with k = 9); here it
      is exact. Up to n = 243 the two agree."""

    name = "exponential"

    def __init__(self, world_size: int, peers_per_step: int = 1):
        super().__init__(world_size)
        if peers_per_step < 1:
            raise ValueError(f"peers_per_step must be >= 1, got {peers_per_step}")
        if world_size > 1 and peers_per_step > world_size - 1:
            raise ValueError(f"peers_per_step={peers_per_step} exceeds the {world_size - 1} other nodes of a "
                             f"{world_size}-node exponential graph")
        self.peers_per_step = peers_per_step
        self.offsets = exponential_offsets(world_size, peers_per_step)  # >= k entries: i = 0 gives 1..k

    def out_peers(self, rank: int, step: int) -> list[int]:
        self._check_rank(rank)
        if not self.offsets:
            return []
        count = len(self.offsets)
        first = (step * self.peers_per_step) % count
        chosen = {self.offsets[(first + j) % count] for j in range(self.peers_per_step)}
        chosen.discard(0)  # the node's own slot
        return sorted((rank + offset) % self.world_size for offset in chosen)

    def period(self) -> int | None:
        """Steps until the walk through the book starts at entry 0 again: len / gcd(len, k)."""
        if not self.offsets:
            return 1
        return len(self.offsets) // math.gcd(len(self.offsets), self.peers_per_step)
