"""The Transport of one node: an event-loop thread owning the gRPC server, client pool and inbox.

grpc.aio objects are not thread-safe, so every one of them is created and used on this single
thread (uvloop when available). The training thread talks to it only through the blocking /
future-returning methods below, which hop onto the loop with run_coroutine_threadsafe.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import secrets
import threading
import time
from dataclasses import dataclass

import grpc
import torch

from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.transport.client import PeerClient
from p2ptrain.transport.faults import LinkEmulator, LinkTable, MessageDropped
from p2ptrain.transport.framing import DEFAULT_CHUNK_BYTES, check_chunk_bytes, tensor_bytes, wire_dtype
from p2ptrain.transport.inbox import Inbox, Message
from p2ptrain.transport.server import Identity, PeerService, enable_reflection
from p2ptrain.transport.tuning import tune_process_for_transfer

log = logging.getLogger(__name__)


class PeerError(RuntimeError):
    """A peer is unreachable or incompatible."""


@dataclass(frozen=True)
class TransportOptions:
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    send_timeout: float = 120.0        # one tensor push, including waiting for the peer to come up
    keepalive_ms: int = 20_000
    step_window: int = 64              # accept messages whose step is within ± this of ours
    shutdown_grace: float = 2.0
    pin_memory: bool = False           # receive buffers in pinned memory (CUDA training)
    links: LinkTable | None = None     # WAN emulation of outgoing links (faults.py); None = off

    def channel_options(self) -> list[tuple[str, object]]:
        limit = self.chunk_bytes + (1 << 20)  # a data chunk plus framing; headers are tiny
        return [
            ("grpc.max_send_message_length", limit),
            ("grpc.max_receive_message_length", limit),
            ("grpc.keepalive_time_ms", self.keepalive_ms),
            ("grpc.keepalive_timeout_ms", max(1000, self.keepalive_ms // 2)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
        ]  # flow-control / frame-size knobs measured no better (p2ptrain.bench.grpc_study)

    def server_options(self) -> list[tuple[str, object]]:
        return self.channel_options() + [
            ("grpc.http2.min_ping_interval_without_data_ms", max(1000, self.keepalive_ms // 2)),
            ("grpc.so_reuseport", 0),
        ]


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # Windows, or uvloop not installed: the default loop works too
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


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
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: grpc.aio.Server | None = None
        self._clients: dict[int, PeerClient] = {}
        self._ids = itertools.count((secrets.randbits(31) << 32) | 1)  # unique across restarts
        self._step = 0
        self._ready = False
        self._peers_ready: set[int] = set()  # peers that told us (in their Hello) they are ready
        links = self.options.links
        self._links = links if links is not None and not links.is_noop else None  # None: no emulation cost
        self._emulators: dict[int, LinkEmulator | None] = {}  # per peer, made on the loop thread
        self._emulating: set[asyncio.Task] = set()  # sends waiting in link emulation, cancelled by stop()

    # Lifecycle ------------------------------------------------------------------------------
    def start(self, timeout: float = 30.0) -> "Transport":
        tune_process_for_transfer()
        ready: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(ready,), name=f"p2ptrain-comm-{self.rank}",
                                        daemon=True)
        self._thread.start()
        ready.result(timeout)  # re-raises a bind failure in the caller's thread
        return self

    def _run(self, ready: concurrent.futures.Future) -> None:
        loop = self._loop = _new_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._start_server())
        except BaseException as exc:  # noqa: BLE001 - hand any start-up failure to start()
            ready.set_exception(exc)
            loop.close()
            return
        ready.set_result(None)
        try:
            loop.run_forever()
        finally:
            loop.close()

    async def _start_server(self) -> None:
        server = grpc.aio.server(options=self.options.server_options())
        service = PeerService(self.inbox, self.identity, self.metrics, current_step=lambda: self._step,
                              is_ready=lambda: self._ready, on_peer_ready=self._peers_ready.add)
        server.add_generic_rpc_handlers((service.handler(),))
        enable_reflection(server)
        port = server.add_insecure_port(self.listen)
        if port == 0:
            raise PeerError(f"node {self.rank} could not listen on {self.listen}")
        await server.start()
        self._server, self.port = server, port

    def stop(self) -> None:
        """Graceful: in-flight RPCs get `shutdown_grace` seconds, then channels close."""
        loop = self._loop
        if loop is None or not loop.is_running():
            return

        async def shutdown() -> None:
            if self._server is not None:
                await self._server.stop(self.options.shutdown_grace)
            for client in self._clients.values():
                await client.close()
            for task in self._emulating:  # else they would die pending with the loop, their futures never done
                task.cancel()

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), loop).result(self.options.shutdown_grace + 10)
        except Exception as exc:  # noqa: BLE001 - shutting down anyway
            log.warning("node %d: unclean transport shutdown: %s", self.rank, exc)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(10)

    def __enter__(self) -> "Transport":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # Bridge helpers ---------------------------------------------------------------------------
    def _submit(self, coro) -> concurrent.futures.Future:
        if self._loop is None:
            coro.close()
            raise RuntimeError("transport not started")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _client(self, peer: int) -> PeerClient:
        client = self._clients.get(peer)
        if client is None:
            client = self._clients[peer] = PeerClient(self.peers[peer], self.options.channel_options(),
                                                      self.options.chunk_bytes)
        return client

    # Sending ----------------------------------------------------------------------------------
    def send(self, peer: int, tensor: torch.Tensor, *, kind: int, step: int, ps_weight: float = 0.0,
             relay_count: float = 0.0, channel: str = "", codec: int = pb.CODEC_NONE,
             codec_params: tuple[float, ...] = (), dtype: torch.dtype | None = None,
             numel: int | None = None, shape: tuple[int, ...] | None = None,
             reliable: bool = False) -> concurrent.futures.Future:
        """Push `tensor` (CPU; ownership passes to the transport until the future is done).

        Returns a future of the peer's Ack. For codec payloads `tensor` holds the encoded bytes and
        dtype / numel / shape describe the decoded tensor. Under link emulation (options.links) a
        lost message fails the future with MessageDropped, unless `reliable`: then it is sent again
        (paying the link's bandwidth and latency again, like a retransmission) until it arrives.
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
        return self._submit(self._send(peer, header, payload, tensor, reliable))

    async def _send(self, peer: int, header: pb.TensorHeader, payload: memoryview, keepalive,
                    reliable: bool = False) -> pb.Ack:
        if self._links is not None:
            await self._emulate_link(peer, len(payload), reliable)
        try:
            ack = await self._client(peer).push(header, payload, self.options.send_timeout)
        except grpc.aio.AioRpcError:
            if self.metrics is not None:
                self.metrics.on_send_error(peer)
            raise
        if self.metrics is not None:
            if ack.status == pb.Ack.STATUS_ACCEPTED:
                self.metrics.on_sent(peer, len(payload))
            elif ack.status == pb.Ack.STATUS_REJECTED:
                self.metrics.on_refused_send(peer)
        del keepalive  # the tensor behind `payload` may be freed now
        return ack

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
        if self._loop is None:
            self.inbox.expect(kind, dtype, numel, **kwargs)
        else:
            self._submit(self._call(self.inbox.expect, kind, dtype, numel, **kwargs)).result()

    @staticmethod
    async def _call(fn, *args, **kwargs):
        return fn(*args, **kwargs)

    def set_step(self, step: int) -> None:
        """The node's current step: the centre of the accepted step window."""
        self._step = step
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.inbox.set_step, step)

    def recv(self, kind: int, step: int, senders: list[int], *, timeout: float | None = None,
             channel: str = "") -> dict[int, Message]:
        """Block until each sender's step-`step` message of `kind` arrived; raises TimeoutError."""
        if not senders:
            return {}
        future = self._submit(self.inbox.wait_for(kind, step, list(senders), channel, timeout))
        return future.result()

    def take(self, kind: int, max_step: int, channel: str = "") -> list[Message]:
        """Messages of `kind` with step <= max_step that already arrived (non-blocking)."""
        return self._submit(self._call(self.inbox.take, kind, max_step, channel)).result()

    # Membership -------------------------------------------------------------------------------
    def _hello_request(self) -> pb.HelloRequest:
        me = self.identity
        return pb.HelloRequest(node_id=me.node_id, world_size=me.world_size, ready=self._ready,
                               protocol_version=me.protocol_version, config_fingerprint=me.config_fingerprint)

    async def _hello(self, peer: int, timeout: float) -> pb.HelloReply:
        return await self._client(peer).hello(self._hello_request(), timeout)  # client made on the loop

    def hello(self, peer: int, timeout: float = 10.0) -> pb.HelloReply:
        return self._submit(self._hello(peer, timeout)).result(timeout + 5)

    def mark_ready(self) -> None:
        """Tell peers (through Hello) that this node now accepts tensors."""
        self._ready = True

    def wait_for_peers(self, timeout: float = 60.0, *, require_ready: bool = False) -> None:
        """Hello every peer, waiting for it to come up (and, with require_ready, to have its
        algorithm set up, so nothing we send is refused as unexpected). Raises PeerError on an
        incompatible peer at once, or on one still unreachable / not ready after `timeout`."""
        deadline = time.monotonic() + timeout
        waiting = {peer for peer in range(self.world_size) if peer != self.rank}
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
                waiting.discard(peer)
            if waiting:
                time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        if waiting:
            problems = "; ".join(f"node {p} at {self.peers[p]} {last_problem.get(p, 'did not answer')}"
                                 for p in sorted(waiting))
            raise PeerError(f"node {self.rank}: after {timeout:.0f}s: {problems}")


def _rpc_reason(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return type(exc).__name__
