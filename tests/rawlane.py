"""A synchronous TCP-lane client that writes frames by hand, for tests that speak to a node's lane
the way a broken or hostile peer would (tests/test_lane.py, test_fuzz_wire.py, test_security.py)."""
from __future__ import annotations

import socket
import ssl

from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.transport.laneframes import LANE_PROTOCOL, PREFIX, auth_proof, decode, encode


class RawLane:
    """One connection to the lane at 127.0.0.1:`port`; reads the challenge, and with `sender` given
    authenticates as that node (with `token`, a correct proof; `proof` overrides it), offering the
    shared memory `offer` names (LaneAuth's shm_* fields) where given."""

    def __init__(self, port: int, sender: int | None = 0, receiver: int = 1, *, token: str | None = None,
                 proof: bytes | None = None, tls: ssl.SSLContext | None = None, timeout: float = 10.0,
                 offer: dict | None = None):
        sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.sock = tls.wrap_socket(sock, server_hostname="127.0.0.1") if tls is not None else sock
        self.challenge = decode(pb.LaneChallenge, self.frame())
        self.verdict: pb.LaneAuthReply | None = None
        if sender is not None:
            if proof is None:
                proof = auth_proof(token, self.challenge.nonce, sender, receiver) if token else b""
            self.send(encode(pb.LaneAuth(protocol_version=LANE_PROTOCOL, sender=sender, receiver=receiver,
                                         proof=proof, **(offer or {}))))
            self.verdict = decode(pb.LaneAuthReply, self.frame())

    def send(self, *parts: bytes) -> None:
        for part in parts:
            self.sock.sendall(part)

    def read(self, nbytes: int) -> bytes:
        data = b""
        while len(data) < nbytes:
            chunk = self.sock.recv(nbytes - len(data))
            if not chunk:
                raise ConnectionError(f"lane closed after {len(data)} of {nbytes} bytes")
            data += chunk
        return data

    def frame(self) -> bytes:
        (length,) = PREFIX.unpack(self.read(PREFIX.size))
        return self.read(length)

    def ack(self) -> pb.Ack:
        return decode(pb.Ack, self.frame())

    def push(self, header: pb.TensorHeader, payload: bytes) -> pb.Ack:
        """One message: its header frame and payload, then the Ack."""
        self.send(encode(header), payload)
        return self.ack()

    def closed_by_peer(self, timeout: float = 5.0) -> bool:
        """True once the node closed the connection (reads EOF or a reset), within `timeout`."""
        self.sock.settimeout(timeout)
        try:
            while self.sock.recv(65536):
                pass
        except (ConnectionError, ssl.SSLError):
            return True
        except TimeoutError:
            return False
        return True

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "RawLane":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
