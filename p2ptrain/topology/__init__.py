"""Communication graphs (who sends to whom at step k) and their mixing weights."""
from __future__ import annotations

from p2ptrain.topology.base import Topology
from p2ptrain.topology.exponential import ExponentialGraph, exponential_offsets, max_peers_per_step
from p2ptrain.topology.members import MemberGraph, MemberTopology
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


def member_topology(name: str, world_size: int, members_at, *, peers_per_step: int = 1, seed: int = 0) -> Topology:
    """The topology `name` over each step's members (topology/members.py); with fewer members than
    out-peers per step, as many as the smaller graph has."""
    def build(k: int) -> Topology:
        per_step = min(peers_per_step, max_peers_per_step(k)) if name == "exponential" else peers_per_step
        return build_topology(name, k, peers_per_step=per_step, seed=seed)

    return MemberTopology(world_size, build, members_at)


def member_graph(name: str, members_at) -> MemberGraph:
    """The undirected graph `name` (build_undirected) over each step's members."""
    return MemberGraph(lambda k: build_undirected(name, k), members_at)


def build_undirected(name: str, world_size: int) -> UndirectedGraph:
    """Undirected graph by CLI name, for gossip with symmetric weights (D-PSGD); `ring` here is
    the two-way ring."""
    graphs = {"ring": UndirectedRing, "complete": CompleteGraph, "chain": Chain, "binary-tree": BinaryTree}
    if name not in graphs:
        raise ValueError(f"{name!r} is not an undirected topology; choose from {', '.join(graphs)}")
    return graphs[name](world_size)


__all__ = ["Topology", "ExponentialGraph", "RandomGraph", "Ring", "Complete", "build_topology",
           "build_undirected", "exponential_offsets", "max_peers_per_step", "TOPOLOGY_NAMES", "UndirectedGraph",
           "UndirectedRing", "CompleteGraph", "Chain", "BinaryTree", "DoubleBinaryTrees", "MemberGraph",
           "MemberTopology", "member_graph", "member_topology"]
