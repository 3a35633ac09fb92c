"""The TCP lane's receiving side: a listening socket whose connections read tensor payloads straight
into the pooled buffer the Inbox hands out (asyncio.BufferedProtocol: get_buffer returns
Reception.space()). Everything else is PushTensor's: the same TensorHeader, checked by the same
Inbox (open / deliver), answered with the same Ack by the same Answers (reception.py), under the same
message ids, so retries, DUPLICATE answers and settling work unchanged. Frames: laneframes.py.

Bounds against broken or hostile clients: from accept, a handshake (TLS, then the token's proof)
must end within HANDSHAKE_SECONDS however its bytes trickle; at most MAX_HANDSHAKES connections (TLS
ones included) may be in it at once, MAX_HANDSHAKES_PER_SOURCE from one address; a connection silent
for the Inbox's stream_idle_timeout inside a message is cut (`idle_stream`), one silent between
messages for KEEPALIVE seconds closed; each sender gets at most twice the Inbox's
max_receptions_per_sender connections. A malformed frame is refused and its connection closed.
"""
from __future__ import annotations

import asyncio
import fcntl
import logging
import secrets
import socket
import sys
import termios
from collections import Counter
from typing import Protocol

from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.addresses import binds_both_families
from p2ptrain.transport.inbox import Reception
from p2ptrain.transport.laneframes import (
    KEEPALIVE,
    LANE_PROTOCOL,
    NONCE_BYTES,
    PREFIX,
    LaneFrameError,
    decode,
    encode,
    frame_length,
    proof_matches,
)
from p2ptrain.transport.peer_identity import IDENTITY, IdentityCheck
from p2ptrain.transport.reception import Answers
from p2ptrain.transport.security import Security
from p2ptrain.transport.shared_segment import PeerSegment, supported
from p2ptrain.transport.validation import Rejection

log = logging.getLogger(__name__)

MAX_HANDSHAKES = 64          # unauthenticated connections at once; more are closed on arrival
MAX_HANDSHAKES_PER_SOURCE = 32  # of them from one source address (nodes on one host share it)
HANDSHAKE_SECONDS = 5.0      # from accept to an accepted proof (TLS handshake included), however bytes trickle
DISCARD_BYTES = 256 * 1024   # scratch into which a refused message's payload is read and dropped
SCAN_BYTES = 4 << 20         # payload bytes checked for NaN / Inf at a time while more arrive (Inbox.scan)
LOW_WATER_BYTES = 1 << 20    # payload bytes a lane connection waits for before a read (SO_RCVLOWAT; < chunk_bytes)


def listening_socket(host: str, port: int) -> socket.socket:
    """A bound, listening TCP socket; a wildcard host listens on IPv6 and IPv4 alike (one port for
    both, as the gRPC server does), or on IPv4 where IPv6 is off."""
    if binds_both_families(host):
        try:
            sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            candidates = [(sock, ("::", port))]
        except OSError:
            candidates = []
        candidates.append((None, ("0.0.0.0", port)))
    else:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
        candidates = [(socket.socket(family, socket.SOCK_STREAM), address)]
    error: OSError | None = None
    for sock, address in candidates:
        sock = sock or socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
            sock.listen(128)
            sock.setblocking(False)
            return sock
        except OSError as exc:
            sock.close()
            error = exc
    raise OSError(f"the TCP lane cannot listen on {host}:{port}: {error}")


# -- receiving side -----------------------------------------------------------------------------------
class SenderConnections(Protocol):
    """Told when a sender's lane connections all closed (a dead peer's kernel closes them at once),
    and when it connects again (hangups.py)."""

    def hung_up(self, peer: int) -> None: ...

    def reconnected(self, peer: int) -> None: ...


