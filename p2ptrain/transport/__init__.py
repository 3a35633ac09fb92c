"""How bytes move: gRPC server + client pool on one event-loop thread, chunk framing, inbox.

The transport never knows what an algorithm means by a tensor; it routes by message kind.
"""
from p2ptrain.transport.errors import PeerError
from p2ptrain.transport.message import Message
from p2ptrain.transport.options import TransportOptions
from p2ptrain.transport.runtime import Transport
from p2ptrain.transport.validation import CodecLayout, Rejection

__all__ = ["Transport", "TransportOptions", "Message", "Rejection", "PeerError", "CodecLayout"]
