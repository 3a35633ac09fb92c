"""The lane path: tensor payloads over a direct TCP connection per peer pair (lane_server.py receives).

grpcio copies every payload byte several times and hands it between threads; here uvloop writes
straight from the tensor's memory (a memoryview, queued without a copy). A connection opens with the
server's challenge, our LaneAuth (rank and, with a token, an HMAC proof: the token never travels)
and the server's verdict, under TLS when the node uses TLS; then it carries one message at a time:
header + payload -> Ack. Where each peer's lane listens is learned from Hellos (LanePorts).

The data plane decides how hard it insists: under `auto` a peer without a usable lane is
PathUnavailable (nothing was sent: the router takes gRPC); under `tcp` (`required`) it is an error.
Runs on the node's loop thread.
"""
from __future__ import annotations

import asyncio
import errno
import logging
import secrets
import socket
import time
from collections import defaultdict, deque
from typing import Protocol

from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.addresses import split_address
from p2ptrain.transport.errors import FailureKind, PeerError, SendFailure
from p2ptrain.transport.laneframes import (
    KEEPALIVE,
    LANE_PROTOCOL,
    FrameReader,
    LaneFrameError,
    auth_proof,
    decode,
    encode,
)
from p2ptrain.transport.paths import PathUnavailable
from p2ptrain.transport.reception import RETRY_LATER
from p2ptrain.transport.security import Security
from p2ptrain.transport.shared_segment import OwnSegment, capacity_for, supported

log = logging.getLogger(__name__)

_timeout = getattr(asyncio, "timeout", None)  # Python >= 3.11
CLIENT_IDLE = KEEPALIVE / 2  # a pooled connection idle this long is retired: before the server's keepalive cuts it
CONNECT_TIMEOUT = 3.0        # connect + handshake; longer means the lane is unusable (auto falls back to gRPC)


class LaneUnavailable(PathUnavailable):
    """No lane connection could be made or authenticated: nothing of the message was sent."""


class Greeter(Protocol):
    """Who greets peers (membership): its Hello tells where the peer's lane listens (LanePorts.learn)."""

    async def hello(self, peer: int, timeout: float, wait_for_ready: bool = True) -> pb.HelloReply: ...


class LanePorts:
    """Where each peer's lane listens, as its Hellos said, and which lanes proved unusable lately.
    `required` (data_plane tcp): a peer without a lane cannot be sent to at all."""

    def __init__(self, rank: int, *, required: bool = False, retry_after: float = 30.0):
        self.rank = rank
        self.required = required
        self.retry_after = retry_after
        self._ports: dict[int, int] = {}        # peer -> the lane port it advertised (0: none)
        self._unusable: dict[int, float] = {}   # peer -> monotonic time until which its lane is not tried
        self._incarnations: dict[int, int] = {}  # peer -> the incarnation its latest Hello named

    def learn(self, peer: int, port: int, incarnation: int = 0) -> None:
        """`peer` advertised lane `port` in a Hello (0: it offers none), as its `incarnation`."""
        if self._ports.get(peer) != port or self._incarnations.get(peer, incarnation) != incarnation:
            self._unusable.pop(peer, None)  # a new lane or process (a restart on the same port): try it at once
        self._ports[peer] = port
        self._incarnations[peer] = incarnation

    def known(self, peer: int) -> bool:
        return peer in self._ports

    def advertised(self, peer: int) -> int:
        """The lane port `peer`'s latest Hello named, usable lately or not (0: none known)."""
        return self._ports.get(peer, 0)

    def port_of(self, peer: int) -> int:
        """The lane port `peer` advertised; 0 when it offers none, is not known, or failed lately."""
        if time.monotonic() < self._unusable.get(peer, 0.0):
            return 0
        return self._ports.get(peer, 0)

    def forget(self, peer: int) -> None:
        """Its lane could not be connected to: ask its Hello where it is now (a restart moves it)."""
        self._ports.pop(peer, None)

    def set_aside(self, peer: int) -> None:
        """Its lane proved unusable: leave it alone for `retry_after` seconds."""
        self._unusable[peer] = time.monotonic() + self.retry_after

    def refusal(self, peer: int) -> str:
        """Why a required lane cannot reach `peer` ("" when it can, or when that is not known yet)."""
        if not self.required or self._ports.get(peer, 1):
            return ""
        return (f"node {self.rank}: node {peer} offers no TCP lane, which data_plane=tcp requires (run it with "
                "data_plane auto or tcp, or use data_plane auto / grpc here)")


