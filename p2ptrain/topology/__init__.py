"""Communication graphs (who sends to whom at step k) and their mixing weights."""
from __future__ import annotations

from p2ptrain.topology.base import Topology
from p2ptrain.topology.exponential import ExponentialGraph, exponential_offsets
from p2ptrain.topology.random_graph import RandomGraph
from p2ptrain.topology.static import Complete, Ring

TOPOLOGY_NAMES = ("exponential", "ring", "complete", "random")


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
    raise ValueError(f"unknown topology {name!r}; choose from {', '.join(TOPOLOGY_NAMES)}")


__all__ = ["Topology", "ExponentialGraph", "RandomGraph", "Ring", "Complete", "build_topology",
           "exponential_offsets", "TOPOLOGY_NAMES"]
