"""One file per algorithm, each in its source's notation, each registering itself with
p2ptrain.algorithms.registry (its name, graphs, options and class). Importing this package imports
no torch."""
from __future__ import annotations

from p2ptrain.algorithms.allreduce import AllReduceSGD
from p2ptrain.algorithms.base import Algorithm, Comm, Delivery, Kind
from p2ptrain.algorithms.diloco import DiLoCo
from p2ptrain.algorithms.dpsgd import DPSGD
from p2ptrain.algorithms.gossip_diloco import GossipDiLoCo
from p2ptrain.algorithms.pipesgd import PipeSGD
from p2ptrain.algorithms.registry import AlgorithmSpec, algorithms, build, get, names
from p2ptrain.algorithms.relaysgd import RelaySGD
from p2ptrain.algorithms.sgp import SGP

__all__ = ["Algorithm", "AlgorithmSpec", "AllReduceSGD", "Comm", "DPSGD", "DiLoCo", "Delivery", "GossipDiLoCo", "Kind",
           "PipeSGD", "RelaySGD", "SGP", "algorithms", "build", "get", "names"]
