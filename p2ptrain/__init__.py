"""p2ptrain: an asyncio gRPC peer-to-peer runtime for decentralized deep-learning training.

Importing the package is cheap (no torch, no gRPC): the public names load on first use.

    import p2ptrain
    node = p2ptrain.init()                      # settings from `p2ptrain launch`, torchrun or the environment
    opt = p2ptrain.DecentralizedOptimizer(torch.optim.AdamW(model.parameters()), model=model, node=node)
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_PUBLIC = {"NodeConfig": "p2ptrain.settings", "ConfigError": "p2ptrain.settings", "init": "p2ptrain.api",
           "DecentralizedOptimizer": "p2ptrain.train.optimizer", "DecentralizedTrainer": "p2ptrain.train.trainer",
           "NonFiniteError": "p2ptrain.train.errors", "LeftCluster": "p2ptrain.train.errors",
           "evaluate": "p2ptrain.train.evaluate"}


def __getattr__(name: str) -> Any:  # PEP 562
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'p2ptrain' has no attribute {name!r}")


__all__ = ["ConfigError", "DecentralizedOptimizer", "DecentralizedTrainer", "LeftCluster", "NodeConfig",
           "NonFiniteError", "evaluate", "init", "__version__"]
