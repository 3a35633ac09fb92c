"""gRPC client side of a node: one channel per peer, pushing chunked tensor streams.

Everything here is created and used on the node's event-loop thread (loop.py), and only moves
bytes: whether to retry, relay or settle a message is decided by sending.py and relay.py.
"""
from __future__ import annotations

from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.transport.framing import encode_header, iter_data_chunks, serialize_identity
from p2ptrain.transport.security import PLAINTEXT, Security
from p2ptrain.transport.server import HELLO_METHOD, PUSH_METHOD, SETTLE_METHOD


class PeerClient:
    """Channel to one peer. Created and used only on the node's event-loop thread."""

    def __init__(self, address: str, options: list[tuple[str, object]], chunk_bytes: int,
                 security: Security = PLAINTEXT):
        self.address = address
        self.chunk_bytes = chunk_bytes
        self.channel = security.aio_channel(address, options)
        self.metadata = security.call_metadata()  # the auth token, sent with every call
        self._push = self.channel.stream_unary(PUSH_METHOD, request_serializer=serialize_identity,
                                               response_deserializer=pb.Ack.FromString)
        self._hello = self.channel.unary_unary(HELLO_METHOD,
                                               request_serializer=pb.HelloRequest.SerializeToString,
                                               response_deserializer=pb.HelloReply.FromString)
        self._settle = self.channel.unary_unary(SETTLE_METHOD,
                                                request_serializer=pb.SettleRequest.SerializeToString,
                                                response_deserializer=pb.SettleReply.FromString)

    async def push(self, header: pb.TensorHeader, payload: memoryview, timeout: float | None,
                   wait_for_ready: bool = True) -> pb.Ack:
        """Stream header + payload chunks; waits for the peer to come up (wait_for_ready) until
        `timeout`. Raises grpc.aio.AioRpcError on transport failure."""
        chunk_bytes = self.chunk_bytes

        def chunks():
            yield encode_header(header)
            yield from iter_data_chunks(payload, chunk_bytes)

        return await self._push(chunks(), timeout=timeout, wait_for_ready=wait_for_ready, metadata=self.metadata)

    def open_push(self, timeout: float | None, wait_for_ready: bool = True):
        """A PushTensor call to write pre-encoded chunks into one by one (relay forwarding)."""
        return self._push(timeout=timeout, wait_for_ready=wait_for_ready, metadata=self.metadata)

    async def hello(self, request: pb.HelloRequest, timeout: float | None,
                    wait_for_ready: bool = True) -> pb.HelloReply:
        return await self._hello(request, timeout=timeout, wait_for_ready=wait_for_ready, metadata=self.metadata)

    async def settle(self, request: pb.SettleRequest, timeout: float | None) -> pb.SettleReply:
        """Ask the peer which of our messages it delivered (it voids the rest); fails fast if down."""
        return await self._settle(request, timeout=timeout, wait_for_ready=False, metadata=self.metadata)

    async def close(self) -> None:
        await self.channel.close()


class ChannelPool:
    """The node's PeerClients, one per peer, each made on first use (on the loop thread)."""

    def __init__(self, addresses: list[str], options: list[tuple[str, object]], chunk_bytes: int,
                 security: Security = PLAINTEXT):
        self.addresses = list(addresses)
        self.options = options
        self.chunk_bytes = chunk_bytes
        self.security = security
        self._clients: dict[int, PeerClient] = {}

    def set_addresses(self, addresses: list[str]) -> None:
        """Peer addresses learned after start-up (a rendezvous); before any channel is made."""
        if self._clients:
            raise RuntimeError("peer addresses can only be set before the first call to a peer")
        self.addresses = list(addresses)

    def learn_address(self, peer: int, address: str) -> bool:
        """The address of a node that joined after the start (its Hello or a view names it); a
        known address is never replaced (a restarted node keeps its own). True if it was new."""
        if not address or self.addresses[peer]:
            return False
        self.addresses[peer] = address
        return True

    def client(self, peer: int) -> PeerClient:
        if not self.addresses[peer]:
            raise ConnectionError(f"no address known for node {peer} (it has not joined)")
        client = self._clients.get(peer)
        if client is None:
            client = self._clients[peer] = PeerClient(self.addresses[peer], self.options, self.chunk_bytes,
                                                      self.security)
        return client

    async def reset(self, peer: int) -> None:
        """Drop `peer`'s channel (it came back from the dead: connect afresh, without backoff)."""
        client = self._clients.pop(peer, None)
        if client is not None:
            await client.close()

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()
