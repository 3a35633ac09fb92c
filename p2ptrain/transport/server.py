"""The gRPC server side of a node: the Peer service (PushTensor, Hello, Settle), and `serve`, which
starts a grpc.aio server with health and reflection (health.py) for the node and the parameter server.

A PushTensor stream ends in an Ack (accepted / duplicate / rejected with a reason: reception.py),
except when it is refused for want of resources or cut for sending nothing within the inbox's
stream_idle_timeout (RETRY_LATER): those get a gRPC status, which a sender retries with the same
message id. A call the client cancelled is never delivered (`aborted_stream`). Streams addressed to
another node go to the forwarder. The service changes the node's state only through the Inbox and
its collaborators; it never sends anything itself.
"""
from __future__ import annotations

import logging

import grpc

from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.transport.framing import deserialize_chunk
from p2ptrain.transport.grpc_wakeups import never_block_the_poller
from p2ptrain.transport.health import ServingStatus, add_standard_services
from p2ptrain.transport.membership.identity import PROTOCOL_VERSION
from p2ptrain.transport.paths.grpc_path import DIAL_BACK_METHOD, HELLO_METHOD, PUSH_METHOD, SERVICE_NAME, SETTLE_METHOD
from p2ptrain.transport.paths.reverse import serve_reverse
from p2ptrain.transport.peer_identity import IDENTITY, IdentityCheck, drain
from p2ptrain.transport.reachability import observed_host
from p2ptrain.transport.reception import Answers
from p2ptrain.transport.security import Security
from p2ptrain.transport.streams import REFUSAL_STATUS, MessageStream, wait_for_cancel
from p2ptrain.transport.validation import Rejection

log = logging.getLogger(__name__)

MAX_SETTLE_IDS = 4096


