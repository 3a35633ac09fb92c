"""`p2ptrain.init()`: the node of a training script of your own, from what `p2ptrain launch`,
torchrun or your environment set (RANK, WORLD_SIZE, P2PTRAIN_<SETTING>), overridable with keyword
arguments. DecentralizedOptimizer finds the node init() made, so a loop adopts p2ptrain in three
lines (see README, "Use your own model")."""
from __future__ import annotations

import logging
import os
import sys
from typing import Any

from p2ptrain import session
from p2ptrain.exit_codes import EXIT_NO_CLUSTER
from p2ptrain.settings import NodeConfig


def init(config_file: str | None = None, **settings: Any):
    """Build and start this process's node: settings from `config_file` (TOML) < the environment
    < `settings` (any NodeConfig setting or algorithm option, e.g. algorithm="sgp", overlap=1).
    Returns the started Node (also a context manager; close() it at the end).

    A process restarted by the launcher to rejoin (P2PTRAIN_REJOIN=1) whose cluster has already
    finished exits here with EXIT_NO_CLUSTER and one line: there is nothing left to train."""
    from p2ptrain.node import NoClusterToRejoin, Node

    if session.current_node(required=False) is not None:
        raise RuntimeError("p2ptrain.init() was already called in this process; close() that node first")
    _log_to_stderr()
    config = NodeConfig.from_sources(toml_path=config_file, flags=settings)
    if config.uses_rendezvous:  # no peer list: the store hands out a rank when no source gave one
        from p2ptrain.transport.rendezvous import assign_rank

        config = assign_rank(config)
    import torch

    torch.set_num_threads(config.threads)
    node = Node(config)
    try:
        node.start()
    except NoClusterToRejoin as exc:
        node.fail(exc)
        print(f"p2ptrain: {exc}", file=sys.stderr)
        raise SystemExit(EXIT_NO_CLUSTER) from None
    except BaseException as exc:
        node.fail(exc)
        raise
    session.set_current(node)
    return node


def _log_to_stderr() -> None:
    """p2ptrain's log lines (peers lost, rejoins, dropped shares) on stderr, as `p2ptrain node`
    prints them, unless the script configured logging itself. P2PTRAIN_LOG_LEVEL (default INFO)."""
    logger = logging.getLogger("p2ptrain")
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    level = os.environ.get("P2PTRAIN_LOG_LEVEL", "INFO").upper()
    logger.setLevel(level if level in logging.getLevelNamesMapping() else logging.INFO)


__all__ = ["init"]
