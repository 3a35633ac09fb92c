"""The gRPC path: one channel per peer (PushTensor streams, Hello, Settle), on the node's loop thread.

This module and the gRPC servers (server.py, forwarding.py, health.py, security.py, streams.py)
are the only places that see gRPC types: every failed call leaves here as a SendFailure whose
kind says what the sender's policy needs (failure_of). It moves bytes only; whether to retry,
relay or settle a message is sending.py's and router.py's business.
"""
from __future__ import annotations

import asyncio
import contextlib
import time

import grpc

from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.addresses import split_address
from p2ptrain.transport import tokenauth
from p2ptrain.transport.errors import FailureKind, SendFailure
from p2ptrain.transport.framing import encode_header, iter_data_chunks, serialize_identity
from p2ptrain.transport.security import PLAINTEXT, Security

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Peer"].full_name  # "p2ptrain.v1.Peer"
PUSH_METHOD = f"/{SERVICE_NAME}/PushTensor"
HELLO_METHOD = f"/{SERVICE_NAME}/Hello"
SETTLE_METHOD = f"/{SERVICE_NAME}/Settle"
DIAL_BACK_METHOD = f"/{SERVICE_NAME}/DialBack"
REVERSE_METHOD = f"/{SERVICE_NAME}/Reverse"
GONE_CHECK_SECONDS = 1.0  # a connect that neither succeeds nor is refused within this says nothing

_KINDS = {grpc.StatusCode.UNAVAILABLE: FailureKind.UNREACHABLE,
          grpc.StatusCode.DEADLINE_EXCEEDED: FailureKind.TIMEOUT,
          grpc.StatusCode.CANCELLED: FailureKind.CANCELLED,
          grpc.StatusCode.RESOURCE_EXHAUSTED: FailureKind.BUSY,
          grpc.StatusCode.INTERNAL: FailureKind.BROKEN,
          grpc.StatusCode.UNKNOWN: FailureKind.BROKEN,
          grpc.StatusCode.UNAUTHENTICATED: FailureKind.DENIED,
          grpc.StatusCode.PERMISSION_DENIED: FailureKind.DENIED}
_STATUS = {FailureKind.GONE: grpc.StatusCode.UNAVAILABLE, FailureKind.UNREACHABLE: grpc.StatusCode.UNAVAILABLE,
           FailureKind.TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED, FailureKind.BROKEN: grpc.StatusCode.INTERNAL,
           FailureKind.BUSY: grpc.StatusCode.RESOURCE_EXHAUSTED, FailureKind.CANCELLED: grpc.StatusCode.CANCELLED,
           FailureKind.DENIED: grpc.StatusCode.UNAUTHENTICATED}


def status_of(kind: FailureKind) -> grpc.StatusCode:
    """The gRPC status a server answers a failure of `kind` with (its callers map it back: failure_of)."""
    return _STATUS.get(kind, grpc.StatusCode.UNKNOWN)


def kind_of(code: grpc.StatusCode) -> FailureKind:
    """The failure a call ended with `code` amounts to (status_of's inverse)."""
    return _KINDS.get(code, FailureKind.PROTOCOL)


def failure_from(exc: grpc.RpcError) -> SendFailure:
    """The SendFailure a failed call amounts to, from its status alone ("CODE: details")."""
    details = " ".join((exc.details() or "").split())  # one line, whatever gRPC put in it
    return SendFailure(kind_of(exc.code()), f"{exc.code().name}: {details}")


async def failure_of(exc: grpc.aio.AioRpcError, address: str) -> SendFailure:
    """The SendFailure a failed call to `address` amounts to. UNAVAILABLE is GONE when nothing
    listens on the address any more (a connect is refused: the process died; a stalled one still
    accepts connections), decided by trying, not by reading gRPC's message text."""
    failure = failure_from(exc)
    if failure.kind is FailureKind.UNREACHABLE and await nothing_listens(address):
        return SendFailure(FailureKind.GONE, failure.detail)
    return failure


async def nothing_listens(address: str) -> bool:
    """A TCP connect to host:port is refused (False for other addresses, timeouts and successes)."""
    target = split_address(address)
    if target is None:
        return False
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(*target), GONE_CHECK_SECONDS)
    except ConnectionRefusedError:
        return True
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return False


