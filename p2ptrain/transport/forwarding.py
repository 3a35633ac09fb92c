"""Relay forwarding: piping a PushTensor stream addressed to another node on to its next hop.

A node that cannot reach peer j directly sends through relay r (paths/router.py): the header says
`receiver = j, route = [r, ...]`. r checks the header, opens a stream to the next hop with route[0]
popped and `via = r`, and pipes the chunks through as they arrive: it holds one chunk at a time, never
the whole tensor. The Ack is end to end (r returns what j answered), so the sender's retries and the
receiver's dedup by (sender, message_id) work unchanged: a message is applied exactly once, whichever
way (and however often) it went. Part of the gRPC path: the server (server.py) calls `forward`.
"""
from __future__ import annotations

import logging

from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.transport.errors import FailureKind, SendFailure
from p2ptrain.transport.faults import EmulatedLinks, LinkUnreachable
from p2ptrain.transport.framing import FramingError, encode_data, encode_header
from p2ptrain.transport.paths.grpc_path import GrpcPath, status_of
from p2ptrain.transport.routes import RELAY_UNREACHABLE
from p2ptrain.transport.validation import Rejection

log = logging.getLogger(__name__)

# A relayed header must not announce more than this: the relay does not buffer, but a bogus size
# would tie up a stream slot on every hop for nothing.
MAX_FORWARD_PAYLOAD_BYTES = 1 << 34
# A next hop that failed this way never had the whole payload: nothing was delivered.
_NEVER_REACHED = (FailureKind.GONE, FailureKind.UNREACHABLE, FailureKind.TIMEOUT)


class Forwarder:
    """Node `rank`'s forwarding of other nodes' streams, through `grpc`; when links are emulated
    (`links`) each forwarded hop pays its link like any send."""

    def __init__(self, rank: int, world_size: int, grpc_path: GrpcPath, *, send_timeout: float,
                 links: EmulatedLinks | None = None, metrics=None,
                 max_payload_bytes: int = MAX_FORWARD_PAYLOAD_BYTES):
        self.rank = rank
        self.world_size = world_size
        self.grpc = grpc_path
        self.links = links
        self.send_timeout = send_timeout
        self.metrics = metrics
        self.max_payload_bytes = max_payload_bytes
        self.buffered_bytes = 0   # chunk bytes read from upstreams and not yet written downstream
        self.high_water_bytes = 0  # the most that ever were (a few chunks: forwarding does not buffer)
        self.forwards = 0          # completed forwards (any end-to-end answer)
        self.in_flight: dict[tuple[int, int], int] = {}  # (sender, message id) -> bytes passed on so far

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
        downstream.via = self.rank  # the hop the next one sees (peer_identity.py checks it under mTLS)
        try:  # the relay's own outgoing link, as emulated; a lost attempt is re-sent (costs time)
            if self.links is not None:
                await self.links.emulate(next_hop, header.payload_bytes, True)
        except LinkUnreachable as exc:
            return self._reject(Rejection(RELAY_UNREACHABLE, f"relay {self.rank} -> {next_hop}: {exc}"))
        timeout = self.send_timeout
        remaining = context.time_remaining()  # never outlive the upstream's deadline
        if remaining is not None:
            timeout = min(timeout, remaining)
        call = self.grpc.client(next_hop).open_push(timeout)
        key = (header.sender, header.message_id)
        self.in_flight[key] = forwarded = 0
        # The message that completes the payload (the header, for an empty one) is held back until the
        # upstream has ended cleanly: a receiver may take a cancelled stream for a finished one, so it
        # must never have the whole payload before the relay knows the upstream was good.
        final: bytes | None = encode_header(downstream) if header.payload_bytes == 0 else None
        held = 0
        complete = False  # the whole payload went downstream: from here on it may be delivered
        try:
            ended = final is None and not await call.write(encode_header(downstream))
            if not ended:
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
                            ended = not await call.write(encode_data(chunk.data))
                        finally:
                            self._hold(-size)
                    forwarded += size
                    self.in_flight[key] = forwarded
                    if ended:  # the next hop answered early (e.g. rejected the header) or failed
                        break
            if not ended:
                if final is not None:
                    complete = True
                    await call.write(final)
                await call.done_writing()
            ack = await call.result()  # what the next hop answered, or how its call failed
        except Rejection as rejection:
            call.cancel()  # the next hop drops its incomplete copy: nothing is delivered
            return self._reject(rejection, forwarded)
        except SendFailure as exc:
            if not complete:  # the next hop never had the whole payload: nothing was delivered
                reason = RELAY_UNREACHABLE if exc.kind in _NEVER_REACHED else "relay_failed"
                return self._reject(Rejection(reason, f"relay {self.rank} -> {next_hop}: {exc}"), forwarded)
            await context.abort(status_of(exc.kind), f"relay {self.rank} -> {next_hop}: {exc.detail}")
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


__all__ = ["Forwarder", "MAX_FORWARD_PAYLOAD_BYTES"]
