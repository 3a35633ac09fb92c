"""The Transport of one node: an event-loop thread owning the gRPC server, client pool and inbox.

grpc.aio objects are not thread-safe, so every one of them is created and used on this single
thread (loop.py's LoopThread). The training thread talks to it only through the blocking /
future-returning methods below, which hop onto the loop through that bridge.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
import logging
import secrets
import time
from dataclasses import dataclass

import grpc
import torch

from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.transport.client import PeerClient
from p2ptrain.transport.faults import LinkEmulator, LinkTable, MessageDropped
from p2ptrain.transport.framing import DEFAULT_CHUNK_BYTES, check_chunk_bytes, tensor_bytes, wire_dtype
from p2ptrain.transport.health import ServingStatus
from p2ptrain.transport.inbox import Inbox, Message
from p2ptrain.transport.loop import LoopThread
from p2ptrain.transport.membership import DEFAULT_MAX_LAG, Membership
from p2ptrain.transport.relay import Relay
from p2ptrain.transport.security import PLAINTEXT, Security
from p2ptrain.transport.server import SERVICE_NAME, Identity, PeerService, serve
from p2ptrain.transport.tuning import tune_process_for_transfer

log = logging.getLogger(__name__)


class PeerError(RuntimeError):
    """A peer is unreachable or incompatible."""


class PeerUnreachable(PeerError):
    """The peer is considered dead (refused connections and did not answer a probe): the message
    was not delivered, so its sender still owns it (SGP re-absorbs a push-sum share)."""


VOIDED = "voided"  # Ack reason of a settled message the receiver never delivered (it refuses it for good)


# Failures after which the same message (same id: the receiver dedups) is simply tried again.
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
              grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)


@dataclass(frozen=True)
class TransportOptions:
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    send_timeout: float = 120.0        # one tensor push, including waiting for the peer to come up
    keepalive_ms: int = 20_000
    step_window: int = 64              # accept messages whose step is within ± this of ours
    shutdown_grace: float = 2.0
    pin_memory: bool = False           # receive buffers in pinned memory (CUDA training)
    links: LinkTable | None = None     # WAN emulation of outgoing links (faults.py); None = off
    link_deadline: float = 10.0        # longest wait for a peer's message of one step: then the link
                                       # counts as dropped for that step (late messages are folded in later)
    probe_timeout: float = 2.0         # a peer that misses a deadline and does not answer a Hello
                                       # within this is declared dead
    security: Security = PLAINTEXT     # TLS and auth token of server and channels (security.py)
    relay_routes: tuple[str, ...] = ()  # "SRC->DST:VIA[,VIA2]": peers reached through relays (relay.py)
    relays: str | None = None          # relay candidates ("1,2" / "any") when a peer proves unreachable
    relay_retry_after: float = 30.0    # seconds before a direct link found unreachable is tried again
    max_lag: int = DEFAULT_MAX_LAG     # a peer this many steps behind is not sent to / waited for; a node
                                       # this far behind the cluster catches up by a state transfer
    settle_interval: float = 1.0       # how often the fate of unacknowledged messages is asked for

    def channel_options(self) -> list[tuple[str, object]]:
        limit = self.chunk_bytes + (1 << 20)  # a data chunk plus framing; headers are tiny
        return [
            ("grpc.max_send_message_length", limit),
            ("grpc.max_receive_message_length", limit),
            ("grpc.keepalive_time_ms", self.keepalive_ms),
            ("grpc.keepalive_timeout_ms", max(1000, self.keepalive_ms // 2)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            # A peer that was down (crash, restart) must be reachable again within a second, not
            # after gRPC's default reconnect backoff of up to 2 minutes.
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]  # flow-control / frame-size knobs measured no better (p2ptrain.bench.grpc_study)

    def server_options(self) -> list[tuple[str, object]]:
        return self.channel_options() + [
            ("grpc.http2.min_ping_interval_without_data_ms", max(1000, self.keepalive_ms // 2)),
            ("grpc.so_reuseport", 0),
        ]


@dataclass(frozen=True)
class ClusterSurvey:
    reachable: int  # peers that answered a Hello
    running: bool   # one of them is ready and past step 0


class Transport:
    """Tensor push/receive for node `rank` of `world_size`; peers[i] is node i's address."""

    def __init__(self, rank: int, world_size: int, peers: list[str], *, listen: str | None = None,
                 options: TransportOptions | None = None, metrics=None, config_fingerprint: str = ""):
        if len(peers) != world_size:
            raise ValueError(f"need one address per node: {len(peers)} addresses for world size {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside 0..{world_size - 1}")
        self.rank = rank
        self.world_size = world_size
        self.peers = list(peers)
        self.options = options or TransportOptions()
        check_chunk_bytes(self.options.chunk_bytes)
        self.listen = listen or f"[::]:{peers[rank].rsplit(':', 1)[1]}"
        self.metrics = metrics
        self.identity = Identity(rank, world_size, config_fingerprint)
        self.inbox = Inbox(rank, world_size, step_window=self.options.step_window,
                           pin_memory=self.options.pin_memory)
        self.port: int | None = None
        self._bridge = LoopThread(f"p2ptrain-comm-{rank}", f"node {rank} transport")
        self._server: grpc.aio.Server | None = None
        self._clients: dict[int, PeerClient] = {}
        self._ids = itertools.count((secrets.randbits(31) << 32) | 1)  # unique across restarts
        self.incarnation = _new_incarnation()  # new at every start and every completed rejoin
        self._step = 0
        self._ready = False
        self._peers_ready: set[int] = set()  # peers that told us (in their Hello) they are ready
        links = self.options.links
        self._links = links if links is not None and not links.is_noop else None  # None: no emulation cost
        self._emulators: dict[int, LinkEmulator | None] = {}  # per peer, made on the loop thread
        self._emulating: set[asyncio.Task] = set()  # sends waiting in link emulation, cancelled by stop()
        self.membership = Membership(rank, world_size, metrics, max_lag=self.options.max_lag)
        self.membership.on_change = lambda: self.inbox.wake()  # stop waiting for a peer declared dead
        self.inbox.on_deliver = self.membership.heard_from
        self.inbox.excluded = self.membership.dead
        self._reached: set[int] = set()      # peers we delivered to: later connect failures fail fast
        self._probing: set[int] = set()
        self._state_requests: list[int] = []  # peers that asked for our model state (Hello want_state)
        self.resume_step = 0                  # the step a rejoined node resumes at (sent in its Hellos)
        # Sends whose Ack has not come yet, per peer, oldest first (Communicator.make_room bounds them),
        # and settle-able sends whose outcome is unknown (the link failed after bytes left).
        self._outstanding: dict[int, dict[int, concurrent.futures.Future]] = {p: {} for p in range(world_size)}
        self._unsettled: dict[int, dict[int, asyncio.Future]] = {}
        self._settling: set[int] = set()
        self.health: ServingStatus | None = None  # grpc.health.v1 answer: SERVING once ready (health.py)

    # Lifecycle ------------------------------------------------------------------------------
    def start(self, timeout: float = 30.0) -> "Transport":
        tune_process_for_transfer()
        self._bridge.start(self._start_server, timeout)  # re-raises a bind failure in the caller's thread
        return self

    async def _start_server(self) -> None:
        service = PeerService(self.inbox, self.identity, self.metrics, current_step=lambda: self._step,
                              is_ready=lambda: self._ready, on_peer_ready=self._peers_ready.add,
                              on_hello=self._on_hello, excludes=self.membership.excludes,
                              incarnation=lambda: self.incarnation)
        service.forwarder = self._relay = Relay(self)  # route choice of sends, forwarding for others
        self._server, self.health, port = await serve(
            service.handler(), SERVICE_NAME, listen=self.listen, options=self.options.server_options(),
            security=self.options.security, metrics=self.metrics, serving=self._ready)
        if port == 0:
            raise PeerError(f"node {self.rank} could not listen on {self.listen}")
        self.port = port

    def stop(self) -> None:
        """Graceful: in-flight RPCs get `shutdown_grace` seconds, then channels close."""
        async def shutdown() -> None:
            if self.health is not None:
                await self.health.drain()  # NOT_SERVING before the grace period: probes stop routing here
            if self._server is not None:
                await self._server.stop(self.options.shutdown_grace)
            for client in self._clients.values():
                await client.close()
            for task in self._emulating:  # else they would die pending with the loop, their futures never done
                task.cancel()
            for unsettled in self._unsettled.values():
                for waiter in unsettled.values():
                    if not waiter.done():
                        waiter.set_exception(PeerUnreachable(f"node {self.rank}: stopped before the peer "
                                                             "settled this message (its outcome is unknown)"))

        self._bridge.stop(shutdown, self.options.shutdown_grace)  # (cancels spawned background tasks too)

    def __enter__(self) -> "Transport":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # Bridge helpers ---------------------------------------------------------------------------
    def call_soon(self, fn, *args) -> None:
        """Run fn(*args) on the transport's loop thread (e.g. tests freezing it as SIGSTOP would)."""
        self._bridge.call_soon(fn, *args)

    def _submit(self, coro) -> concurrent.futures.Future:
        return self._bridge.submit(coro)

    @property
    def _loop(self) -> asyncio.AbstractEventLoop | None:
        return self._bridge.loop

    @property
    def _thread(self):
        return self._bridge.thread

    def _client(self, peer: int) -> PeerClient:
        client = self._clients.get(peer)
        if client is None:
            client = self._clients[peer] = PeerClient(self.peers[peer], self.options.channel_options(),
                                                      self.options.chunk_bytes, self.options.security)
        return client

    # Sending ----------------------------------------------------------------------------------
    def send(self, peer: int, tensor: torch.Tensor, *, kind: int, step: int, ps_weight: float = 0.0,
             relay_count: float = 0.0, channel: str = "", codec: int = pb.CODEC_NONE,
             codec_params: tuple[float, ...] = (), dtype: torch.dtype | None = None,
             numel: int | None = None, shape: tuple[int, ...] | None = None,
             reliable: bool = False, settle: bool = False) -> concurrent.futures.Future:
        """Push `tensor` (CPU; ownership passes to the transport until the future is done).

        Returns a future of the peer's Ack. For codec payloads `tensor` holds the encoded bytes and
        dtype / numel / shape describe the decoded tensor. Under link emulation (options.links) a
        lost message fails the future with MessageDropped, unless `reliable`: then it is sent again
        (paying the link's bandwidth and latency again, like a retransmission) until it arrives.

        `settle` (for messages that carry push-sum mass): when the link fails after bytes left, the
        outcome is unknown, so instead of failing the future waits until the peer answers a Settle:
        an Ack ACCEPTED if it had delivered the message, REJECTED with reason "voided" if not (it
        then refuses any late copy). The future fails with PeerUnreachable only when nothing was
        sent (the peer was already dead) or the transport stops first.
        """
        if not 0 <= peer < self.world_size or peer == self.rank:
            raise ValueError(f"node {self.rank} cannot send to {peer}")
        payload = tensor_bytes(tensor)
        header = pb.TensorHeader(
            sender=self.rank, receiver=peer, step=step, kind=kind,
            dtype=wire_dtype(dtype or tensor.dtype), numel=numel if numel is not None else tensor.numel(),
            shape=list(shape if shape is not None else tensor.shape), payload_bytes=len(payload),
            codec=codec, codec_params=list(codec_params), ps_weight=ps_weight, relay_count=relay_count,
            message_id=next(self._ids), channel=channel)
        future = self._submit(self._send(peer, header, payload, tensor, reliable, settle))
        outstanding = self._outstanding[peer]
        outstanding[header.message_id] = future
        future.add_done_callback(lambda _: outstanding.pop(header.message_id, None))
        return future

    def outstanding(self, peer: int) -> list[concurrent.futures.Future]:
        """Futures of our sends to `peer` not acknowledged yet, oldest first."""
        return list(self._outstanding[peer].values())

    async def _send(self, peer: int, header: pb.TensorHeader, payload: memoryview, keepalive,
                    reliable: bool = False, settle: bool = False) -> pb.Ack:
        deadline = time.monotonic() + self.options.send_timeout
        attempted = False  # once bytes may have left, only the receiver knows whether it delivered
        while True:
            if not self.membership.alive(peer) and header.kind != pb.MESSAGE_KIND_STATE:  # (a joiner asked)
                failure = PeerUnreachable(f"node {self.rank}: peer {peer} is considered dead")
                if settle and attempted:
                    return await self._settle_later(peer, header.message_id, failure)
                raise failure
            # Until a peer was reached once, wait for it to come up (nodes start in any order);
            # afterwards a refused connect fails at once, so a crash is noticed within a probe.
            wait = peer not in self._reached
            remaining = max(0.05, deadline - time.monotonic())
            try:  # direct or through relays (declared, or when the peer proves unreachable): relay.py
                attempted = True
                ack = await self._relay.push(peer, header, payload, reliable, remaining, wait_for_ready=wait)
                break
            except grpc.aio.AioRpcError as exc:
                if self.metrics is not None:
                    self.metrics.on_send_error(peer)
                unreachable = exc.code() == grpc.StatusCode.UNAVAILABLE and not await self._probe(peer)
                if not reliable or exc.code() not in _RETRYABLE or time.monotonic() >= deadline or unreachable:
                    if settle:
                        return await self._settle_later(peer, header.message_id, exc)
                    if unreachable:
                        raise PeerUnreachable(f"node {self.rank}: peer {peer} unreachable: "
                                              f"{_rpc_reason(exc)}") from exc
                    raise
                await asyncio.sleep(0.05)  # then the same message id again: a delivered copy is a duplicate
        self._reached.add(peer)
        self._heard_back(peer, ack)
        if self.metrics is not None:
            if ack.status == pb.Ack.STATUS_ACCEPTED:
                self.metrics.on_sent(peer, len(payload))
            elif ack.status == pb.Ack.STATUS_REJECTED:
                self.metrics.on_refused_send(peer)
        del keepalive  # the tensor behind `payload` may be freed now
        return ack

    def _heard_back(self, peer: int, ack: pb.Ack) -> None:
        """What an Ack tells about its sender: its step, and whether it excludes us."""
        self.membership.note_step(peer, ack.step)
        if ack.sender_excluded:
            self.membership.excluded(by_peer=peer)

    async def _settle_later(self, peer: int, message_id: int, why: BaseException) -> pb.Ack:
        """Wait until `peer` says whether it delivered `message_id` (see send's `settle`)."""
        log.info("node %d: outcome of message %d to node %d unknown (%s); settling it when the peer answers",
                 self.rank, message_id, peer, _rpc_reason(why))
        waiter = asyncio.get_running_loop().create_future()
        self._unsettled.setdefault(peer, {})[message_id] = waiter
        if peer not in self._settling:
            self._settling.add(peer)
            self._spawn(self._settle_loop(peer))
        return await waiter

    async def _settle_loop(self, peer: int) -> None:
        """Ask `peer` (every settle_interval, until it answers) which unsettled messages it delivered."""
        try:
            while self._unsettled.get(peer):
                pending = self._unsettled[peer]
                request = pb.SettleRequest(sender=self.rank, message_ids=sorted(pending))
                try:
                    reply = await self._client(peer).settle(request, self.options.probe_timeout)
                except (grpc.aio.AioRpcError, asyncio.TimeoutError) as exc:
                    if not _process_gone(exc):  # stalled, partitioned, restarting: ask again later
                        await asyncio.sleep(self.options.settle_interval)
                        continue
                    # Nothing listens on its port any more: the process died and its state (with
                    # whatever it had delivered) went with it, so taking the messages back cannot
                    # count any mass twice. (A stalled process still accepts connections.)
                    reply = pb.SettleReply()
                delivered = set(reply.delivered)
                for message_id in list(request.message_ids):
                    waiter = pending.pop(message_id, None)
                    if waiter is None or waiter.done():
                        continue
                    if message_id in delivered:
                        waiter.set_result(pb.Ack(status=pb.Ack.STATUS_ACCEPTED, message_id=message_id,
                                                 detail="settled: delivered"))
                    else:
                        waiter.set_result(pb.Ack(status=pb.Ack.STATUS_REJECTED, reason=VOIDED, message_id=message_id,
                                                 detail="settled: never delivered, voided by the receiver"))
                log.info("node %d: settled %d message(s) with node %d: %d delivered", self.rank,
                         len(request.message_ids), peer, len(delivered & set(request.message_ids)))
        finally:
            self._settling.discard(peer)

    async def _emulate_link(self, peer: int, nbytes: int, reliable: bool) -> None:
        """Wait as link rank -> peer would; every emulated loss is counted, and re-drawn if reliable."""
        if peer not in self._emulators:
            self._emulators[peer] = self._links.emulator(self.rank, peer)
        emulator = self._emulators[peer]
        task = asyncio.current_task()
        self._emulating.add(task)
        try:
            while emulator is not None:
                try:
                    return await emulator.transmit(nbytes)
                except MessageDropped:
                    if self.metrics is not None:
                        self.metrics.on_dropped(peer)
                    if not reliable:
                        raise
        finally:
            self._emulating.discard(task)

    # Receiving --------------------------------------------------------------------------------
    def expect(self, kind: int, dtype: torch.dtype, numel: int, **kwargs) -> None:
        """Declare an accepted message kind (see Inbox.expect); call before peers send."""
        self._bridge.call(functools.partial(self.inbox.expect, kind, dtype, numel, **kwargs))

    def unexpect(self, kind: int, channel: str | None = None) -> None:
        """Stop accepting `kind` (Inbox.unexpect)."""
        self._bridge.call(self.inbox.unexpect, kind, channel)

    def probe(self, peer: int) -> bool:
        """Hello `peer` once without waiting for a connection; declares it dead if it does not answer."""
        return self._submit(self._probe(peer)).result(self.options.probe_timeout + 10)

    @staticmethod
    async def _call(fn, *args, **kwargs):
        return fn(*args, **kwargs)

    def set_step(self, step: int) -> None:
        """The node's current step: the centre of the accepted step window."""
        self._step = step
        self.membership.step = step
        if self._bridge.started:
            self._bridge.call_soon(self.inbox.set_step, step)

    def recv(self, kind: int, step: int, senders: list[int], *, timeout: float | None = None,
             channel: str = "") -> dict[int, Message]:
        """Block until each sender's step-`step` message of `kind` arrived; raises TimeoutError."""
        if not senders:
            return {}
        future = self._submit(self.inbox.wait_for(kind, step, list(senders), channel, timeout))
        return future.result()

    def gather(self, kind: int, step: int, senders: list[int], *, channel: str = "",
               deadline: float | None = None) -> dict[int, Message]:
        """The step-`step` messages of the senders worth waiting for (membership.awaited), waiting
        at most `deadline` (default options.link_deadline) seconds. A sender that missed it counts
        as a dropped link for this step (its message is folded in later, if it comes) and gets a
        Hello probe: one that does not answer is declared dead and not waited for again."""
        awaited = self.membership.awaited(senders, step)
        if not awaited:
            return {}
        timeout = self.options.link_deadline if deadline is None else deadline
        return self._submit(self._gather(kind, step, awaited, channel, timeout)).result()

    async def _gather(self, kind: int, step: int, senders: list[int], channel: str,
                      timeout: float) -> dict[int, Message]:
        got = await self.inbox.wait_for(kind, step, senders, channel, timeout, partial=True)
        for peer in senders:
            if peer not in got and self.membership.alive(peer):
                if self.metrics is not None:
                    self.metrics.on_link_timeout(peer)
                self._spawn(self._probe(peer))
        return got

    async def _reset_client(self, peer: int) -> None:
        client = self._clients.pop(peer, None)
        if client is not None:
            await client.close()

    def _spawn(self, coro) -> None:
        self._bridge.spawn(coro)

    async def _probe(self, peer: int) -> bool:
        """Hello `peer` without waiting for a connection; declare it dead if it does not answer."""
        if peer in self._probing:
            return self.membership.alive(peer)
        self._probing.add(peer)
        try:
            await self._greet(peer, self._hello_request(), self.options.probe_timeout, wait_for_ready=False)
            return True
        except (grpc.aio.AioRpcError, asyncio.TimeoutError) as exc:
            self.membership.mark_dead(peer, f"no answer to a probe: {_rpc_reason(exc)}")
            return False
        finally:
            self._probing.discard(peer)

    def _on_hello(self, request: pb.HelloRequest) -> str:
        """Membership news from a Hello; returns why a want_state request is refused ("" = served)."""
        peer = request.node_id
        was_dead = not self.membership.alive(peer)
        self.membership.hello(peer, ready=request.ready, incarnation=request.incarnation,
                              current_step=request.current_step, resume_step=request.step)
        if was_dead and self.membership.alive(peer):  # back from the dead: connect afresh, no backoff
            self._spawn(self._reset_client(peer))
        if not request.want_state:
            return ""
        if not self.membership.may_donate_to(peer, request.incarnation):
            log.warning("node %d: peer %d asked for our state but never left (not dead, lagging or restarted "
                        "here); refused", self.rank, peer)
            return f"node {self.rank} will not hand its state to node {peer}: it never saw that node leave"
        if peer not in self._state_requests:
            log.info("node %d: peer %d asks for our state (to rejoin)", self.rank, peer)
            self._state_requests.append(peer)
        return ""

    def has_state_requests(self) -> bool:
        return bool(self._state_requests)  # a racy peek from the training thread; take_ decides

    def take_state_requests(self) -> list[int]:
        """Peers that asked (in a Hello) for our model state since the last call."""
        return self._submit(self._call(self._pop_state_requests)).result()

    def _pop_state_requests(self) -> list[int]:
        requests, self._state_requests = self._state_requests, []
        return requests

    def take(self, kind: int, max_step: int, channel: str = "") -> list[Message]:
        """Messages of `kind` with step <= max_step that already arrived (non-blocking)."""
        return self._submit(self._call(self.inbox.take, kind, max_step, channel)).result()

    # Membership -------------------------------------------------------------------------------
    def _hello_request(self) -> pb.HelloRequest:
        me = self.identity
        return pb.HelloRequest(node_id=me.node_id, world_size=me.world_size, ready=self._ready,
                               protocol_version=me.protocol_version, config_fingerprint=me.config_fingerprint,
                               step=self.resume_step, current_step=self._step, incarnation=self.incarnation)

    async def _greet(self, peer: int, request: pb.HelloRequest, timeout: float,
                     wait_for_ready: bool = True) -> pb.HelloReply:
        """Hello `peer` (client made on the loop) and note what its reply says about it and us."""
        reply = await self._client(peer).hello(request, timeout, wait_for_ready=wait_for_ready)
        if reply.compatible and reply.node_id == peer:
            self.membership.note_step(peer, reply.step)
            if reply.caller_excluded:
                self.membership.excluded(by_peer=peer)
        return reply

    async def _hello(self, peer: int, timeout: float) -> pb.HelloReply:
        return await self._greet(peer, self._hello_request(), timeout)

    def hello(self, peer: int, timeout: float = 10.0) -> pb.HelloReply:
        return self._submit(self._hello(peer, timeout)).result(timeout + 5)

    def resume_at(self, step: int) -> None:
        """A rejoined node continues at `step`: centre its step window there and say so in Hellos."""
        self.resume_step = step
        self.set_step(step)

    def rejoined(self, step: int) -> None:
        """A state transfer completed: resume at `step` as a new incarnation (so peers that declared
        this node dead take it back) and tell every peer."""
        self.incarnation = _new_incarnation()
        self.membership.rejoined()
        self.resume_at(step)
        if self._ready:
            self.announce_ready()

    def request_state(self, timeout: float) -> int:
        """Ask live peers for their model state (Hello with want_state) until one that is ready
        accepts; returns its rank. Peers that excluded this node come first: they saw it leave, so
        they donate. The state arrives as a MESSAGE_KIND_STATE push."""
        deadline = time.monotonic() + timeout
        request = self._hello_request()
        request.want_state = True
        problems: dict[int, str] = {}
        while True:
            preferred = sorted(self.membership.excluded_by())
            for peer in preferred + [p for p in range(self.world_size) if p != self.rank and p not in preferred]:
                try:
                    reply = self._submit(self._client_call(peer, request, 2.0)).result(10)
                except (grpc.aio.AioRpcError, concurrent.futures.TimeoutError) as exc:
                    problems[peer] = _rpc_reason(exc)
                    continue
                if reply.compatible and reply.ready and not reply.reason:
                    return peer
                problems[peer] = reply.reason or "not ready"
            if time.monotonic() >= deadline:
                raise PeerError(f"node {self.rank}: no peer can give its state: {problems}")
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))

    async def _client_call(self, peer: int, request: pb.HelloRequest, timeout: float) -> pb.HelloReply:
        return await self._greet(peer, request, timeout, wait_for_ready=False)

    def recv_any(self, kind: int, timeout: float) -> list[Message]:
        """Every message of `kind` that arrived, whatever its step and sender, once there is at least
        one (a state transfer: a donor asked earlier may answer late, and its state is mass too)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            messages = self.take(kind, 2 ** 62)
            if messages:
                return messages
            time.sleep(0.02)
        raise TimeoutError(f"node {self.rank}: nothing of kind {kind} within {timeout:.0f}s")

    def survey(self, timeout: float = 2.0) -> "ClusterSurvey":
        """Hello every peer once (without waiting for connections): how many answer, and whether a
        compatible, ready one is past step 0, i.e. this node was restarted into a running cluster
        (at a fresh start no node passes step 0 before every node is ready)."""
        futures = [self._submit(self._client_call(peer, self._hello_request(), timeout))
                   for peer in range(self.world_size) if peer != self.rank]
        reachable, running = 0, False
        for future in futures:
            try:
                reply = future.result(timeout + 5)
            except (grpc.aio.AioRpcError, concurrent.futures.TimeoutError):
                continue
            reachable += 1
            running |= bool(reply.compatible and reply.ready and reply.step > 0)
        return ClusterSurvey(reachable=reachable, running=running)

    def cluster_running(self, timeout: float = 2.0) -> bool:
        return self.survey(timeout).running

    def announce_ready(self) -> None:
        """Tell every peer (one Hello each, failures ignored) that this node is ready again and
        resumes at `resume_step`, so they send to it and wait for it from that step on."""
        futures = [self._submit(self._client_call(peer, self._hello_request(), 2.0))
                   for peer in range(self.world_size) if peer != self.rank]
        for future in futures:
            try:
                future.result(10)
            except (grpc.aio.AioRpcError, concurrent.futures.TimeoutError):
                pass

    def mark_ready(self) -> None:
        """Tell peers (through Hello) and health probes that this node now accepts tensors."""
        self._ready = True
        if self.health is not None:
            self.health.set_serving(True)

    def wait_for_peers(self, timeout: float = 60.0, *, require_ready: bool = False) -> None:
        """Hello every peer, waiting for it to come up (and, with require_ready, to have its
        algorithm set up, so nothing we send is refused as unexpected). Raises PeerError on an
        incompatible peer at once, or on one still unreachable / not ready after `timeout`."""
        deadline = time.monotonic() + timeout
        waiting = {peer for peer in range(self.world_size)
                   if peer != self.rank and not self._relay.table.skip_hello(peer)}  # routed: not greeted
        last_problem: dict[int, str] = {}
        while waiting:
            if require_ready:
                waiting -= self._peers_ready  # a peer that said so in its own Hello may be gone by now
            if not waiting:
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            attempt = min(remaining, 1.0)  # short attempts: notice peers that announce themselves
            futures = {peer: self._submit(self._hello(peer, attempt)) for peer in waiting}
            for peer, future in futures.items():
                try:
                    reply = future.result(attempt + 5)
                except (grpc.aio.AioRpcError, concurrent.futures.TimeoutError) as exc:
                    last_problem[peer] = f"unreachable: {_rpc_reason(exc)}"
                    continue
                reason = reply.reason or self.identity.compatibility(
                    reply.world_size, reply.protocol_version, reply.config_fingerprint)
                if not reply.compatible or reason:
                    raise PeerError(f"node {self.rank}: node {peer} at {self.peers[peer]} incompatible: {reason}")
                if reply.node_id != peer:
                    raise PeerError(f"node {self.rank}: address {self.peers[peer]} answers as node "
                                    f"{reply.node_id}, expected {peer}")
                if require_ready and not reply.ready:
                    last_problem[peer] = "not ready (still setting up)"
                    continue
                self._reached.add(peer)
                self._relay.table.mark_reached(peer)  # a relay candidate from now on
                waiting.discard(peer)
            if waiting:
                time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        if waiting:
            problems = "; ".join(f"node {p} at {self.peers[p]} {last_problem.get(p, 'did not answer')}"
                                 for p in sorted(waiting))
            raise PeerError(f"node {self.rank}: after {timeout:.0f}s: {problems}")


def _new_incarnation() -> int:
    return secrets.randbits(63) | 1  # never 0 (0 = an old peer that sends none)


def _process_gone(exc: BaseException) -> bool:
    """The peer's host refused the connection (nothing listens on the port): its process is gone."""
    return (isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.UNAVAILABLE
            and "connection refused" in (exc.details() or "").lower())


def _rpc_reason(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return type(exc).__name__
