"""Relay forwarding: reaching a peer that this node cannot connect to directly through other peers.

A node behind NAT / a firewall / a partition (declared in the config, emulated with a ``block``
link, or found out by a failed connect) sends a tensor to peer j through relay r by setting
``TensorHeader.receiver = j, route = [r, ...]`` and pushing the stream to r. r checks the header,
opens a stream to the next hop with ``route[0]`` popped, and pipes the chunks through as they
arrive: it holds one chunk at a time, never the whole tensor. The Ack is end to end (r returns
what j answered), so the sender's retry logic and the receiver's dedup by (sender, message_id)
work unchanged: a message is applied exactly once, whichever way (and however often) it went.

Used on the node's event-loop thread, with the RouteTable of routes.py (which way to each peer):
  Relay.push  the sending side: direct, or relayed, with fallback to a relay on an unreachable peer
  Relay.forward  the relaying side, called by PeerService for streams addressed to another node

A relay never holds a whole tensor, and knows the node only through the ChannelPool, DirectPath and
EmulatedLinks it is given (never the Transport). Direct hops take the peer's TCP lane where the data
plane says so (dataplane.py); relayed hops and forwarding always use PushTensor streams.
"""
from __future__ import annotations

import asyncio
import logging

import grpc

from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.settings.parsers import parse_relay_routes, parse_relays
from p2ptrain.transport.client import ChannelPool
from p2ptrain.transport.dataplane import DirectPath
from p2ptrain.transport.errors import rpc_reason
from p2ptrain.transport.faults import EmulatedLinks, LinkUnreachable
from p2ptrain.transport.framing import FramingError, encode_data, encode_header
from p2ptrain.transport.options import TransportOptions
from p2ptrain.transport.routes import RouteTable
from p2ptrain.transport.validation import Rejection

log = logging.getLogger(__name__)

# Ack.reason of a relay that could not reach its next hop: nothing was delivered, so the sender
# may try another relay (same message id) or, having none, treat it as a definite refusal.
RELAY_UNREACHABLE = "relay_unreachable"
# A relayed header must not announce more than this: the relay does not buffer, but a bogus size
# would tie up a stream slot on every hop for nothing.
MAX_FORWARD_PAYLOAD_BYTES = 1 << 34


