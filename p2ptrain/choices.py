"""The names a choice-valued setting takes, as Literal types, importable without torch or gRPC.

Each Literal is the one list of its names: the settings' field types, the command-line choices
and the tables that implement the names (train/models.py, train/data.py, train/setup.py,
transport/options.py) read it here, and tests hold each table to its list. Other lists live with
what they name and are just as light: algorithms in p2ptrain/algorithms/registry.py, topologies
in p2ptrain/topology, codecs in p2ptrain/compression.
"""
from __future__ import annotations

from typing import Literal, get_args

Role = Literal["peer", "ps", "worker"]  # peer: decentralized node; ps / worker: a parameter server and its workers
Device = Literal["auto", "cpu", "cuda"]  # auto: cuda when available
DataPlane = Literal["auto", "grpc", "tcp"]  # how tensor payloads travel (transport/dataplane.py)
Reachability = Literal["auto", "public", "private"]  # can peers dial this node (transport/reachability.py)
Meet = Literal["everyone", "neighbours"]  # whom a node greets and waits for at start (transport/options.py)
ModelName = Literal["mlp", "cnn"]
DatasetName = Literal["synthetic", "mnist", "idx"]  # mnist and idx: MNIST-style IDX files in a folder
OptimizerName = Literal["sgd", "adamw", "muon"]  # the local (inner) optimizer `p2ptrain node` builds

ROLE_NAMES: tuple[str, ...] = get_args(Role)
DEVICE_NAMES: tuple[str, ...] = get_args(Device)
DATA_PLANE_NAMES: tuple[str, ...] = get_args(DataPlane)
REACHABILITY_NAMES: tuple[str, ...] = get_args(Reachability)
MEET_NAMES: tuple[str, ...] = get_args(Meet)
MODEL_NAMES: tuple[str, ...] = get_args(ModelName)
DATASET_NAMES: tuple[str, ...] = get_args(DatasetName)
OPTIMIZER_NAMES: tuple[str, ...] = get_args(OptimizerName)
IDX_DATASETS: tuple[str, ...] = ("mnist", "idx")  # the data sets read from --data-dir

__all__ = ["DATASET_NAMES", "DATA_PLANE_NAMES", "DEVICE_NAMES", "IDX_DATASETS", "MEET_NAMES", "MODEL_NAMES",
           "OPTIMIZER_NAMES", "REACHABILITY_NAMES", "ROLE_NAMES", "DataPlane", "DatasetName", "Device", "Meet",
           "ModelName", "OptimizerName", "Reachability", "Role"]
