"""How bytes move: gRPC server + client pool on one event-loop thread, chunk framing, inbox.

The transport never knows what an algorithm means by a tensor; it routes by message kind.
"""
from p2ptrain.transport.inbox import Rejection
from p2ptrain.transport.message import Message
from p2ptrain.transport.runtime import PeerError, Transport, TransportOptions

__all__ = ["Transport", "TransportOptions", "Message", "Rejection", "PeerError"]
