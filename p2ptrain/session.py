"""The node p2ptrain.init() made in this process: set by init(), found by DecentralizedOptimizer.

A leaf module (it imports nothing of p2ptrain), so that the optimizer below the API can find the
node without importing the API above it."""
from __future__ import annotations

_current = None


def set_current(node) -> None:
    global _current
    _current = node


def current_node(required: bool = True):
    """The node p2ptrain.init() made in this process (None, or with `required` a RuntimeError,
    before init() or after its close())."""
    if _current is None or _current.closed:
        if not required:
            return None
        raise RuntimeError("no p2ptrain node: call p2ptrain.init() first (or pass node=... / algorithm=...)")
    return _current


__all__ = ["current_node", "set_current"]
