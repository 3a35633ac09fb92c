"""gRPC server side of a node: the Peer service (PushTensor, Hello) plus server reflection.

A PushTensor stream ends in an Ack (accepted / duplicate / rejected with a reason), except when it
is refused for want of resources (RESOURCE_EXHAUSTED: `too_many_streams`, `buffer_limit`) or cut
for sending nothing within the inbox's stream_idle_timeout (DEADLINE_EXCEEDED: `idle_stream`): those
are gRPC statuses, which a sender retries with the same message id. A call the client cancelled
is never delivered (`aborted_stream`).
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Callable

import grpc

from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.transport.framing import DecodedChunk, FramingError, deserialize_chunk
from p2ptrain.transport.inbox import Inbox, Rejection

log = logging.getLogger(__name__)

PROTOCOL_VERSION = "p2ptrain/1"
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Peer"].full_name  # "p2ptrain.v1.Peer"
PUSH_METHOD = f"/{SERVICE_NAME}/PushTensor"
HELLO_METHOD = f"/{SERVICE_NAME}/Hello"
SETTLE_METHOD = f"/{SERVICE_NAME}/Settle"
# How long a stream that ended short waits for a cancel to show (wait_for_cancel): ~6x the latest cancel seen
# after the end of a stream (3.9 ms in 400 trials on a loaded 2-core host).
CANCEL_GRACE = 0.025
# Rejections answered with a gRPC status rather than an Ack: nothing is wrong with the message, the
# sender may retry it (same id) once streams are reaped or buffers freed.
REFUSAL_STATUS = {"too_many_streams": grpc.StatusCode.RESOURCE_EXHAUSTED,
                  "buffer_limit": grpc.StatusCode.RESOURCE_EXHAUSTED,
                  "idle_stream": grpc.StatusCode.DEADLINE_EXCEEDED}


@dataclass(frozen=True)
class Identity:
    """What a node says about itself in Hello, and checks peers against."""

    node_id: int
    world_size: int
    config_fingerprint: str = ""
    protocol_version: str = PROTOCOL_VERSION

    def compatibility(self, other_world: int, other_protocol: str, other_fingerprint: str) -> str:
        """Empty string when compatible, else the reason."""
        if other_protocol != self.protocol_version:
            return f"protocol {other_protocol!r} != {self.protocol_version!r}"
        if other_world != self.world_size:
            return f"world size {other_world} != {self.world_size}"
        if other_fingerprint and self.config_fingerprint and other_fingerprint != self.config_fingerprint:
            return f"config fingerprint {other_fingerprint} != {self.config_fingerprint}"
        return ""


class PeerService:
    """Receives tensor streams into the Inbox. Any bad input ends in a rejecting Ack; the
    node's state is changed only by a complete, valid message."""

    def __init__(self, inbox: Inbox, identity: Identity, metrics=None,
                 current_step: Callable[[], int] = lambda: 0, is_ready: Callable[[], bool] = lambda: True,
                 on_peer_ready: Callable[[int], None] = lambda node_id: None,
                 on_hello: Callable[[pb.HelloRequest], str] = lambda request: "",
                 excludes: Callable[[int], bool] = lambda node_id: False,
                 incarnation: Callable[[], int] = lambda: 0):
        self.inbox = inbox
        self.identity = identity
        self.metrics = metrics
        self.current_step = current_step
        self.is_ready = is_ready
        self.on_peer_ready = on_peer_ready
        self.on_hello = on_hello      # membership news; returns why a want_state request is refused
        self.excludes = excludes      # we consider this peer dead: our replies tell it to rejoin
        self.incarnation = incarnation
        self.forwarder = None  # relay.Relay: streams addressed to another node are piped on by it

    async def push_tensor(self, requests, context) -> pb.Ack:
        reception = None
        try:
            chunks = idle_limited(requests, self.inbox.stream_idle_timeout)
            async for chunk in chunks:
                if isinstance(chunk, FramingError):
                    raise Rejection("malformed_chunk", str(chunk))
                assert isinstance(chunk, DecodedChunk)
                if reception is None:
                    if chunk.header is None:
                        raise Rejection("missing_header", "the first chunk of a stream must be a header")
                    if self.forwarder is not None and chunk.header.receiver != self.identity.node_id:
                        return await self.forwarder.forward(chunk.header, chunks, context)  # relay.py
                    reception = self.inbox.open(chunk.header)
                elif chunk.header is not None:
                    raise Rejection("unexpected_header", "a second header inside one stream")
                else:
                    reception.write(chunk.data)
                    chunk.data.release()  # copied: let its bytes go (grpc.aio's reader keeps the last message)
                del chunk
            await wait_for_cancel(context, reception is not None and reception.complete())
            if reception is None:
                raise Rejection("empty_stream", "stream closed before any header")
            pending, reception = reception, None  # deliver() cleans up itself on failure
            message = self.inbox.deliver(pending)
            if self.metrics is not None:
                self.metrics.on_received(message.sender, pending.received)
            return self._ack(message.sender, status=pb.Ack.STATUS_ACCEPTED, bytes_received=pending.received,
                             message_id=message.message_id)
        except Rejection as rejection:
            received, sender = 0, -1
            if reception is not None:
                sender = reception.header.sender
                self.inbox.abort(reception)
                received, reception = reception.received, None  # (the frame may outlive the call)
            if self.metrics is not None:
                self.metrics.on_rejected(rejection.reason)
            duplicate = rejection.reason == "duplicate"
            if not duplicate:
                log.warning("node %d rejected a message: %s", self.identity.node_id, rejection)
            status = REFUSAL_STATUS.get(rejection.reason)
            if status is not None:
                await context.abort(status, f"{rejection.reason}: {rejection.detail}")
            return self._ack(sender, status=pb.Ack.STATUS_DUPLICATE if duplicate else pb.Ack.STATUS_REJECTED,
                             reason=rejection.reason, detail=rejection.detail, bytes_received=received)
        except BaseException:  # cancelled / connection lost mid-stream: nothing half-applied
            if reception is not None:
                self.inbox.abort(reception)
                if self.metrics is not None:
                    self.metrics.on_rejected("aborted_stream")
            raise

    def _ack(self, sender: int, **fields) -> pb.Ack:
        """Every Ack tells the sender our step, and whether we consider it dead (it must rejoin)."""
        return pb.Ack(step=self.current_step(), sender_excluded=sender >= 0 and self.excludes(sender), **fields)

    async def hello(self, request: pb.HelloRequest, context) -> pb.HelloReply:
        me = self.identity
        reason = me.compatibility(request.world_size, request.protocol_version, request.config_fingerprint)
        ready = self.is_ready()
        peer = request.node_id
        known = not reason and 0 <= peer < me.world_size and peer != me.node_id
        if known and ready and request.ready:
            # Both sides learn from this one exchange that the other is ready: the caller need not
            # be asked again (it may finish its run and leave before we would ask).
            self.on_peer_ready(peer)
        if known:
            reason = self.on_hello(request)  # membership news; a refused want_state says why
        return pb.HelloReply(node_id=me.node_id, world_size=me.world_size,
                             protocol_version=me.protocol_version,
                             config_fingerprint=me.config_fingerprint, step=self.current_step(),
                             compatible=not reason or known, reason=reason, ready=ready,
                             caller_excluded=known and self.excludes(peer), incarnation=self.incarnation())

    async def settle(self, request: pb.SettleRequest, context) -> pb.SettleReply:
        """Which of these messages from `request.sender` did we deliver? The others are voided."""
        if not 0 <= request.sender < self.identity.world_size or request.sender == self.identity.node_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"sender {request.sender} is not a peer")
        if len(request.message_ids) > 4096:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "at most 4096 message ids per Settle")
        delivered = self.inbox.settle(request.sender, list(request.message_ids))
        return pb.SettleReply(delivered=delivered, incarnation=self.incarnation())

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(SERVICE_NAME, {
            "PushTensor": grpc.stream_unary_rpc_method_handler(
                self.push_tensor, request_deserializer=deserialize_chunk,
                response_serializer=pb.Ack.SerializeToString),
            "Hello": grpc.unary_unary_rpc_method_handler(
                self.hello, request_deserializer=pb.HelloRequest.FromString,
                response_serializer=pb.HelloReply.SerializeToString),
            "Settle": grpc.unary_unary_rpc_method_handler(
                self.settle, request_deserializer=pb.SettleRequest.FromString,
                response_serializer=pb.SettleReply.SerializeToString),
        })