class PeerClient:
    """The channel from node `sender` to one peer, node `receiver`; every call raises SendFailure on
    failure. With a token each call carries its own proof of it (Security.call_metadata), made when
    the call goes out: a call that may wait for the peer first waits for the channel to be ready."""

    def __init__(self, address: str, options: list[tuple[str, object]], chunk_bytes: int,
                 security: Security = PLAINTEXT, *, sender: int | str = 0, receiver: int | str = 0, metrics=None):
        self.address = address
        self.metrics = metrics  # counts each call by method (NodeMetrics.on_rpc): what membership costs
        self.chunk_bytes = chunk_bytes
        self.channel = security.aio_channel(address, options)
        self.security = security
        self.sender, self.receiver = str(sender), str(receiver)
        self._push = self.channel.stream_unary(PUSH_METHOD, request_serializer=serialize_identity,
                                               response_deserializer=pb.Ack.FromString)
        self._hello = self.channel.unary_unary(HELLO_METHOD,
                                               request_serializer=pb.HelloRequest.SerializeToString,
                                               response_deserializer=pb.HelloReply.FromString)
        self._settle = self.channel.unary_unary(SETTLE_METHOD,
                                                request_serializer=pb.SettleRequest.SerializeToString,
                                                response_deserializer=pb.SettleReply.FromString)

        self._dial_back = self.channel.unary_unary(DIAL_BACK_METHOD,
                                                   request_serializer=pb.DialBackRequest.SerializeToString,
                                                   response_deserializer=pb.DialBackReply.FromString)

    def metadata(self, method: str):
        """A fresh authorization for one call of `method` (None without a token)."""
        return self.security.call_metadata(method, self.sender, self.receiver)

    async def ready(self, timeout: float | None, wait_for_ready: bool) -> float | None:
        """With a token, wait (within `timeout`) for the channel to connect before a call that would
        wait for the peer, so that its proof is fresh when sent; the time left of `timeout`."""
        if not (wait_for_ready and self.security.token) or \
                self.channel.get_state(try_to_connect=True) == grpc.ChannelConnectivity.READY:
            return timeout
        started = time.monotonic()
        try:
            await asyncio.wait_for(self.channel.channel_ready(), timeout)
        except asyncio.TimeoutError:
            pass  # the call itself fails as it would have
        return None if timeout is None else max(0.0, timeout - (time.monotonic() - started))

    async def push(self, header: pb.TensorHeader, payload: memoryview, timeout: float | None,
                   wait_for_ready: bool = True) -> pb.Ack:
        """Stream header + payload chunks; waits for the peer to come up (wait_for_ready) until
        `timeout`."""
        chunk_bytes = self.chunk_bytes

        def chunks():
            yield encode_header(header)
            yield from iter_data_chunks(payload, chunk_bytes)

        timeout = await self.ready(timeout, wait_for_ready)
        sent = time.monotonic()
        self.count(PUSH_METHOD, len(payload))
        try:
            return await self._push(chunks(), timeout=timeout, wait_for_ready=wait_for_ready,
                                    metadata=self.metadata(PUSH_METHOD))
        except grpc.aio.AioRpcError as exc:
            failure = await self.failure(exc, sent)
        raise failure

    def open_push(self, timeout: float | None, wait_for_ready: bool = True) -> "PushCall":
        """A PushTensor call to write pre-encoded chunks into one by one (relay forwarding)."""
        return PushCall(self, timeout, wait_for_ready)

    async def hello(self, request: pb.HelloRequest, timeout: float | None,
                    wait_for_ready: bool = True) -> pb.HelloReply:
        timeout = await self.ready(timeout, wait_for_ready)
        return await self._unary(self._hello, HELLO_METHOD, request, timeout, wait_for_ready)

    async def settle(self, request: pb.SettleRequest, timeout: float | None) -> pb.SettleReply:
        """Ask the peer which of our messages it delivered (it voids the rest); fails fast if down."""
        return await self._unary(self._settle, SETTLE_METHOD, request, timeout, wait_for_ready=False)

    async def dial_back(self, request: pb.DialBackRequest, timeout: float) -> pb.DialBackReply:
        """Ask the peer to dial this node back (reachability.py); fails fast if it is down."""
        return await self._unary(self._dial_back, DIAL_BACK_METHOD, request, timeout, wait_for_ready=False)

    async def _unary(self, stub, method: str, request, timeout: float | None, wait_for_ready: bool):
        """One unary call with a fresh proof; SendFailure if it fails."""
        sent = time.monotonic()
        if self.metrics is not None:  # (sizing a request costs a pass over it: only when counted)
            self.count(method, request.ByteSize())
        try:
            return await stub(request, timeout=timeout, wait_for_ready=wait_for_ready, metadata=self.metadata(method))
        except grpc.aio.AioRpcError as exc:
            raise await self.failure(exc, sent) from None

    def count(self, method: str, nbytes: int) -> None:
        """One call of `method` sending `nbytes` (the request; a push's payload) leaves this node."""
        if self.metrics is not None:
            self.metrics.on_rpc(method.rsplit("/", 1)[1], nbytes)

    async def failure(self, exc: grpc.aio.AioRpcError, sent: float) -> SendFailure:
        """failure_of; but a refused proof made a window or more ago (the call waited for a peer
        that went away and came back) is a timeout, which the sender retries with a fresh one."""
        if exc.code() == grpc.StatusCode.UNAUTHENTICATED and self.security.token \
                and time.monotonic() - sent >= tokenauth.WINDOW_SECONDS:
            return SendFailure(FailureKind.TIMEOUT, f"the call's auth proof expired while it waited "
                                                    f"({failure_from(exc).detail})")
        return await failure_of(exc, self.address)

    async def close(self) -> None:
        await self.channel.close()


