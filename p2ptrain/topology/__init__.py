"""Communication graphs (who sends to whom at step k) and their mixing weights."""
from __future__ import annotations

from p2ptrain.topology.base import Topology
from p2ptrain.topology.exponential import ExponentialGraph, exponential_offsets
from p2ptrain.topology.random_graph import RandomGraph
from p2ptrain.topology.static import Complete, Ring
from p2ptrain.topology.trees import BinaryTree, Chain, DoubleBinaryTrees
from p2ptrain.topology.undirected import CompleteGraph, UndirectedGraph, UndirectedRing

TOPOLOGY_NAMES = ("exponential", "ring", "complete", "random", "chain", "binary-tree", "double-binary-trees")


def build_topology(name: str, world_size: int, *, peers_per_step: int = 1, seed: int = 0) -> Topology:
    """Topology by CLI name; `peers_per_step` is the (max) out-degree where it applies."""
    if name == "exponential":
        return ExponentialGraph(world_size, peers_per_step)
    if name == "ring":
        return Ring(world_size)
    if name == "complete":
        return Complete(world_size)
    if name == "random":
        return RandomGraph(world_size, max_out_degree=max(2, peers_per_step), seed=seed)
    if name in ("chain", "binary-tree"):
        return build_undirected(name, world_size)
    if name == "double-binary-trees":
        raise ValueError("double-binary-trees is a pair of trees for RelaySGD, not a single graph")
    raise ValueError(f"unknown topology {name!r}; choose from {', '.join(TOPOLOGY_NAMES)}")


def build_undirected(name: str, world_size: int) -> UndirectedGraph:
    """Undirected graph by CLI name, for gossip with symmetric weights (D-PSGD); `ring` here is
    the two-way ring."""
    graphs = {"ring": UndirectedRing, "complete": CompleteGraph, "chain": Chain, "binary-tree": BinaryTree}
    if name not in graphs:
        raise ValueError(f"{name!r} is not an undirected topology; choose from {', '.join(graphs)}")
    return graphs[name](world_size)


__all__ = ["Topology", "ExponentialGraph", "RandomGraph", "Ring", "Complete", "build_topology",
           "build_undirected", "exponential_offsets", "TOPOLOGY_NAMES", "UndirectedGraph", "UndirectedRing",
           "CompleteGraph", "Chain", "BinaryTree", "DoubleBinaryTrees"]
