"""The answers of every receive path: the gRPC PushTensor service (server.py) and the TCP lane
(lane_server.py) hand a reception here to be delivered, refused or dropped, so both count, log and
acknowledge alike.

Every Ack carries this node's step and whether it considers the sender dead (it must rejoin). A
refusal that is not the message's fault (RETRY_LATER: no room for another stream or buffer, an
idle stream) tells the sender it may try the same message id again; each path says so its own way.
Nothing here sends anything or decides what a message means.
"""
from __future__ import annotations

import logging
from typing import Protocol

from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.transport.errors import FailureKind
from p2ptrain.transport.inbox import Inbox, Reception
from p2ptrain.transport.validation import Rejection

log = logging.getLogger(__name__)

# Refusals after which the sender may retry the same message once streams are reaped or buffers freed.
RETRY_LATER = {"too_many_streams": FailureKind.BUSY, "buffer_limit": FailureKind.BUSY,
               "idle_stream": FailureKind.TIMEOUT}


class SenderStanding(Protocol):
    """What the receiving node tells every sender in its Acks (membership's liveness)."""

    step: int  # this node's current step

    def excludes(self, peer: int) -> bool: ...


class Answers:
    """Deliver / refuse / drop receptions of node `rank`'s `inbox`, and acknowledge them."""

    def __init__(self, rank: int, inbox: Inbox, standing: SenderStanding, metrics=None):
        self.rank = rank
        self.inbox = inbox
        self.standing = standing
        self.metrics = metrics

    def deliver(self, reception: Reception) -> pb.Ack:
        """Deliver a complete reception (Inbox.deliver, which raises Rejection) and acknowledge it."""
        message = self.inbox.deliver(reception)
        if self.metrics is not None:
            self.metrics.on_received(message.sender, reception.received)
        return self.ack(message.sender, status=pb.Ack.STATUS_ACCEPTED, bytes_received=reception.received,
                        message_id=message.message_id)

    def refuse(self, rejection: Rejection, reception: Reception | None = None, sender: int = -1) -> pb.Ack:
        """The Ack that answers `rejection` (DUPLICATE for a delivered id); drops `reception` if one
        was open, counts and logs the refusal."""
        received = 0
        if reception is not None:
            sender = reception.header.sender
            self.inbox.abort(reception)
            received = reception.received
        self.count_refusal(rejection.reason)
        duplicate = rejection.reason == "duplicate"
        if not duplicate:
            log.warning("node %d rejected a message%s: %s", self.rank, f" from node {sender}" if sender >= 0 else "",
                        rejection)
        return self.ack(sender, status=pb.Ack.STATUS_DUPLICATE if duplicate else pb.Ack.STATUS_REJECTED,
                        reason=rejection.reason, detail=rejection.detail, bytes_received=received)

    def abort(self, reception: Reception, reason: str) -> None:
        """Drop a reception whose stream or connection broke off (nobody is left to answer)."""
        self.inbox.abort(reception)
        self.count_refusal(reason)

    def count_refusal(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.on_rejected(reason)

    def ack(self, sender: int, **fields) -> pb.Ack:
        return pb.Ack(step=self.standing.step, sender_excluded=sender >= 0 and self.standing.excludes(sender),
                      **fields)


__all__ = ["Answers", "RETRY_LATER", "SenderStanding"]
