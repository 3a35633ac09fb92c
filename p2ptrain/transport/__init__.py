"""How bytes move: membership, the send paths (gRPC, TCP lane, relays), reception into the inbox,
all on one event-loop thread per node.

The transport never knows what an algorithm means by a tensor; it routes by message kind.
"""
from p2ptrain.transport.errors import FailureKind, PeerError, PeerUnreachable, SendFailure
from p2ptrain.transport.message import Message
from p2ptrain.transport.options import TransportOptions
from p2ptrain.transport.transport import Transport
from p2ptrain.transport.validation import CodecLayout, Rejection

__all__ = ["CodecLayout", "FailureKind", "Message", "PeerError", "PeerUnreachable", "Rejection", "SendFailure",
           "Transport", "TransportOptions"]