class LaneConnection(asyncio.Protocol):
    """One outgoing lane connection: writes frames and payloads, hands back the frames it receives."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.error: BaseException | None = None
        self.port = 0  # the peer's lane port it is connected to
        self.idle_since = 0.0
        self.segment: OwnSegment | None = None  # shared memory the receiver took: payloads that fit go there
        self._reader = FrameReader()
        self._frames: deque[bytes] = deque()
        self._waiter: asyncio.Future | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        try:
            self._frames.extend(self._reader.feed(data))
        except LaneFrameError as exc:
            self.error = exc
            self.transport.abort()
        self._wake()

    def connection_lost(self, exc: BaseException | None) -> None:
        self.closed = True
        self.error = self.error or exc or ConnectionResetError("the peer closed the lane connection")
        self.close_segment()
        self._wake()

    def close_segment(self) -> None:
        if self.segment is not None:
            self.segment.close()
            self.segment = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def frame(self) -> bytes:
        """The next frame body the peer sent; ConnectionError once the connection is gone."""
        while not self._frames:
            if self.closed:
                raise ConnectionError(f"lane connection lost: {self.error}")
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        return self._frames.popleft()

    def send(self, *parts: bytes | memoryview) -> None:
        """Queue `parts` (uvloop writes what it can at once and keeps a reference to the rest: no copy)."""
        for part in parts:
            if len(part):
                self.transport.write(part)

    def abort(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.abort()
        self.close_segment()


def _refused_connect(exc: BaseException) -> bool:
    return isinstance(exc, ConnectionRefusedError) or getattr(exc, "errno", None) == errno.ECONNREFUSED


class LanePath:
    """Node `rank`'s lane path: connections pooled per peer (one message per connection at a time;
    the router bounds the messages in flight per peer). `addresses` are the peers' gRPC addresses
    (a lane listens on the same host); `greeter` is asked where a peer's lane is when no Hello told.
    `shared_memory`: offer each new connection a segment (shared_segment.py), which a receiver of
    this host takes: its payloads then skip the TCP stack (never under TLS)."""

    name = "lane"

    def __init__(self, rank: int, security: Security, ports: LanePorts, addresses: list[str], greeter: Greeter, *,
                 discovery_timeout: float = 2.0, metrics=None, shared_memory: bool = True):
        self.rank = rank
        self.security = security
        self.ports = ports
        self.addresses = addresses
        self.greeter = greeter
        self.discovery_timeout = discovery_timeout
        self.metrics = metrics
        self.token = security.token
        self.ssl = security.lane_client_context()
        self.shared_memory = shared_memory and self.ssl is None and supported()
        self.shared_messages = 0  # messages whose payload went through shared memory
        self._idle: dict[int, list[LaneConnection]] = defaultdict(list)
        self._all: set[LaneConnection] = set()
        self._asking: dict[int, asyncio.Future] = {}  # per peer: the Hello that asks where its lane is

    async def push(self, peer: int, header: pb.TensorHeader, payload: memoryview, timeout: float,
                   wait_for_ready: bool = True) -> pb.Ack:
        """Send over `peer`'s lane; PathUnavailable where it has none (or it could not be connected
        to: tried once more where its Hello says the lane is now, then set aside for a while)."""
        deadline = time.monotonic() + timeout
        ports = self.ports
        failed, failure = None, None  # the lane that could not be connected to, and why
        while True:
            target = await self._lane_of(peer, max(0.05, deadline - time.monotonic()), wait_for_ready)
            if target is None or target == failed:
                break
            try:
                ack = await self._send(peer, *target, header, payload, max(0.05, deadline - time.monotonic()))
            except LaneUnavailable as exc:
                ports.forget(peer)          # nothing was sent: ask its Hello where the lane is now (a
                again = failed is None      # restarted peer listens elsewhere) and try there, once
                failed, failure = target, exc
                if again:
                    continue
                break
            if self.metrics is not None:
                self.metrics.on_lane_message(peer)
            return ack
        if failure is not None:
            if ports.required:
                raise SendFailure(FailureKind.UNREACHABLE, failure.detail)
            ports.set_aside(peer)
            log.warning("%s; other paths to node %d for %.0f s", failure.detail, peer, ports.retry_after)
            raise failure
        if ports.required:
            raise PeerError(self._no_lane(peer))
        raise PathUnavailable(f"node {peer} offers no TCP lane here")

    def _no_lane(self, peer: int) -> str:
        address = self.addresses[peer]
        if split_address(address) is None:
            return f"node {self.rank}: node {peer}'s address {address!r} is no host:port, which data_plane=tcp requires"
        if not self.ports.known(peer):
            return f"node {self.rank}: node {peer} did not say where its TCP lane is (no compatible Hello answer)"
        return self.ports.refusal(peer)

    async def _lane_of(self, peer: int, timeout: float, wait_for_ready: bool) -> tuple[str, int] | None:
        """(host, port) of `peer`'s lane, or None where it has none (that we know of)."""
        address = split_address(self.addresses[peer])
        if address is None:
            return None
        if not self.ports.known(peer):
            await self._ask(peer, timeout if self.ports.required else min(timeout, self.discovery_timeout),
                            wait_for_ready)
        port = self.ports.port_of(peer)
        return (address[0], port) if port else None

    async def _ask(self, peer: int, timeout: float, wait_for_ready: bool) -> None:
        """Hello `peer` once to learn its lane (concurrent pushes share the one Hello). A Hello that
        found no peer fails the push under tcp, and leaves it to other paths under auto (gRPC waits
        for the peer as a push does); one the peer refused (a wrong token) fails it either way."""
        asking = self._asking.get(peer)
        if asking is None:
            asking = self._asking[peer] = asyncio.ensure_future(self.greeter.hello(peer, timeout, wait_for_ready))
            asking.add_done_callback(lambda _: self._asking.pop(peer, None))
        try:
            await asyncio.shield(asking)
        except SendFailure as exc:
            if self.ports.required or not (exc.kind.no_connection or exc.kind in (FailureKind.TIMEOUT,
                                                                                  FailureKind.CANCELLED)):
                raise

    async def _send(self, peer: int, host: str, port: int, header: pb.TensorHeader, payload: memoryview,
                    timeout: float) -> pb.Ack:
        """Header + payload to the lane at host:port, and its Ack. LaneUnavailable when no
        connection could be made (nothing was sent), else SendFailure."""
        try:
            if _timeout is None:  # (Python 3.10)
                return await asyncio.wait_for(self._exchange(peer, host, port, header, payload), timeout)
            async with _timeout(timeout):  # (wait_for would make a task per message)
                return await self._exchange(peer, host, port, header, payload)
        except asyncio.TimeoutError:
            raise SendFailure(FailureKind.TIMEOUT, f"lane to node {peer}: no Ack within {timeout:.3g} s") from None

    async def _exchange(self, peer: int, host: str, port: int, header: pb.TensorHeader,
                        payload: memoryview) -> pb.Ack:
        connection = self._pooled(peer, port) or await self._connect(peer, host, port, payload.nbytes)
        segment = connection.segment
        shared = segment is not None and 0 < payload.nbytes <= segment.capacity
        try:
            if shared:  # the bytes in shared memory, the header on the socket: the receiver copies them out
                segment.write(payload)
                connection.send(encode(header))
            else:
                connection.send(encode(header), payload)
            ack = decode(pb.Ack, await connection.frame())
        except BaseException as exc:
            self._discard(connection)  # whatever was half-sent is dropped by the receiver
            if isinstance(exc, (OSError, LaneFrameError)):  # ConnectionError included
                raise SendFailure(FailureKind.BROKEN, f"lane to node {peer} broke off: {exc}") from None
            raise
        connection.idle_since = asyncio.get_running_loop().time()
        self._idle[peer].append(connection)
        self.shared_messages += shared
        later = RETRY_LATER.get(ack.reason) if ack.status == pb.Ack.STATUS_REJECTED else None
        if later is not None:  # not the message's fault: the sender may retry it
            raise SendFailure(later, f"{ack.reason}: {ack.detail}")
        return ack

    @property
    def connections(self) -> int:
        """Lane connections this node holds open (idle in the pool or carrying a message)."""
        return len(self._all)

    def _pooled(self, peer: int, port: int) -> LaneConnection | None:
        """The most recently used idle connection to `peer`'s lane at `port` still worth using
        (closes stale ones, and those to a lane the peer no longer advertises)."""
        idle, now = self._idle[peer], asyncio.get_running_loop().time()
        while idle:
            connection = idle.pop()
            if not connection.closed and connection.port == port and now - connection.idle_since < CLIENT_IDLE:
                return connection
            self._discard(connection)
        return None

    async def _connect(self, peer: int, host: str, port: int, payload_bytes: int) -> LaneConnection:
        offer = self._offer(payload_bytes)
        try:
            connection = await self._handshake(peer, host, port, offer)
        except BaseException:
            if offer is not None:
                offer.close()
            raise
        return connection

    def _offer(self, payload_bytes: int) -> OwnSegment | None:
        """A segment for a new connection whose first payload has `payload_bytes`, or None."""
        if not self.shared_memory:
            return None
        try:
            return OwnSegment(capacity_for(payload_bytes), secrets.token_bytes(16))
        except OSError as exc:  # (no memfd here, or no memory): TCP it is
            log.debug("node %d: no shared memory for the lane: %s", self.rank, exc)
            return None

    async def _handshake(self, peer: int, host: str, port: int, offer: OwnSegment | None) -> LaneConnection:
        loop = asyncio.get_running_loop()
        where = f"node {self.rank}: lane of node {peer} at {host}:{port}"
        try:
            _, connection = await asyncio.wait_for(loop.create_connection(
                LaneConnection, host, port, ssl=self.ssl,
                server_hostname=self.security.lane_server_name(host) if self.ssl else None), CONNECT_TIMEOUT)
        except (OSError, asyncio.TimeoutError) as exc:
            refused = "connection refused" if _refused_connect(exc) else type(exc).__name__
            raise LaneUnavailable(f"{where}: {refused}: {exc}") from None
        connection.port = port
        self._all.add(connection)
        try:
            challenge = decode(pb.LaneChallenge, await asyncio.wait_for(connection.frame(), CONNECT_TIMEOUT))
            if challenge.protocol_version != LANE_PROTOCOL:
                raise LaneFrameError(f"lane protocol {challenge.protocol_version!r} != {LANE_PROTOCOL!r}")
            proof = auth_proof(self.token, challenge.nonce, self.rank, peer) if self.token else b""
            auth = pb.LaneAuth(protocol_version=LANE_PROTOCOL, sender=self.rank, receiver=peer, proof=proof)
            if offer is not None:
                auth.shm_pid, auth.shm_fd, auth.shm_capacity, auth.shm_nonce = (offer.pid, offer.fd, offer.capacity,
                                                                                 offer.nonce)
            connection.send(encode(auth))
            verdict = decode(pb.LaneAuthReply, await asyncio.wait_for(connection.frame(), CONNECT_TIMEOUT))
        except (OSError, asyncio.TimeoutError, LaneFrameError) as exc:
            self._discard(connection)
            raise LaneUnavailable(f"{where}: handshake failed: {type(exc).__name__}: {exc}") from None
        except BaseException:
            self._discard(connection)
            raise
        if not verdict.accepted:
            self._discard(connection)
            detail = f"{where} refused the connection: {verdict.reason}: {verdict.detail}"
            if verdict.reason == "unauthenticated":
                raise SendFailure(FailureKind.DENIED, detail)
            if verdict.reason == "too_many_connections":
                raise SendFailure(FailureKind.BUSY, detail)
            raise LaneUnavailable(detail)  # e.g. another node now listens on that port: ask again
        if offer is not None:
            offer.close_fd()  # (the receiver has its own mapping, or none)
            if verdict.shared_memory and not connection.closed:
                connection.segment = offer
            else:
                offer.close()
        return connection

    def _discard(self, connection: LaneConnection) -> None:
        connection.abort()
        self._all.discard(connection)

    async def close(self) -> None:
        for connection in list(self._all):
            connection.abort()
        self._all.clear()
        self._idle.clear()


__all__ = ["CLIENT_IDLE", "CONNECT_TIMEOUT", "Greeter", "LaneConnection", "LanePath", "LanePorts", "LaneUnavailable"]