class PushCall:
    """An open PushTensor call (forwarding.py pipes a relayed stream into it chunk by chunk). The
    call starts with the first write (after the channel is ready, with a token: PeerClient.ready)."""

    def __init__(self, client: PeerClient, timeout: float | None, wait_for_ready: bool):
        self.client = client
        self.address = client.address
        self._timeout, self._wait_for_ready = timeout, wait_for_ready
        self._call = None
        self._sent = 0.0
        self._cancelled = False

    async def _started(self):
        if self._call is None:
            client = self.client
            timeout = await client.ready(self._timeout, self._wait_for_ready)
            self._sent = time.monotonic()
            self._call = client._push(timeout=timeout, wait_for_ready=self._wait_for_ready,
                                      metadata=client.metadata(PUSH_METHOD))
            if self._cancelled:
                self._call.cancel()
        return self._call

    async def write(self, chunk: bytes) -> bool:
        """Write one encoded chunk; False once the call has ended (answered early, or failed):
        `result()` then says how."""
        try:
            await (await self._started()).write(chunk)
        except (asyncio.InvalidStateError, grpc.aio.AioRpcError):
            return False
        return True

    async def done_writing(self) -> None:
        with contextlib.suppress(asyncio.InvalidStateError, grpc.aio.AioRpcError):
            await (await self._started()).done_writing()

    async def result(self) -> pb.Ack:
        """The next hop's Ack; SendFailure if the call failed."""
        try:
            return await (await self._started())
        except grpc.aio.AioRpcError as exc:
            raise await self.client.failure(exc, self._sent) from None

    def cancel(self) -> None:
        self._cancelled = True
        if self._call is not None:
            self._call.cancel()


