"""Frames of the TCP lane (paths/lane_path.py sends, lane_server.py receives), as proto/p2ptrain/v1
defines them: a 4-byte big-endian length, then one protobuf message (LaneChallenge, LaneAuth,
LaneAuthReply, TensorHeader or Ack). The raw payload bytes that follow a TensorHeader frame never
pass through here.

Pure functions and one incremental reader: nothing here touches a socket or keeps node state. A
frame that is too long or not the message it should be raises LaneFrameError; the lane then
answers with a rejection and closes the connection, since it can no longer tell where the next
frame starts.
"""
from __future__ import annotations

import hashlib
import hmac
import struct
from typing import TypeVar

from google.protobuf.message import Message as ProtoMessage

from p2ptrain._proto import p2ptrain_pb2 as pb

LANE_PROTOCOL = "p2ptrain-lane/1"
PREFIX = struct.Struct(">I")
MAX_FRAME_BYTES = 64 * 1024  # a header with a long shape and route is < 1 KiB; anything near this is hostile
NONCE_BYTES = 32
KEEPALIVE = 120.0  # seconds a server lets a connection idle between messages before closing it
_IDENTITIES = struct.Struct(">II")

M = TypeVar("M", bound=ProtoMessage)


class LaneFrameError(ValueError):
    """A lane frame that is too long or does not parse as the message it should be."""


def encode(message: ProtoMessage) -> bytes:
    """The frame of `message`: its length, then its bytes."""
    body = message.SerializeToString()
    if len(body) > MAX_FRAME_BYTES:
        raise ValueError(f"{type(message).__name__} of {len(body)} bytes exceeds a lane frame's "
                         f"{MAX_FRAME_BYTES} bytes")
    return PREFIX.pack(len(body)) + body


def frame_length(prefix: bytes | bytearray | memoryview) -> int:
    """The body length a frame's 4-byte prefix announces; LaneFrameError above MAX_FRAME_BYTES."""
    (length,) = PREFIX.unpack(prefix)
    if length > MAX_FRAME_BYTES:
        raise LaneFrameError(f"frame of {length} bytes announced; at most {MAX_FRAME_BYTES} allowed")
    return length


def decode(cls: type[M], body: bytes | bytearray | memoryview) -> M:
    """Parse a frame body as `cls`; LaneFrameError if it is not one."""
    try:
        return cls.FromString(bytes(body))
    except Exception as exc:  # protobuf's DecodeError (and RuntimeWarning-free friends)
        raise LaneFrameError(f"frame is not a {cls.DESCRIPTOR.name}: {exc}") from None


def auth_proof(token: str, nonce: bytes, sender: int, receiver: int) -> bytes:
    """HMAC-SHA256(token, nonce + protocol + sender + receiver): proves the token without sending it,
    bound to this connection's nonce and to who talks to whom (a proof cannot be replayed)."""
    message = nonce + LANE_PROTOCOL.encode() + _IDENTITIES.pack(sender, receiver)
    return hmac.new(token.encode(), message, hashlib.sha256).digest()


def proof_matches(token: str, nonce: bytes, auth: pb.LaneAuth) -> bool:
    """Whether `auth` proves the token for this connection's nonce (compared in constant time)."""
    return hmac.compare_digest(auth.proof, auth_proof(token, nonce, auth.sender, auth.receiver))


class FrameReader:
    """Splits a byte stream into frame bodies (the lane client's side: challenge, auth reply, Acks)."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        """The bodies completed by `data`, in order; LaneFrameError on an oversized frame."""
        self._buffer += data
        bodies = []
        while len(self._buffer) >= PREFIX.size:
            length = frame_length(self._buffer[:PREFIX.size])
            end = PREFIX.size + length
            if len(self._buffer) < end:
                break
            bodies.append(bytes(self._buffer[PREFIX.size:end]))
            del self._buffer[:end]
        return bodies


__all__ = ["LANE_PROTOCOL", "MAX_FRAME_BYTES", "NONCE_BYTES", "PREFIX", "LaneFrameError", "encode", "decode",
           "frame_length", "auth_proof", "proof_matches", "FrameReader"]
