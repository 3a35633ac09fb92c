"""The errors a node's transport raises to its users, and how a failed call is put into words.

Only exception types and description helpers live here: nothing that sends, retries or decides.
"""
from __future__ import annotations

import grpc


class PeerError(RuntimeError):
    """A peer is unreachable or incompatible."""


class PeerUnreachable(PeerError):
    """The peer is considered dead (refused connections and did not answer a probe): the message
    was not delivered, so its sender still owns it (SGP re-absorbs a push-sum share)."""


def rpc_reason(exc: BaseException | None) -> str:
    """"CODE: details" of a failed gRPC call; the type (and message, if any) of anything else."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    text = str(exc) if exc is not None else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """A failure of the TCP lane (lane.py) as the gRPC status PushTensor would have ended with, so
    that one retry / probe / settle policy (sending.py, relay.py) covers both data planes."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def process_gone(exc: BaseException) -> bool:
    """The peer's host refused the connection (nothing listens on the port): its process is gone."""
    return (isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.UNAVAILABLE
            and "connection refused" in (exc.details() or "").lower())


__all__ = ["PeerError", "PeerUnreachable", "rpc_reason", "rpc_error", "process_gone"]
