"""One file per algorithm of the seeds, each in the seed's own notation; `build_algorithm` wires one
to a node's communicator by its CLI name."""
from __future__ import annotations

from p2ptrain.algorithms.allreduce import AllReduceSGD
from p2ptrain.algorithms.base import Algorithm
from p2ptrain.algorithms.dpsgd import DPSGD
from p2ptrain.algorithms.pipesgd import PipeSGD
from p2ptrain.algorithms.sgp import SGP

# Topologies each algorithm can run on; the first is its default. All-reduce based algorithms
# always use the ring of the all-reduce.
ALGORITHM_TOPOLOGIES: dict[str, tuple[str, ...]] = {
    "sgp": ("exponential", "ring", "complete", "random", "chain", "binary-tree"),
    "allreduce": ("ring",),
    "dpsgd": ("ring", "complete", "chain", "binary-tree"),
    "relaysgd": ("double-binary-trees", "binary-tree", "chain"),
    "pipesgd": ("ring",),
}
ALGORITHM_NAMES = tuple(ALGORITHM_TOPOLOGIES)


def default_topology(algorithm: str) -> str:
    return ALGORITHM_TOPOLOGIES[algorithm][0]


def build_algorithm(name: str, comm, *, topology: str | None = None, overlap: int = 0,
                    peers_per_step: int = 1, seed: int = 0, average: str = "models",
                    compression: str = "none", warmup: int = 0) -> Algorithm:
    """The algorithm `name` bound to `comm`; options that do not apply to it are ignored."""
    from p2ptrain.topology import build_topology, build_undirected

    if name not in ALGORITHM_TOPOLOGIES:
        raise ValueError(f"unknown algorithm {name!r}; choose from {', '.join(ALGORITHM_NAMES)}")
    topology = topology or default_topology(name)
    if topology not in ALGORITHM_TOPOLOGIES[name]:
        raise ValueError(f"{name} cannot run on topology {topology!r}; "
                         f"choose from {', '.join(ALGORITHM_TOPOLOGIES[name])}")
    n = comm.world_size
    if name == "sgp":
        return SGP(comm, build_topology(topology, n, peers_per_step=peers_per_step, seed=seed), overlap=overlap)
    if name == "dpsgd":
        return DPSGD(comm, build_undirected(topology, n))
    if name == "relaysgd":
        from p2ptrain.algorithms.relaysgd import RelaySGD

        return RelaySGD(comm, topology)
    if name == "allreduce":
        return AllReduceSGD(comm, average=average, codec=compression)
    return PipeSGD(comm, warmup=warmup, codec=compression)


__all__ = ["Algorithm", "SGP", "AllReduceSGD", "DPSGD", "PipeSGD", "ALGORITHM_NAMES", "ALGORITHM_TOPOLOGIES",
           "build_algorithm", "default_topology"]