async def idle_limited(requests, timeout: float):
    """The chunks of a request stream; Rejection `idle_stream` once the consumer waited `timeout`
    seconds for the next one (a half-open stream must not hold its slot and buffer for ever; time
    spent by the consumer itself, e.g. a relay waiting on its next hop, does not count). Holds no
    chunk while it waits: an idle stream must not pin its last chunk's bytes too."""
    iterator = aiter(requests)
    watch = _IdleWatch(timeout)
    try:
        while True:
            watch.waiting = True
            try:
                chunk = await anext(iterator)
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                if not watch.expired:
                    raise
                watch.forgive()
                raise Rejection("idle_stream", f"no chunk for {timeout:g} s") from None
            finally:
                watch.waiting = False
            watch.touch()
            yield chunk
            del chunk
    finally:
        watch.close()


class _IdleWatch:
    """Cancels the current task once it has been waiting (`waiting` set) for `timeout` seconds
    since the last touch(). One timer per stream, re-armed only when it fires: cheaper per chunk
    than a timed wait per read (that cost 0.3 ms per small message), and unlike wait_for on
    Python < 3.12 it never swallows a client's cancel landing as a read completes."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.waiting = False
        self.expired = False
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self._last = self._loop.time()
        self._timer = self._loop.call_at(self._last + timeout, self._check)

    def touch(self) -> None:
        self._last = self._loop.time()

    def _check(self) -> None:
        due = self._last + self.timeout
        if not self.waiting or self._loop.time() < due:
            self._timer = self._loop.call_at(max(due, self._loop.time() + 0.001), self._check)
            return
        self.expired = True
        self._task.cancel()

    def forgive(self) -> None:
        """Take back our cancel (Python >= 3.11 counts them), so the task may go on to answer."""
        uncancel = getattr(self._task, "uncancel", None)
        if uncancel is not None:
            uncancel()

    def close(self) -> None:
        self._timer.cancel()


async def wait_for_cancel(context, complete: bool) -> None:
    """Let a cancel show before a request stream that ended is delivered (or reported truncated).

    grpc.aio ends the request iterator alike for a half-close and for a cancel (client gone,
    connection lost); the cancel reaches the handler's task separately, as a CancelledError, mostly
    within the same loop iteration, in ~8% of cases some milliseconds later (up to 3.9 ms on a loaded
    host). So: a call past its deadline is refused (`aborted_stream`); a complete message waits one
    loop iteration (no cost on the hot path); an incomplete one, an error path anyway, waits
    CANCEL_GRACE. A cancel later than that is missed: an incomplete message then counts as
    `truncated`, a complete one is delivered, harmless for a sender that retries the same id (its
    retry is answered DUPLICATE)."""
    if context.time_remaining() == 0:
        raise Rejection("aborted_stream", "the caller's deadline passed before its stream ended")
    await asyncio.sleep(0 if complete else CANCEL_GRACE)


def enable_reflection(server: grpc.aio.Server) -> None:
    """Let grpcurl & co list and describe the services."""
    from grpc_reflection.v1alpha import reflection

    reflection.enable_server_reflection((SERVICE_NAME, reflection.SERVICE_NAME), server)


__all__ = ["PeerService", "Identity", "PROTOCOL_VERSION", "SERVICE_NAME", "PUSH_METHOD", "HELLO_METHOD",
           "SETTLE_METHOD", "CANCEL_GRACE", "REFUSAL_STATUS", "enable_reflection", "idle_limited",
           "wait_for_cancel"]