class LaneServer:
    """Node `answers.rank`'s lane (of a cluster of `world_size` ranks): accepts connections and
    feeds what they carry into the Inbox through `answers`."""

    def __init__(self, answers: Answers, world_size: int, security: Security, identity: IdentityCheck | None = None,
                 hangups: SenderConnections | None = None, shared_memory: bool = True):
        self.answers = answers
        self.inbox = answers.inbox
        self.rank = answers.rank
        self.world_size = world_size
        self.token = security.token
        self.identity = identity  # under mTLS with identity certificates: LaneAuth.sender must be the peer's
        self.hangups = hangups
        self.ssl = security.lane_server_context()
        self.shared_memory = shared_memory and self.ssl is None and supported()  # take senders' segments
        self.port = 0
        self.connections: set[LaneReceiver] = set()
        self.per_sender: Counter[int] = Counter()  # authenticated connections per sender
        self.handshaking = 0                        # connections accepted and not yet authenticated
        self.handshaking_from: Counter[str] = Counter()  # of them, per source address
        self.handshake_seconds = HANDSHAKE_SECONDS
        self.turned_away = 0  # connections closed on arrival: too many handshakes
        self.admissions: set[Admission] = set()
        self.scratch = memoryview(bytearray(DISCARD_BYTES))  # shared: what lands here is dropped
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task | None = None

    async def start(self, host: str, port: int, avoid: frozenset[int] = frozenset()) -> int:
        """Listen on host:port; returns the port. Port 0: one the OS picks, never one of `avoid`
        (the peers' ports: a launcher or test reserves those before their nodes bind them, and the
        OS picks from the same range, so a lane could otherwise take a peer's port from it)."""
        sock = listening_socket(host, port)
        taken = []
        while not port and sock.getsockname()[1] in avoid and len(taken) < len(avoid):
            taken.append(sock)  # held until the search ends, so the OS offers another port
            sock = listening_socket(host, port)
        for held in taken:
            held.close()
        self.port = sock.getsockname()[1]
        self._listener = sock
        self._accepting = asyncio.get_running_loop().create_task(self._accept(sock))
        return self.port

    async def _accept(self, sock: socket.socket) -> None:
        """Accept plain TCP connections, count each among the handshakes, then start its TLS (when
        set) under the handshake's deadline: a silent TLS client holds a counted slot, never more."""
        loop = asyncio.get_running_loop()
        failures = 0
        while True:
            try:
                conn, peer = await loop.sock_accept(sock)
            except OSError as exc:  # out of descriptors, ...: try again shortly
                failures += 1
                if failures == 1 or failures % 100 == 0:
                    log.warning("node %d: the lane could not accept a connection: %s", self.rank, exc)
                await asyncio.sleep(0.05)
                continue
            source = str(peer[0]) if isinstance(peer, tuple) and peer else ""
            if self.handshaking >= MAX_HANDSHAKES or self.handshaking_from[source] >= MAX_HANDSHAKES_PER_SOURCE:
                self.turned_away += 1
                if self.turned_away == 1 or self.turned_away % 100 == 0:
                    log.warning("node %d: %d lane connections await their handshake (%d from %s); turned away %d so "
                                "far", self.rank, self.handshaking, self.handshaking_from[source], source,
                                self.turned_away)
                conn.close()
                continue
            admission = Admission(self, source)
            admission.task = loop.create_task(self._connect(conn, admission))

    async def _connect(self, conn: socket.socket, admission: "Admission") -> None:
        try:
            await asyncio.get_running_loop().connect_accepted_socket(
                lambda: LaneReceiver(self, admission), conn, ssl=self.ssl,
                ssl_handshake_timeout=self.handshake_seconds if self.ssl else None)
        except (Exception, asyncio.CancelledError) as exc:  # noqa: BLE001 - it costs this connection only
            log.debug("node %d: a lane handshake from %s failed: %r", self.rank, admission.source, exc)
            admission.release()  # (the loop closed the socket it was handed)

    @property
    def max_connections_per_sender(self) -> int:
        return 2 * self.inbox.max_receptions_per_sender

    async def stop(self) -> None:
        """Stop listening and cut every connection (an open reception is dropped)."""
        self.hangups = None  # (the cuts below are ours, not the senders' hang-ups)
        if self._accepting is not None:  # stop accepting before the socket goes (the loop still watches it)
            self._accepting.cancel()
            await asyncio.wait([self._accepting], timeout=1.0)
        if self._listener is not None:
            self._listener.close()
        for admission in list(self.admissions):
            admission.expire()
        for connection in list(self.connections):
            connection.transport.abort()
        await asyncio.sleep(0)  # (lets the cut connections and handshakes clean up)


