"""The ways a message reaches a peer. A direct path (the TCP lane, gRPC streaming) pushes straight
to the peer; the router (router.py) tries the node's direct paths in order and relays through
another node when the peer proves unreachable. Each path raises the transport's own SendFailure,
never a library's error, and PathUnavailable when it cannot carry a message at all (nothing was
sent: the next path may). A new path is one class with `name` and `push`, and one line in the list
the Transport gives its router."""
from __future__ import annotations

from typing import Protocol

from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.transport.errors import FailureKind, SendFailure


class PathUnavailable(SendFailure):
    """This path cannot carry the message to that peer (nothing of it was sent)."""

    def __init__(self, detail: str):
        super().__init__(FailureKind.UNREACHABLE, detail)


class DirectPath(Protocol):
    name: str

    async def push(self, peer: int, header: pb.TensorHeader, payload: memoryview, timeout: float,
                   wait_for_ready: bool = True) -> pb.Ack:
        """Deliver header + payload straight to `peer`; its Ack. PathUnavailable: nothing was sent."""


__all__ = ["DirectPath", "PathUnavailable"]
