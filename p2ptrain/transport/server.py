"""gRPC server side of a node: the Peer service (PushTensor, Hello, Settle), and `serve`, which
starts a grpc.aio server with health and reflection (health.py) for the node and the parameter server.
The service's deliver / refuse / abort are also how the TCP lane (lane.py) answers what it receives,
so both receive paths count, log and acknowledge alike.

A PushTensor stream ends in an Ack (accepted / duplicate / rejected with a reason), except when it
is refused for want of resources (RESOURCE_EXHAUSTED: `too_many_streams`, `buffer_limit`) or cut
for sending nothing within the inbox's stream_idle_timeout (DEADLINE_EXCEEDED: `idle_stream`): those
are gRPC statuses, which a sender retries with the same message id. A call the client cancelled
is never delivered (`aborted_stream`). The service changes the node's state only through the Inbox
and the callbacks it is given; it never sends anything itself.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import grpc

from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.transport.framing import deserialize_chunk
from p2ptrain.transport.health import ServingStatus, add_standard_services
from p2ptrain.transport.inbox import Inbox, Reception
from p2ptrain.transport.security import Security
from p2ptrain.transport.streams import REFUSAL_STATUS, MessageStream, wait_for_cancel
from p2ptrain.transport.validation import Rejection

log = logging.getLogger(__name__)

PROTOCOL_VERSION = "p2ptrain/1"
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Peer"].full_name  # "p2ptrain.v1.Peer"
PUSH_METHOD = f"/{SERVICE_NAME}/PushTensor"
HELLO_METHOD = f"/{SERVICE_NAME}/Hello"
SETTLE_METHOD = f"/{SERVICE_NAME}/Settle"
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
                 incarnation: Callable[[], int] = lambda: 0, lane_port: Callable[[], int] = lambda: 0,
                 view: Callable[[], pb.View | None] = lambda: None):
        self.inbox = inbox
        self.identity = identity
        self.metrics = metrics
        self.current_step = current_step
        self.is_ready = is_ready
        self.on_peer_ready = on_peer_ready
        self.on_hello = on_hello      # membership news; returns why a want_state request is refused
        self.excludes = excludes      # we consider this peer dead: our replies tell it to rejoin
        self.incarnation = incarnation
        self.lane_port = lane_port    # our TCP lane's port, advertised in Hello replies (0: none)
        self.view = view              # our latest membership view, in every reply (views.py)
        self.forwarder = None  # relay.Relay: streams addressed to another node are piped on by it

    async def push_tensor(self, requests, context) -> pb.Ack:
        reception = None
        try:
            stream = MessageStream(requests, self.inbox.stream_idle_timeout)
            header = await stream.header()
            if header is not None:
                if self.forwarder is not None and header.receiver != self.identity.node_id:
                    return await self.forwarder.forward(header, stream.chunks, context)  # relay.py
                reception = self.inbox.open(header)
                await stream.fill(reception)
            await wait_for_cancel(context, reception is not None and reception.complete())
            if reception is None:
                raise Rejection("empty_stream", "stream closed before any header")
            pending, reception = reception, None  # deliver() cleans up itself on failure
            return self.deliver(pending)
        except Rejection as rejection:
            ack = self.refuse(rejection, reception)
            reception = None  # (the frame may outlive the call)
            status = REFUSAL_STATUS.get(rejection.reason)
            if status is not None:
                await context.abort(status, f"{rejection.reason}: {rejection.detail}")
            return ack
        except BaseException:  # cancelled / connection lost mid-stream: nothing half-applied
            if reception is not None:
                self.abort(reception, "aborted_stream")
            raise

    # The answers of every receive path (PushTensor here, the TCP lane in lane.py) ----------------
    def deliver(self, reception: Reception) -> pb.Ack:
        """Deliver a complete reception (Inbox.deliver, which raises Rejection) and acknowledge it."""
        message = self.inbox.deliver(reception)
        if self.metrics is not None:
            self.metrics.on_received(message.sender, reception.received)
        return self._ack(message.sender, status=pb.Ack.STATUS_ACCEPTED, bytes_received=reception.received,
                         message_id=message.message_id)

    def refuse(self, rejection: Rejection, reception: Reception | None = None, sender: int = -1) -> pb.Ack:
        """The Ack that answers `rejection` (DUPLICATE for a delivered id); drops `reception` if one
        was open, counts and logs the refusal. A REFUSAL_STATUS reason is not the message's fault:
        PushTensor answers it with that gRPC status, the lane with this Ack (its client maps it)."""
        received = 0
        if reception is not None:
            sender = reception.header.sender
            self.inbox.abort(reception)
            received = reception.received
        if self.metrics is not None:
            self.metrics.on_rejected(rejection.reason)
        duplicate = rejection.reason == "duplicate"
        if not duplicate:
            log.warning("node %d rejected a message: %s", self.identity.node_id, rejection)
        return self._ack(sender, status=pb.Ack.STATUS_DUPLICATE if duplicate else pb.Ack.STATUS_REJECTED,
                         reason=rejection.reason, detail=rejection.detail, bytes_received=received)

    def abort(self, reception: Reception, reason: str) -> None:
        """Drop a reception whose stream or connection broke off (nobody is left to answer)."""
        self.inbox.abort(reception)
        if self.metrics is not None:
            self.metrics.on_rejected(reason)

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
                             caller_excluded=known and self.excludes(peer), incarnation=self.incarnation(),
                             lane_port=self.lane_port(), view=self.view())

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


async def serve(handler: grpc.GenericRpcHandler, service_name: str, *, listen: str,
                options: list[tuple[str, object]], security: Security, metrics=None,
                serving: bool) -> tuple[grpc.aio.Server, ServingStatus, int]:
    """Start a grpc.aio server on `listen` with `handler`, grpc.health.v1 (SERVING per `serving`) and
    reflection; returns it, its health status and the bound port. Port 0: it could not bind, and
    the server was not started. Call on the loop thread that will own the server."""
    server = grpc.aio.server(options=options, interceptors=security.server_interceptors(metrics))
    server.add_generic_rpc_handlers((handler,))
    health = await add_standard_services(server, service_name, serving=serving)
    port = security.add_port(server, listen)
    if port:
        await server.start()
    return server, health, port


__all__ = ["PeerService", "Identity", "serve", "PROTOCOL_VERSION", "SERVICE_NAME", "PUSH_METHOD", "HELLO_METHOD",
           "SETTLE_METHOD"]
