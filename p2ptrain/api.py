"""`p2ptrain.init()`: the node of a training script of your own, from what `p2ptrain launch`,
torchrun or your environment set (RANK, WORLD_SIZE, P2PTRAIN_<SETTING>), overridable with keyword
arguments. DecentralizedOptimizer finds the node init() made, so a loop adopts p2ptrain in three
lines (see README, "Use your own model")."""
from __future__ import annotations

from typing import Any

from p2ptrain.config import NodeConfig

_current = None  # the Node init() made in this process


def init(config_file: str | None = None, **settings: Any):
    """Build and start this process's node: settings from `config_file` (TOML) < the environment
    < `settings` (any NodeConfig setting or algorithm option, e.g. algorithm="sgp", overlap=1).
    Returns the started Node (also a context manager; close() it at the end)."""
    from p2ptrain.node import Node

    global _current
    if _current is not None and not _current._closed:
        raise RuntimeError("p2ptrain.init() was already called in this process; close() that node first")
    config = NodeConfig.from_sources(toml_path=config_file, flags=settings)
    if config.uses_rendezvous:  # no peer list: the store hands out a rank when no source gave one
        from p2ptrain.transport.rendezvous import assign_rank

        config = assign_rank(config)
    import torch

    torch.set_num_threads(config.threads)
    node = Node(config)
    try:
        node.start()
    except BaseException as exc:
        node.fail(exc)
        raise
    _current = node
    return node


def current_node():
    """The node p2ptrain.init() made in this process (RuntimeError before init())."""
    if _current is None or _current._closed:
        raise RuntimeError("no p2ptrain node: call p2ptrain.init() first (or pass node=... / algorithm=...)")
    return _current


__all__ = ["current_node", "init"]