class Relay:
    """Route choice of one node's sends, and forwarding of other nodes' streams. It reaches peers
    only through `channels` (ChannelPool.client) and, when links are emulated, waits on `links`
    (EmulatedLinks.emulate): a relayed hop pays the emulated link like any send."""

    def __init__(self, rank: int, world_size: int, options: TransportOptions, channels: ChannelPool,
                 links: EmulatedLinks | None = None, *, metrics=None,
                 max_payload_bytes: int = MAX_FORWARD_PAYLOAD_BYTES, direct: DirectPath | None = None):
        self.rank = rank
        self.world_size = world_size
        self.channels = channels
        self.direct = direct  # direct hops: the peer's TCP lane or gRPC (dataplane.py); None: gRPC
        self.links = links
        self.send_timeout = options.send_timeout
        self.metrics = metrics
        self.table = RouteTable(
            rank, world_size, parse_relay_routes(options.relay_routes, world_size),
            parse_relays(options.relays, world_size), retry_after=options.relay_retry_after,
            blocked=links.blocked if links is not None else (lambda peer: False))
        self.max_payload_bytes = max_payload_bytes
        self.buffered_bytes = 0   # chunk bytes read from upstreams and not yet written downstream
        self.high_water_bytes = 0  # the most that ever were (a few chunks: forwarding does not buffer)
        self.forwards = 0          # completed forwards (any end-to-end answer)
        self.in_flight: dict[tuple[int, int], int] = {}  # (sender, message id) -> bytes passed on so far

    # Sending side ---------------------------------------------------------------------------------
    async def push(self, peer: int, header: pb.TensorHeader, payload: memoryview, reliable: bool,
                   timeout: float, wait_for_ready: bool = True) -> pb.Ack:
        """Deliver header + payload to `peer`, directly or relayed; the same header (message id)
        on every attempt, so a copy that did arrive is answered DUPLICATE, never applied twice.
        Raises LinkUnreachable / grpc.aio.AioRpcError when no way worked."""
        table = self.table
        declared = table.declared(peer)
        if declared is not None:
            return await self._hop(declared, peer, header, payload, reliable, timeout, wait_for_ready)
        error: BaseException | None = None
        if table.direct_ok(peer):
            # Detecting unreachable peers: fail fast on a refused connect when a relay is there to try.
            fast = table.detect and bool(table.candidates(peer))
            try:
                ack = await self._hop((), peer, header, payload, reliable, timeout, wait_for_ready and not fast)
                table.mark_reached(peer)
                return ack
            except LinkUnreachable as exc:
                error = exc
            except grpc.aio.AioRpcError as exc:
                if not (fast and exc.code() == grpc.StatusCode.UNAVAILABLE):
                    raise
                error = exc
            table.mark_unreachable(peer)
            log.info("node %d: peer %d unreachable directly (%s); relaying for %.0fs", self.rank, peer,
                     rpc_reason(error), table.retry_after)
        candidates = table.candidates(peer)
        if error is None and not candidates:  # down earlier, no relay now: maybe the link healed
            ack = await self._hop((), peer, header, payload, reliable, timeout, wait_for_ready)
            table.mark_reached(peer)
            return ack
        for i, via in enumerate(candidates):
            last = i == len(candidates) - 1
            try:
                ack = await self._hop((via,), peer, header, payload, reliable, timeout,
                                      wait_for_ready and (last or not table.detect))
            except LinkUnreachable as exc:
                table.mark_unreachable(via)
                error = exc
                continue
            except grpc.aio.AioRpcError as exc:
                if last or exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                table.mark_unreachable(via)
                error = exc
                continue
            if ack.status == pb.Ack.STATUS_REJECTED and ack.reason == RELAY_UNREACHABLE and not last:
                continue  # this relay cannot reach the peer either: nothing delivered, try the next
            table.remember_via(peer, via)
            return ack
        raise error if error is not None else LinkUnreachable(f"node {self.rank}: no relay to reach {peer}")

    async def _hop(self, route: tuple[int, ...], peer: int, header: pb.TensorHeader, payload: memoryview,
                   reliable: bool, timeout: float, wait_for_ready: bool) -> pb.Ack:
        del header.route[:]
        header.route.extend(route)
        hop = route[0] if route else peer
        if self.links is not None:  # before either data plane: the emulated link applies to both
            await self.links.emulate(hop, len(payload), reliable)
        if not route and self.direct is not None:
            return await self.direct.push(hop, header, payload, timeout, wait_for_ready)
        return await self.channels.client(hop).push(header, payload, timeout, wait_for_ready=wait_for_ready)

    # Relaying side --------------------------------------------------------------------------------
    def check(self, header: pb.TensorHeader) -> int:
        """Validate a header addressed to another node; returns the next hop or raises Rejection."""
        me, world = self.rank, self.world_size
        if not 0 <= header.sender < world or header.sender == me:
            raise Rejection("unknown_sender", f"relay {me}: sender {header.sender} is not a peer (world size {world})")
        if not 0 <= header.receiver < world or header.receiver == header.sender:
            raise Rejection("unknown_receiver", f"relay {me}: receiver {header.receiver} is not a peer of "
                                                f"sender {header.sender} (world size {world})")
        route = list(header.route)
        if not route or route[0] != me:
            raise Rejection("wrong_receiver", f"message for node {header.receiver} reached node {me}, "
                                              f"which is not its next relay (route {route})")
        if len(route) > world or not all(0 <= r < world for r in route):
            raise Rejection("bad_route", f"route {route} names ranks outside 0..{world - 1} or is too long")
        if len(set(route)) != len(route) or header.sender in route or header.receiver in route:
            raise Rejection("bad_route", f"route {route} from {header.sender} to {header.receiver} has a loop")
        if header.payload_bytes > self.max_payload_bytes:
            raise Rejection("bad_size", f"relay {me}: {header.payload_bytes} payload bytes exceed the "
                                        f"{self.max_payload_bytes} a relay forwards")
        return route[1] if len(route) > 1 else header.receiver

    async def forward(self, header: pb.TensorHeader, requests, context) -> pb.Ack:
        """Pipe the rest of an incoming stream (`requests`, after its header) on to the next hop and
        return the next hop's Ack. Bad input and an unreachable next hop end in a rejecting Ack;
        a failure once the whole payload went downstream aborts the call with that failure's code
        (the message may have been delivered: the sender retries, the receiver dedups)."""
        try:
            next_hop = self.check(header)
        except Rejection as rejection:
            return self._reject(rejection)
        downstream = pb.TensorHeader()
        downstream.CopyFrom(header)
        del downstream.route[0]
        try:  # the relay's own outgoing link, as emulated; a lost attempt is re-sent (costs time)
            if self.links is not None:
                await self.links.emulate(next_hop, header.payload_bytes, True)
        except LinkUnreachable as exc:
            return self._reject(Rejection(RELAY_UNREACHABLE, f"relay {self.rank} -> {next_hop}: {exc}"))
        timeout = self.send_timeout
        remaining = context.time_remaining()  # never outlive the upstream's deadline
        if remaining is not None:
            timeout = min(timeout, remaining)
        call = self.channels.client(next_hop).open_push(timeout)
        key = (header.sender, header.message_id)
        self.in_flight[key] = forwarded = 0
        # The message that completes the payload (the header, for an empty one) is held back until the
        # upstream has ended cleanly: a receiver may take a cancelled stream for a finished one, so it
        # must never have the whole payload before the relay knows the upstream was good.
        final: bytes | None = encode_header(downstream) if header.payload_bytes == 0 else None
        held = 0
        complete = False  # the whole payload went downstream: from here on it may be delivered
        try:
            try:
                if final is None:
                    await call.write(encode_header(downstream))
                async for chunk in requests:
                    if isinstance(chunk, FramingError):
                        raise Rejection("malformed_chunk", str(chunk))
                    if chunk.header is not None:
                        raise Rejection("unexpected_header", "a second header inside one stream")
                    size = len(chunk.data)
                    if final is not None or forwarded + size > header.payload_bytes:
                        raise Rejection("payload_overflow", f"stream carries more than the announced "
                                                            f"{header.payload_bytes} bytes")
                    self._hold(size)
                    if forwarded + size == header.payload_bytes:
                        final, held = encode_data(chunk.data), size
                    else:
                        try:
                            await call.write(encode_data(chunk.data))
                        finally:
                            self._hold(-size)
                    forwarded += size
                    self.in_flight[key] = forwarded
                if final is not None:
                    complete = True
                    await call.write(final)
                await call.done_writing()
            except (asyncio.InvalidStateError, grpc.aio.AioRpcError):
                pass  # the next hop answered early (e.g. rejected the header) or failed: `await call` says
            ack = await call
        except Rejection as rejection:
            call.cancel()  # the next hop drops its incomplete copy: nothing is delivered
            return self._reject(rejection, forwarded)
        except grpc.aio.AioRpcError as exc:
            if not complete:  # the next hop never had the whole payload: nothing was delivered
                reason = RELAY_UNREACHABLE if exc.code() in (grpc.StatusCode.UNAVAILABLE,
                                                             grpc.StatusCode.DEADLINE_EXCEEDED) else "relay_failed"
                return self._reject(Rejection(reason, f"relay {self.rank} -> {next_hop}: {rpc_reason(exc)}"),
                                    forwarded)
            await context.abort(exc.code(), f"relay {self.rank} -> {next_hop}: {exc.details()}")
        except BaseException:  # the upstream went away (cancelled): so does the downstream copy
            call.cancel()
            raise
        finally:
            self.in_flight.pop(key, None)
            self._hold(-held)
        self.forwards += 1
        if ack.status == pb.Ack.STATUS_ACCEPTED and self.metrics is not None:
            self.metrics.on_forwarded(next_hop, forwarded)
        return ack

    def _hold(self, nbytes: int) -> None:
        self.buffered_bytes += nbytes
        self.high_water_bytes = max(self.high_water_bytes, self.buffered_bytes)

    def _reject(self, rejection: Rejection, received: int = 0) -> pb.Ack:
        if self.metrics is not None:
            self.metrics.on_rejected(rejection.reason)
        log.warning("relay %d refused to forward a message: %s", self.rank, rejection)
        return pb.Ack(status=pb.Ack.STATUS_REJECTED, reason=rejection.reason, detail=rejection.detail,
                      bytes_received=received)


# RouteTable is imported from here too (tests/test_relay.py).
__all__ = ["Relay", "RouteTable", "RELAY_UNREACHABLE",
           "MAX_FORWARD_PAYLOAD_BYTES"]
