"""Spanning trees for RelaySGD (seed 003 §3.2): chain, binary tree and double binary trees.

RelaySum needs a tree: a message relayed along a cycle would be counted twice. The delay τ_ij of
node j's model at node i is the hop distance between them, so the tree's diameter is the longest
delay (chain: n-1; complete binary tree: O(log n)).

Double binary trees [Sanders et al.] are not one graph but two trees A and B, each carrying part
of the model. B is A with every node i playing the role of n-1-i, so no node is interior (has
children) in both trees: the per-node relay work and bandwidth are balanced.
"""
from __future__ import annotations

from collections import deque

from p2ptrain.topology.undirected import UndirectedGraph

TREE_NAMES = ("chain", "binary-tree", "double-binary-trees")


class Tree(UndirectedGraph):
    """An undirected tree over ranks 0..n-1 (n-1 edges, connected)."""

    name = "tree"

    def distances(self, rank: int) -> list[int]:
        """Hop counts τ_{rank,j} for every j (BFS)."""
        self._check_rank(rank)
        dist = [-1] * self.world_size
        dist[rank] = 0
        queue = deque([rank])
        while queue:
            i = queue.popleft()
            for j in self.neighbors(i):
                if dist[j] < 0:
                    dist[j] = dist[i] + 1
                    queue.append(j)
        return dist

    def eccentricity(self, rank: int) -> int:
        """Steps until `rank` has heard from every node (max_j τ_{rank,j})."""
        return max(self.distances(rank))

    def diameter(self) -> int:
        """Longest shortest path: the largest relay delay in the tree."""
        return max(self.eccentricity(i) for i in range(self.world_size))


class Chain(Tree):
    """i — i±1: the seed's illustration of RelaySum; delay grows as n-1."""

    name = "chain"

    def neighbors(self, rank: int) -> list[int]:
        self._check_rank(rank)
        return [j for j in (rank - 1, rank + 1) if 0 <= j < self.world_size]


class BinaryTree(Tree):
    """Complete binary tree rooted at 0: parent (i-1)//2, children 2i+1, 2i+2 (when < n)."""

    name = "binary-tree"
    root = 0

    def parent(self, rank: int) -> int | None:
        self._check_rank(rank)
        return None if rank == 0 else (rank - 1) // 2

    def children(self, rank: int) -> list[int]:
        self._check_rank(rank)
        return [c for c in (2 * rank + 1, 2 * rank + 2) if c < self.world_size]

    def neighbors(self, rank: int) -> list[int]:
        parent = self.parent(rank)
        return sorted(([] if parent is None else [parent]) + self.children(rank))


class MirroredBinaryTree(BinaryTree):
    """The complementary tree: node i plays the role of n-1-i in BinaryTree, so the root is n-1."""

    name = "mirrored-binary-tree"

    def __init__(self, world_size: int):
        super().__init__(world_size)
        self.root = world_size - 1

    def _mirror(self, rank: int) -> int:
        return self.world_size - 1 - rank

    def parent(self, rank: int) -> int | None:
        parent = super().parent(self._mirror(rank))
        return None if parent is None else self._mirror(parent)

    def children(self, rank: int) -> list[int]:
        return sorted(self._mirror(c) for c in super().children(self._mirror(rank)))


class DoubleBinaryTrees:
    """Two complementary binary trees, each relaying half of the coordinates.

    The seed sends odd coordinates over tree A and even ones over tree B. Here tree A carries the
    first contiguous half of the flat parameter vector and tree B the second: the same scheme up to
    a fixed permutation of coordinates (which averaging does not care about), without strided
    copies.
    """

    name = "double-binary-trees"

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.trees: tuple[BinaryTree, MirroredBinaryTree] = (BinaryTree(world_size),
                                                              MirroredBinaryTree(world_size))

    def slices(self, numel: int) -> list[slice]:
        return coordinate_slices(numel, len(self.trees))

    def __repr__(self) -> str:
        return f"DoubleBinaryTrees(world_size={self.world_size})"


def coordinate_slices(numel: int, parts: int) -> list[slice]:
    """Split 0..numel-1 into `parts` contiguous ranges of near-equal size (the first ones larger)."""
    if parts < 1:
        raise ValueError(f"need at least one part, got {parts}")
    base, extra = divmod(numel, parts)
    bounds = [0]
    for k in range(parts):
        bounds.append(bounds[-1] + base + (1 if k < extra else 0))
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


def build_relay_trees(name: str, world_size: int) -> list[Tree]:
    """The trees RelaySGD runs on, by CLI name; tree k relays coordinate_slices(numel, len)[k]."""
    if name == "chain":
        return [Chain(world_size)]
    if name == "binary-tree":
        return [BinaryTree(world_size)]
    if name == "double-binary-trees":
        return list(DoubleBinaryTrees(world_size).trees)
    raise ValueError(f"unknown relay tree {name!r}; choose from {', '.join(TREE_NAMES)}")


__all__ = ["Tree", "Chain", "BinaryTree", "MirroredBinaryTree", "DoubleBinaryTrees", "TREE_NAMES",
           "build_relay_trees", "coordinate_slices"]
