"""The errors a node's transport raises, in its own words: no path's library types leak out of it.

A send that fails raises SendFailure(kind, detail). The kind is all that the sender's policy
(retry, relay, settle, probe) needs: whether the same message id may simply be tried again, whether
the peer's process is gone, whether the failure is final. Each path (gRPC, the TCP lane, link
emulation) maps its own failures to these kinds in one place; nothing here sends or decides.
"""
from __future__ import annotations

import enum


class PeerError(RuntimeError):
    """A peer is unreachable or incompatible."""


class PeerUnreachable(PeerError):
    """The peer is considered dead (refused connections and did not answer a probe): the message
    was not delivered, so its sender still owns it (SGP re-absorbs a push-sum share)."""


class NoClusterToRejoin(PeerError):
    """A (re)starting node found no live member to take state from: the cluster has finished (or is
    unreachable). Nothing failed: there is nothing left to train."""


class FailureKind(enum.Enum):
    GONE = "gone"                # nothing listens at the peer's address: its process is gone
    UNREACHABLE = "unreachable"  # no connection could be made (yet): down, partitioned, not started, blocked
    TIMEOUT = "timeout"          # no answer within the deadline
    BROKEN = "broken"            # the connection broke off mid-message: the peer may have delivered it
    BUSY = "busy"                # the peer had no room for it (streams, buffers): it may take a retry
    DROPPED = "dropped"          # the emulated link lost it (faults.py): it never reached the peer
    CANCELLED = "cancelled"      # the call was cancelled (shutdown, a cancelled caller)
    DENIED = "denied"            # authentication or authorization refused: trying again cannot help
    PROTOCOL = "protocol"        # the peer does not take this call (invalid argument, unimplemented)

    @property
    def retryable(self) -> bool:
        """The same message (same id: the receiver answers a delivered copy DUPLICATE) may be sent again."""
        return self in _RETRYABLE

    @property
    def no_connection(self) -> bool:
        """No connection reached the peer: another way to it (a relay) is worth trying."""
        return self in (FailureKind.GONE, FailureKind.UNREACHABLE)


_RETRYABLE = frozenset({FailureKind.UNREACHABLE, FailureKind.TIMEOUT, FailureKind.BROKEN, FailureKind.BUSY,
                        FailureKind.CANCELLED})


class SendFailure(ConnectionError):
    """A call to a peer failed on its way there or back; `kind` says how (FailureKind)."""

    def __init__(self, kind: FailureKind, detail: str):
        super().__init__(f"{kind.value}: {detail}")
        self.kind = kind
        self.detail = detail


def describe(exc: BaseException | None) -> str:
    """A failure in one line, for logs: "kind: detail" of a SendFailure, else "Type: message"."""
    if isinstance(exc, SendFailure):
        return str(exc)
    text = str(exc) if exc is not None else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


__all__ = ["FailureKind", "NoClusterToRejoin", "PeerError", "PeerUnreachable", "SendFailure", "describe"]