class Admission:
    """An accepted connection's place among the handshakes (counted from accept, TLS included) and
    its absolute deadline: at it, a connection not yet authenticated is cut, however it trickles."""

    def __init__(self, server: LaneServer, source: str):
        self.server, self.source = server, source
        self.receiver: LaneReceiver | None = None  # once connected (after TLS)
        self.task: asyncio.Task | None = None       # the TLS handshake / connect
        self.done = False
        server.handshaking += 1
        server.handshaking_from[source] += 1
        server.admissions.add(self)
        self._timer = asyncio.get_running_loop().call_later(server.handshake_seconds, self.expire)

    def release(self) -> None:
        """The handshake ended (authenticated, refused or cut): its slot is free."""
        if self.done:
            return
        self.done = True
        self._timer.cancel()
        server = self.server
        server.handshaking -= 1
        server.handshaking_from[self.source] -= 1
        if not server.handshaking_from[self.source]:
            del server.handshaking_from[self.source]
        server.admissions.discard(self)

    def expire(self) -> None:
        if self.done:
            return
        if self.receiver is not None:
            log.debug("node %d: a lane connection from %s did not finish its handshake within %g s",
                      self.server.rank, self.source, self.server.handshake_seconds)
            self.receiver.transport.abort()
        elif self.task is not None:
            self.task.cancel()  # TLS still under way: the loop closes the socket
        self.release()


_FRAME, _PAYLOAD, _DISCARD = "frame", "payload", "discard"