class GrpcPath:
    """The gRPC path: the node's PeerClients, one per peer, each made on first use (on the loop
    thread). It can always carry a message (it waits for the peer with wait_for_ready)."""

    name = "grpc"

    def __init__(self, addresses: list[str], options: list[tuple[str, object]], chunk_bytes: int,
                 security: Security = PLAINTEXT, rank: int = 0, metrics=None):
        self.rank = rank  # this node: the sender named in every call's auth proof
        self.metrics = metrics  # counts the calls by method (NodeMetrics.on_rpc)
        self.addresses = addresses  # shared with the node (rank order; "" until a joiner is heard of)
        self.options = options
        self.chunk_bytes = chunk_bytes
        self.security = security
        self._clients: dict[int, PeerClient] = {}
        self.reverse_clients: dict = {}  # private peer -> its reverse.ReverseClient (while its stream is open)
        # the Peer services of nodes on this loop (a simulation; local_calls.py), called in-process
        self.local = None
        self._local: dict[int, tuple[object, object]] = {}  # peer -> (its service, our LocalClient of it)
        self.learned: set[int] = set()  # peers whose address was not configured but learned (joiners)

    def set_addresses(self, addresses: list[str]) -> None:
        """Peer addresses learned after start-up (a rendezvous); before any channel is made."""
        if self._clients:
            raise RuntimeError("peer addresses can only be set before the first call to a peer")
        self.addresses[:] = addresses

    def learn_address(self, peer: int, address: str) -> bool:
        """The address of a node that joined after the start (its Hello or a view names it); a
        known address is never replaced (a restarted node keeps its own). True if it was new."""
        if not address or self.addresses[peer]:
            return False
        self.addresses[peer] = address
        self.learned.add(peer)
        return True

    def client(self, peer: int) -> PeerClient:
        """The client to `peer`: down the reverse stream it opened if it is private (reverse.py),
        else the channel to its address."""
        reverse = self.reverse_clients.get(peer)
        if reverse is not None and not reverse.closed:
            return reverse
        if self.local is not None:
            service = self.local.service(self.addresses[peer])
            if service is not None:
                return self._local_client(peer, service)
        return self.direct_client(peer)

    def _local_client(self, peer: int, service):
        from p2ptrain.transport.paths.local_calls import LocalClient  # (a simulation's: not imported otherwise)

        held = self._local.get(peer)
        if held is None or held[0] is not service:  # (a restarted node registers a new service)
            host = (split_address(self.addresses[self.rank]) or ("127.0.0.1", 0))[0]
            held = self._local[peer] = (service, LocalClient(service, lambda: self.direct_client(peer), host,
                                                             metrics=self.metrics))
        return held[1]

    def direct_client(self, peer: int) -> PeerClient:
        if not self.addresses[peer]:
            raise SendFailure(FailureKind.UNREACHABLE, f"no address known for node {peer} (it has not joined)")
        client = self._clients.get(peer)
        if client is None:
            client = self._clients[peer] = PeerClient(self.addresses[peer], self.options, self.chunk_bytes,
                                                      self.security, sender=self.rank, receiver=peer,
                                                      metrics=self.metrics)
        return client

    def fresh_client(self, peer: int) -> PeerClient:
        """A client of its own (a new connection, not the shared channel) to the address held for
        `peer`: whether that address can be dialled now (reachability.py). The caller closes it."""
        if not self.addresses[peer]:
            raise SendFailure(FailureKind.UNREACHABLE, f"no address known for node {peer}")
        return PeerClient(self.addresses[peer], self.options + [("grpc.use_local_subchannel_pool", 1)],
                          self.chunk_bytes, self.security, sender=self.rank, receiver=peer, metrics=self.metrics)

    async def connects(self, peer: int, timeout: float) -> bool:
        """Whether a direct connection to `peer` opens within `timeout` (the channel, not a call)."""
        try:
            await asyncio.wait_for(self.direct_client(peer).channel.channel_ready(), timeout)
            return True
        except (asyncio.TimeoutError, grpc.RpcError, grpc.aio.UsageError, OSError):
            return False

    @property
    def channels(self) -> int:
        """Channels this node holds open to its peers (one per peer it ever called directly), and
        in-process links to nodes of its process (a simulation's: local_calls.py)."""
        return len(self._clients.keys() | self._local.keys())

    @property
    def grpc_channels(self) -> int:
        """Of them, the gRPC channels."""
        return len(self._clients)

    async def push(self, peer: int, header: pb.TensorHeader, payload: memoryview, timeout: float,
                   wait_for_ready: bool = True) -> pb.Ack:
        return await self.client(peer).push(header, payload, timeout, wait_for_ready=wait_for_ready)

    async def reset(self, peer: int) -> None:
        """Drop `peer`'s channel (it came back from the dead: connect afresh, without backoff)."""
        client = self._clients.pop(peer, None)
        if client is not None:
            await client.close()

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()


__all__ = ["DIAL_BACK_METHOD", "GrpcPath", "HELLO_METHOD", "PUSH_METHOD", "PeerClient", "PushCall", "SERVICE_NAME",
           "REVERSE_METHOD", "SETTLE_METHOD", "failure_from", "kind_of", "failure_of", "nothing_listens", "status_of"]