class PeerService:
    """Node `answers.rank`'s Peer service: tensor streams into the Inbox through `answers` (or on
    through `forwarder`, a forwarding.Forwarder), Hellos answered by `greetings` (membership), and
    Settle questions answered from the Inbox. Any bad input ends in a rejecting Ack; the node's state
    is changed only by a complete, valid message. With `identity` (peer_identity.py) a call whose
    claimed sender its client certificate does not name is refused with PERMISSION_DENIED first."""

    def __init__(self, answers: Answers, greetings, world_size: int, forwarder=None,
                 identity: IdentityCheck | None = None, dial_back=None, reverse_clients: dict | None = None,
                 chunk_bytes: int = 0):
        self.answers = answers
        self.inbox = answers.inbox
        self.greetings = greetings
        self.world_size = world_size
        self.forwarder = forwarder
        self.identity = identity
        self.dial_back = dial_back  # reachability.DialBack (None: DialBack is not offered)
        self.reverse_clients = reverse_clients  # GrpcPath.reverse_clients (None: no Reverse streams taken)
        self.chunk_bytes = chunk_bytes

    async def push_tensor(self, requests, context) -> pb.Ack:
        reception = None
        try:
            stream = MessageStream(requests, self.inbox.stream_idle_timeout)
            header = await stream.header()
            if header is not None:
                if self.identity is not None:
                    await self._deny(context, self.identity.header_problem(self.identity.grpc_peer(context), header),
                                     stream.chunks)
                if self.forwarder is not None and header.receiver != self.answers.rank:
                    return await self.forwarder.forward(header, stream.chunks, context)
                reception = self.inbox.open(header)
                await stream.fill(reception)
            await wait_for_cancel(context, reception is not None and reception.complete())
            if reception is None:
                raise Rejection("empty_stream", "stream closed before any header")
            pending, reception = reception, None  # deliver() cleans up itself on failure
            return self.answers.deliver(pending)
        except Rejection as rejection:
            ack = self.answers.refuse(rejection, reception)
            reception = None  # (the frame may outlive the call)
            status = REFUSAL_STATUS.get(rejection.reason)
            if status is not None:
                await context.abort(status, f"{rejection.reason}: {rejection.detail}")
            return ack
        except BaseException:  # cancelled / connection lost mid-stream: nothing half-applied
            if reception is not None:
                self.answers.abort(reception, "aborted_stream")
            raise

    async def hello(self, request: pb.HelloRequest, context) -> pb.HelloReply:
        if self.identity is not None:
            await self._deny(context, self.identity.claim_problem(self.identity.grpc_peer(context), request.node_id,
                                                                  "a Hello"))
        reply = self.greetings.answer(request, observed_host(context.peer()))
        if request.HasField("probe_for") and reply.compatible and not reply.reason:
            reply.probed = await self.greetings.probe_for(request.node_id, request.probe_for)
        return reply

    async def settle(self, request: pb.SettleRequest, context) -> pb.SettleReply:
        """Which of these messages from `request.sender` did we deliver? The others are voided."""
        if self.identity is not None:
            await self._deny(context, self.identity.claim_problem(self.identity.grpc_peer(context), request.sender,
                                                                  "a Settle"))
        if not 0 <= request.sender < self.world_size or request.sender == self.answers.rank:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"sender {request.sender} is not a peer")
        if len(request.message_ids) > MAX_SETTLE_IDS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"at most {MAX_SETTLE_IDS} message ids per Settle")
        delivered = self.inbox.settle(request.sender, list(request.message_ids))
        return pb.SettleReply(delivered=delivered, incarnation=self.greetings.incarnation)

    async def dial_back_call(self, request: pb.DialBackRequest, context) -> pb.DialBackReply:
        """Dial the caller back at the address this node holds for it (reachability.py)."""
        if self.identity is not None:
            await self._deny(context, self.identity.claim_problem(self.identity.grpc_peer(context), request.node_id,
                                                                  "a DialBack"))
        if self.dial_back is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this node does not dial back")
        reply = await self.dial_back.answer(request, observed_host(context.peer()))
        if reply is None:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"node {request.node_id} was just dialled back")
        return reply

    async def reverse(self, requests, context):
        """A private peer's stream, down which this node makes its calls to it (reverse.py)."""
        if self.reverse_clients is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this node takes no reverse streams")

        def claim_problem(node_id: int) -> str | None:
            if self.identity is None:
                return None
            problem = self.identity.claim_problem(self.identity.grpc_peer(context), node_id, "a Reverse stream")
            if problem:
                self.answers.count_refusal(IDENTITY)
            return problem

        async for frame in serve_reverse(requests, context, rank=self.answers.rank, world_size=self.world_size,
                                         chunk_bytes=self.chunk_bytes, clients=self.reverse_clients,
                                         claim_problem=claim_problem):
            yield frame

    async def _deny(self, context, problem: str | None, rest=None) -> None:
        """Refuse the call (PERMISSION_DENIED, counted as `identity`) if its claim is not backed;
        `rest`: what is left of a client stream, read first so that the caller sees the refusal."""
        if problem is None:
            return
        self.answers.count_refusal(IDENTITY)
        if rest is not None:
            await drain(rest)
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{IDENTITY}: {problem}")

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
            "DialBack": grpc.unary_unary_rpc_method_handler(
                self.dial_back_call, request_deserializer=pb.DialBackRequest.FromString,
                response_serializer=pb.DialBackReply.SerializeToString),
            "Reverse": grpc.stream_stream_rpc_method_handler(
                self.reverse, request_deserializer=pb.ReverseUp.FromString,
                response_serializer=pb.ReverseDown.SerializeToString),
        })


async def serve(handler: grpc.GenericRpcHandler, service_name: str, *, listen: str,
                options: list[tuple[str, object]], security: Security, metrics=None,
                serving: bool, name: str) -> tuple[grpc.aio.Server, ServingStatus, int]:
    """Start a grpc.aio server on `listen` with `handler`, grpc.health.v1 (SERVING per `serving`) and
    reflection; returns it, its health status and the bound port. Port 0: it could not bind, and
    the server was not started. `name`: the server's name in callers' auth proofs (rank, "ps").
    Call on the loop thread that will own the server."""
    server = grpc.aio.server(options=options, interceptors=security.server_interceptors(metrics, name))
    never_block_the_poller()  # (grpc.aio is in use now: grpc_wakeups.py)
    server.add_generic_rpc_handlers((handler,))
    health = await add_standard_services(server, service_name, serving=serving)
    port = security.add_port(server, listen)
    if port:
        await server.start()
    return server, health, port


__all__ = ["PeerService", "serve", "PROTOCOL_VERSION", "SERVICE_NAME", "PUSH_METHOD", "HELLO_METHOD",
           "SETTLE_METHOD", "DIAL_BACK_METHOD"]