class LaneReceiver(asyncio.BufferedProtocol):
    """One incoming lane connection. Reads exactly what the current part needs (frame prefix, frame
    body, payload, skipped payload), so payload bytes land in the reception's buffer and nowhere else."""

    def __init__(self, server: LaneServer, admission: Admission):
        self.server = server
        self.admission = admission
        self.answers = server.answers
        self.transport: asyncio.BaseTransport | None = None
        self.sender: int | None = None  # authenticated peer: every header must name it
        self.reception: Reception | None = None
        self.closed = False
        self.segment: PeerSegment | None = None  # the sender's shared memory, where it offered and we took it
        self._nonce = secrets.token_bytes(NONCE_BYTES)
        self._handshaking = False
        self._mode = _FRAME
        self._frame = bytearray(PREFIX.size)
        self._filled = 0           # bytes of self._frame read so far
        self._in_prefix = True     # reading a frame's 4-byte prefix (else its body)
        self._handler = self._on_auth
        self._skip = 0             # payload bytes of a refused message still to drop
        self._loop = asyncio.get_running_loop()
        self._last = self._loop.time()
        self._timer: asyncio.TimerHandle | None = None
        self._sock: socket.socket | None = None  # (TCP: its SO_RCVLOWAT follows what the next part needs)
        self._lowat = 1

    # asyncio callbacks --------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        server = self.server
        server.connections.add(self)
        self.admission.receiver = self
        if self.admission.done:  # (its deadline passed as TLS finished)
            transport.abort()
            return
        self._handshaking = True
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if server.ssl is None:  # (under TLS the socket's bytes are records, some read ahead)
                self._sock = sock
        transport.write(encode(pb.LaneChallenge(protocol_version=LANE_PROTOCOL, nonce=self._nonce,
                                                token_required=bool(server.token))))
        self._rearm()

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._mode is _PAYLOAD:
            return self.reception.space()
        if self._mode is _DISCARD:
            return self.server.scratch[:min(self._skip, DISCARD_BYTES)]
        return memoryview(self._frame)[self._filled:]

    def buffer_updated(self, nbytes: int) -> None:
        self._last = self._loop.time()
        try:
            if self._mode is _PAYLOAD:
                reception = self.reception
                reception.filled(nbytes)
                if reception.complete():
                    self._deliver()
                else:
                    self._low_water(reception.header.payload_bytes - reception.received)
                    if reception.received - reception.scanned >= SCAN_BYTES:  # while the rest is on its way
                        self.server.inbox.scan(reception)
            elif self._mode is _DISCARD:
                self._skip -= nbytes
                if not self._skip:
                    self._next_message()
            else:
                beginning = not self._busy()
                self._filled += nbytes
                if beginning:  # a message begins: from now on it may idle only stream_idle_timeout
                    self._rearm()
                if self._filled == len(self._frame):
                    self._frame_read()
        except LaneFrameError as exc:
            self._malformed(str(exc))
        except Exception:  # noqa: BLE001 - a bug here must cost one connection, never the node
            log.exception("node %d: lane connection from node %s failed", self.server.rank, self.sender)
            self._drop_reception("aborted_stream")
            self.transport.abort()

    def eof_received(self) -> bool:
        return False  # the peer is done sending: close (connection_lost drops a half-read message)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.closed = True
        server = self.server
        server.connections.discard(self)
        if self._timer is not None:
            self._timer.cancel()
        self._end_handshake()
        if self.sender is not None:
            server.per_sender[self.sender] -= 1
            if not server.per_sender[self.sender]:
                del server.per_sender[self.sender]
                if server.hangups is not None:
                    server.hangups.hung_up(self.sender)
        self._drop_reception("aborted_stream")
        if self.segment is not None:
            self.segment.close()
            self.segment = None

    # the parts of a connection ------------------------------------------------------------------
    def _low_water(self, remaining: int) -> None:
        """Wake this connection when min(LOW_WATER_BYTES, `remaining`) bytes are in (SO_RCVLOWAT):
        a payload then arrives in reads of about a MiB, not hundreds of 100-KB wake-ups, each a
        Python callback (the lane's share of the CPU per GB); a frame or a payload's last bytes wake
        it as soon as they are all in."""
        wanted = max(1, min(LOW_WATER_BYTES, remaining))
        if wanted != self._lowat and self._sock is not None:
            self._lowat = wanted
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, wanted)

    def _held_back(self) -> bool:
        """Bytes wait in the socket, fewer than the low-water mark (a slow link's trickle)."""
        if self._lowat <= 1 or self._sock is None:
            return False
        pending = fcntl.ioctl(self._sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
        return int.from_bytes(pending, sys.byteorder) > 0

    def _read_frame(self, handler) -> None:
        self._low_water(1)
        self._mode, self._handler = _FRAME, handler
        self._frame, self._filled, self._in_prefix = bytearray(PREFIX.size), 0, True

    def _frame_read(self) -> None:
        if self._in_prefix:
            length = frame_length(self._frame)
            self._frame, self._filled, self._in_prefix = bytearray(length), 0, False
            if length:
                return
        self._handler(self._frame)

    def _end_handshake(self) -> None:
        self._handshaking = False
        self.admission.release()

    def _on_auth(self, body: bytearray) -> None:
        server = self.server
        self._end_handshake()
        auth = decode(pb.LaneAuth, body)
        refusal = self._check_auth(auth)
        if refusal is not None:
            reason, detail = refusal
            self.answers.count_refusal(reason)
            if reason != IDENTITY:  # (IdentityCheck logged it, rate-limited)
                log.warning("node %d refused a lane connection: %s: %s", server.rank, reason, detail)
            self.transport.write(encode(pb.LaneAuthReply(accepted=False, reason=reason, detail=detail)))
            self.transport.close()
            return
        self.sender = auth.sender
        server.per_sender[auth.sender] += 1
        if server.hangups is not None and server.per_sender[auth.sender] == 1:
            server.hangups.reconnected(auth.sender)
        self.transport.write(encode(pb.LaneAuthReply(accepted=True, shared_memory=self._take_segment(auth))))
        self._next_message()

    def _take_segment(self, auth: pb.LaneAuth) -> bool:
        """Map the shared memory the sender offered, where it is of this host and usable."""
        if not auth.shm_capacity or not self.server.shared_memory:
            return False
        try:
            self.segment = PeerSegment.open(auth.shm_pid, auth.shm_fd, auth.shm_capacity, auth.shm_nonce)
        except ValueError as exc:
            log.debug("node %d: node %d's lane segment is not taken: %s", self.server.rank, auth.sender, exc)
            return False
        return True

    def _check_auth(self, auth: pb.LaneAuth) -> tuple[str, str] | None:
        server = self.server
        if auth.protocol_version != LANE_PROTOCOL:
            return "bad_protocol", f"lane protocol {auth.protocol_version!r} != {LANE_PROTOCOL!r}"
        if server.token and not proof_matches(server.token, self._nonce, auth):
            return "unauthenticated", "missing or wrong proof of the auth token"
        if auth.receiver != server.rank:
            return "wrong_receiver", f"connection for node {auth.receiver} reached node {server.rank}"
        if not 0 <= auth.sender < server.world_size or auth.sender == server.rank:
            return "unknown_sender", f"node {auth.sender} is not a peer of node {server.rank}"
        identity = server.identity
        if identity is not None:
            problem = identity.claim_problem(identity.lane_peer(self.transport), auth.sender, "a lane connection")
            if problem is not None:
                return IDENTITY, problem
        if server.per_sender[auth.sender] >= server.max_connections_per_sender:
            return "too_many_connections", (f"node {auth.sender} holds {server.per_sender[auth.sender]} lane "
                                            f"connections already (at most {server.max_connections_per_sender})")
        return None

    def _next_message(self) -> None:
        self._read_frame(self._on_header)

    def _on_header(self, body: bytearray) -> None:
        header = decode(pb.TensorHeader, body)
        shared = self.segment is not None and 0 < header.payload_bytes <= self.segment.capacity
        try:
            if header.sender != self.sender:
                raise Rejection("wrong_sender", f"the lane connection of node {self.sender} carries a message "
                                                f"from node {header.sender}")
            if self.server.identity is not None and header.HasField("via"):  # (a lane carries no relayed message)
                raise Rejection(IDENTITY, self.server.identity.header_problem(str(self.sender), header, relayed=False))
            self.reception = self.server.inbox.open(header)
            if header.payload_bytes:
                self.reception.space()  # take the buffer now: `buffer_limit` refuses before any byte is read
        except Rejection as rejection:
            self._answer(self.answers.refuse(rejection, self.reception, sender=self.sender))
            self.reception = None
            self._skip_payload(0 if shared else header.payload_bytes)
            return
        if shared:  # the payload is in the sender's segment, not on the socket: one copy, then checked
            self.segment.read_into(self.reception.space(), header.payload_bytes)
            self.reception.filled(header.payload_bytes)
        if self.reception.complete():
            self._deliver()
        else:
            self._mode = _PAYLOAD
            self._low_water(header.payload_bytes)

    def _deliver(self) -> None:
        reception, self.reception = self.reception, None
        try:
            ack = self.answers.deliver(reception)
        except Rejection as rejection:  # deliver() released the reception itself
            ack = self.answers.refuse(rejection, sender=self.sender)
        self._answer(ack)
        self._next_message()

    def _skip_payload(self, nbytes: int) -> None:
        """Read and drop a refused message's payload, so the connection stays in step."""
        if nbytes:
            self._mode, self._skip = _DISCARD, nbytes
        else:
            self._next_message()

    def _answer(self, ack: pb.Ack) -> None:
        self.transport.write(encode(ack))

    def _malformed(self, detail: str) -> None:
        """A frame that cannot be parsed: nothing after it can be trusted to be where it should."""
        rejection = Rejection("malformed_frame", detail)
        if self._handshaking or self.sender is None:
            self.answers.count_refusal(rejection.reason)
            log.warning("node %d refused a lane connection: %s", self.server.rank, rejection)
            self.transport.write(encode(pb.LaneAuthReply(accepted=False, reason=rejection.reason, detail=detail)))
        else:
            self._answer(self.answers.refuse(rejection, self.reception, sender=self.sender))
            self.reception = None
        self.transport.close()

    def _drop_reception(self, reason: str) -> None:
        if self.reception is not None:
            self.answers.abort(self.reception, reason)
            self.reception = None

    # idle connections ---------------------------------------------------------------------------
    def _busy(self) -> bool:
        """Inside a handshake or a message (not waiting for the next one)."""
        return self._handshaking or self._mode is not _FRAME or not self._in_prefix or self._filled > 0

    def _limit(self) -> float:
        idle = self.server.inbox.stream_idle_timeout
        return idle if self._busy() else max(idle, KEEPALIVE)

    def _rearm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_at(self._last + self._limit(), self._check_idle)

    def _check_idle(self) -> None:
        if self.closed:
            return
        due = self._last + self._limit()
        if self._loop.time() < due:
            self._timer = self._loop.call_at(due, self._check_idle)
            return
        if self._busy() and self._held_back():  # bytes came: the low-water mark keeps them from a read
            self._low_water(1)
            self._last = self._loop.time()
            self._rearm()
            return
        if self._busy() and self.sender is not None:  # a half-sent message: refused, like an idle stream
            idle = self.server.inbox.stream_idle_timeout
            self._answer(self.answers.refuse(Rejection("idle_stream", f"no bytes for {idle:g} s"), self.reception,
                                             sender=self.sender))
            self.reception = None
        self.transport.close()


__all__ = ["Admission", "LaneServer", "listening_socket", "HANDSHAKE_SECONDS", "KEEPALIVE", "MAX_HANDSHAKES",
           "MAX_HANDSHAKES_PER_SOURCE"]
