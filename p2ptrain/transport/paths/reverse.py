"""Reverse connections: how the other nodes reach a private one (behind NAT or a firewall).

A private node dials out, so it opens one `Reverse` stream to each peer it reached (ReverseLink)
and the peer makes its calls to it down that stream (ReverseClient, which GrpcPath hands out for
that peer): Hellos, Settles and PushTensor streams, each frame tagged with a call id and answered
up the stream by the private node's own PeerService, so the same checks, acks, message ids and
settling apply (under node identity, the stream's server must show the peer's certificate, and the
calls are judged as that peer's). A broken stream fails the calls in flight as a broken connection does (a push may
have landed: its retry is answered DUPLICATE) and is opened again.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator

import grpc

from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.transport.errors import FailureKind, SendFailure
from p2ptrain.transport.framing import deserialize_chunk, encode_header, iter_data_chunks
from p2ptrain.transport.paths.grpc_path import REVERSE_METHOD, kind_of
from p2ptrain.transport.security import SecurityError

log = logging.getLogger(__name__)

REOPEN_SECONDS = 1.0  # a broken stream is opened again after this (the private side), doubling while
REOPEN_MAX_SECONDS = 30.0  # ... it keeps failing (the peer is gone), up to this
MAX_CALLS = 1024  # calls in flight down one stream that a private node answers at once; more are refused
_GONE = "the reverse stream of node {peer} ended"


class ReverseClient:
    """The public side's client for private node `peer`: PeerClient's calls, made down the stream
    that `peer` opened (`frames`: what to send down; answers come in through `answered`)."""

    def __init__(self, peer: int, chunk_bytes: int):
        self.peer = peer
        self.address = f"reverse stream of node {peer}"
        self.chunk_bytes = chunk_bytes
        self.frames: asyncio.Queue[pb.ReverseDown | None] = asyncio.Queue()
        self.closed = False
        self._calls: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)

    # answers (from the stream's reader) ---------------------------------------------------------
    def answered(self, frame: pb.ReverseUp) -> None:
        future = self._calls.pop(frame.call_id, None)
        if future is None or future.done():
            return  # a call that timed out meanwhile, or a bogus id: nothing waits for it
        kind = frame.WhichOneof("answer")
        if kind == "error":
            future.set_exception(SendFailure(_kind_of(frame.error.code), f"node {self.peer} (reverse): "
                                                                       f"{frame.error.detail[:300]}"))
        elif kind in ("hello", "settle", "ack"):
            future.set_result(getattr(frame, kind))
        else:
            future.set_exception(SendFailure(FailureKind.PROTOCOL, f"node {self.peer} answered a call with {kind}"))

    def close(self) -> None:
        """The stream ended: every call in flight fails as on a connection that broke off (a push may
        have been delivered: its retry, the same message id, is answered DUPLICATE)."""
        self.closed = True
        for future in self._calls.values():
            if not future.done():
                future.set_exception(SendFailure(FailureKind.BROKEN, _GONE.format(peer=self.peer)))
        self._calls.clear()
        self.frames.put_nowait(None)

    # PeerClient's calls ---------------------------------------------------------------------------
    def _call(self) -> tuple[int, asyncio.Future]:
        if self.closed:
            raise SendFailure(FailureKind.UNREACHABLE, _GONE.format(peer=self.peer))
        call_id = next(self._ids)
        future = self._calls[call_id] = asyncio.get_running_loop().create_future()
        return call_id, future

    async def _answer(self, call_id: int, future: asyncio.Future, timeout: float | None):
        try:
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            raise SendFailure(FailureKind.TIMEOUT, f"node {self.peer} (reverse) did not answer within "
                                                   f"{timeout:.3g} s") from None
        finally:
            self._calls.pop(call_id, None)

    async def hello(self, request: pb.HelloRequest, timeout: float | None,
                    wait_for_ready: bool = True) -> pb.HelloReply:
        call_id, future = self._call()
        self.frames.put_nowait(pb.ReverseDown(call_id=call_id, hello=request))
        return await self._answer(call_id, future, timeout)

    async def settle(self, request: pb.SettleRequest, timeout: float | None) -> pb.SettleReply:
        call_id, future = self._call()
        self.frames.put_nowait(pb.ReverseDown(call_id=call_id, settle=request))
        return await self._answer(call_id, future, timeout)

    async def dial_back(self, request: pb.DialBackRequest, timeout: float) -> pb.DialBackReply:
        raise SendFailure(FailureKind.PROTOCOL, f"node {self.peer} is private: it does not dial back")

    def open_push(self, timeout: float | None, wait_for_ready: bool = True) -> "ReversePush":
        return ReversePush(self, timeout)

    async def push(self, header: pb.TensorHeader, payload: memoryview, timeout: float | None,
                   wait_for_ready: bool = True) -> pb.Ack:
        call = self.open_push(timeout)
        await call.write(encode_header(header))
        for chunk in iter_data_chunks(payload, self.chunk_bytes):
            await call.write(chunk)
        await call.done_writing()
        return await call.result()

    async def failure(self, exc, sent: float) -> SendFailure:  # (PeerClient's; no gRPC error comes here)
        return SendFailure(FailureKind.UNREACHABLE, f"node {self.peer} (reverse): {exc}")


class ReversePush:
    """One PushTensor call down a reverse stream (PushCall's interface: forwarding.py pipes into it)."""

    def __init__(self, client: ReverseClient, timeout: float | None):
        self.client = client
        self.address = client.address
        self.timeout = timeout
        self.call_id, self.future = client._call()

    async def write(self, chunk: bytes) -> bool:
        if self.future.done():
            return False
        self.client.frames.put_nowait(pb.ReverseDown(call_id=self.call_id, push_chunk=bytes(chunk)))
        await asyncio.sleep(0)  # (let the stream writer drain: a tensor is queued chunk by chunk)
        return True

    async def done_writing(self) -> None:
        if not self.future.done():
            self.client.frames.put_nowait(pb.ReverseDown(call_id=self.call_id, push_end=True))

    async def result(self) -> pb.Ack:
        return await self.client._answer(self.call_id, self.future, self.timeout)

    def cancel(self) -> None:
        if not self.future.done():
            self.client.frames.put_nowait(pb.ReverseDown(call_id=self.call_id, push_end=False))
            self.future.cancel()


def _kind_of(code: int) -> FailureKind:
    status = next((s for s in grpc.StatusCode if s.value[0] == code), grpc.StatusCode.UNKNOWN)
    return kind_of(status)


# --- the public side's handler of the Reverse call --------------------------------------------------

async def serve_reverse(requests, context, *, rank: int, world_size: int, chunk_bytes: int, clients: dict,
                        claim_problem) -> AsyncIterator[pb.ReverseDown]:
    """PeerService's Reverse handler (an async generator of ReverseDown): register a ReverseClient
    for the private node that opened the stream (`clients`: GrpcPath.reverse_clients) and carry its
    calls down and their answers up until the stream ends. `claim_problem(node_id)`: why that node
    may not open it (identity), or None."""
    first = await anext(aiter(requests), None)
    if first is None or first.WhichOneof("answer") != "open":
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a Reverse stream opens with ReverseOpen")
    peer = first.open.node_id
    if not 0 <= peer < world_size or peer == rank:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"node {peer} is not a peer")
    problem = claim_problem(peer)
    if problem:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, problem)
    client = ReverseClient(peer, chunk_bytes)
    previous = clients.get(peer)
    clients[peer] = client
    if previous is not None:
        previous.close()  # (a reopened stream replaces the old one)
    log.info("node %d: node %d is private; its calls go down the stream it opened", rank, peer)

    async def read() -> None:
        try:
            async for frame in requests:
                client.answered(frame)
        finally:
            client.close()

    reader = asyncio.ensure_future(read())
    try:
        while True:
            frame = await client.frames.get()
            if frame is None:
                return
            yield frame
    finally:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await reader
        client.close()
        if clients.get(peer) is client:
            del clients[peer]




# --- the private side --------------------------------------------------------------------------------

class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, detail: str):
        super().__init__(detail)
        self.code, self.detail = code, detail


class _Cancelled(Exception):
    """The public side cancelled a push (its relay's upstream broke off)."""


class _CallContext:
    """What PeerService's handlers use of a grpc.aio context, for a call that came down a reverse
    stream: abort raises (answered up as ReverseError); no deadline travels with the call. Its
    `certificate` is the one the stream's server showed (checked to name the peer before the stream
    opened: ReverseLink), so under node identity the calls are judged as that peer's."""

    def __init__(self, certificate: bytes | None):
        self.certificate = certificate

    async def abort(self, code: grpc.StatusCode, detail: str = ""):
        raise _Aborted(code, detail)

    def time_remaining(self) -> float | None:
        return None

    def auth_context(self) -> dict:
        return {"x509_pem_cert": [self.certificate]} if self.certificate else {}

    def peer(self) -> str:
        return "reverse"


class ReverseLink:
    """The private side: the Reverse stream this node (`rank`) keeps open to public peer `peer`
    over `client()` (the PeerClient of its channel now: this node can dial out), answering the calls that come down it
    with `service` (this node's PeerService). A broken stream is opened again REOPEN_SECONDS later,
    until stop(). `certify`: () -> awaitable of the peer's certificate, checked to name it (None
    when node identity is not in force; raises SecurityError or OSError), fetched before each open."""

    def __init__(self, rank: int, peer: int, client, service, incarnation, certify=None):
        self.rank, self.peer = rank, peer
        self.client = client  # () -> the PeerClient to `peer`, asked at each open (a reset replaces it)
        self.service = service
        self.incarnation = incarnation  # () -> this node's incarnation now
        self.certify = certify
        self.opened = 0  # streams opened so far (tests, logs)
        self.calls = 0  # frames that came down them
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """On the loop thread."""
        self._task = asyncio.ensure_future(self._keep_open())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _keep_open(self) -> None:
        failures = 0
        while True:
            calls = self.calls
            try:
                certificate = await self.certify() if self.certify is not None else None
                client = self.client()  # (now: the channel is replaced when the peer comes back)
                stub = client.channel.stream_stream(REVERSE_METHOD, request_serializer=pb.ReverseUp.SerializeToString,
                                                    response_deserializer=pb.ReverseDown.FromString)
                await self._serve(stub, client, _CallContext(certificate))
                why = "it ended"
            except grpc.aio.AioRpcError as exc:
                why = f"{exc.code().name}: {exc.details()}"
            except (SecurityError, OSError) as exc:  # (not opened: the server is not node `peer`, or is not there)
                why = str(exc)
            except asyncio.CancelledError:
                if asyncio.current_task().cancelling():
                    raise  # (stop())
                why = "its channel was closed"  # (a reset channel cancels its calls: open the stream anew)
            except Exception as exc:  # noqa: BLE001 - whatever ended it, a private node must stay reachable
                why = f"{type(exc).__name__}: {exc}"
            failures = 0 if self.calls > calls else failures + 1  # (it carried calls: it worked)
            if failures & (failures - 1) == 0:  # (the first failures, then every power of two)
                log.info("node %d: the reverse stream to node %d broke off (%s); opening it again", self.rank,
                         self.peer, str(why)[:200])
            await asyncio.sleep(min(REOPEN_SECONDS * 2 ** max(0, failures - 1), REOPEN_MAX_SECONDS))

    async def _serve(self, stub, client, context: _CallContext) -> None:
        up: asyncio.Queue[pb.ReverseUp | None] = asyncio.Queue()
        up.put_nowait(pb.ReverseUp(open=pb.ReverseOpen(node_id=self.rank, incarnation=self.incarnation())))

        async def frames():
            while (frame := await up.get()) is not None:
                yield frame

        call = stub(frames(), metadata=client.metadata(REVERSE_METHOD))
        self.opened += 1
        pushes: dict[int, asyncio.Queue | None] = {}  # per call: its chunks (None: answered, the rest dropped)
        tasks: set[asyncio.Task] = set()

        def spawn(coroutine) -> asyncio.Task:
            task = asyncio.ensure_future(coroutine)
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            return task

        def refuse(call_id: int) -> None:  # (a peer that never ends its calls gets no more of them)
            up.put_nowait(pb.ReverseUp(call_id=call_id, error=pb.ReverseError(
                code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
                detail=f"{MAX_CALLS} calls in flight down this reverse stream")))

        def answered(call_id: int, queue: asyncio.Queue) -> None:
            if pushes.get(call_id) is queue:  # (answered before its end came: the rest is dropped)
                pushes[call_id] = None

        try:
            async for down in call:
                self.calls += 1
                kind = down.WhichOneof("call")
                fresh = kind != "push_end" and down.call_id not in pushes
                if fresh and max(len(tasks), len(pushes)) >= MAX_CALLS:
                    refuse(down.call_id)
                elif kind in ("hello", "settle"):
                    spawn(self._answer(down.call_id, kind, getattr(down, kind), up, context))
                elif kind == "push_chunk":
                    if fresh:
                        queue = pushes[down.call_id] = asyncio.Queue()
                        spawn(self._push(down.call_id, queue, up, context)).add_done_callback(
                            lambda _, call_id=down.call_id, queue=queue: answered(call_id, queue))
                    queue = pushes[down.call_id]
                    if queue is not None:
                        queue.put_nowait(down.push_chunk)
                elif kind == "push_end":
                    queue = pushes.pop(down.call_id, None)
                    if queue is not None:
                        queue.put_nowait(None if down.push_end else _Cancelled)
        finally:
            for queue in pushes.values():
                if queue is not None:
                    queue.put_nowait(_Cancelled)
            for task in tasks:
                task.cancel()
            up.put_nowait(None)  # (ends the frames generator, if gRPC still reads it)
            call.cancel()

    async def _answer(self, call_id: int, kind: str, request, up: asyncio.Queue, context: _CallContext) -> None:
        claimed = request.node_id if kind == "hello" else request.sender
        try:
            if claimed != self.peer:  # (the stream is node `peer`'s: nobody else's calls come down it)
                raise _Aborted(grpc.StatusCode.PERMISSION_DENIED, f"a {kind} as node {claimed} down node "
                                                                  f"{self.peer}'s reverse stream")
            handler = self.service.hello if kind == "hello" else self.service.settle
            answer = await handler(request, context)
            up.put_nowait(pb.ReverseUp(call_id=call_id, **{kind: answer}))
        except _Aborted as exc:
            up.put_nowait(pb.ReverseUp(call_id=call_id, error=pb.ReverseError(code=exc.code.value[0],
                                                                              detail=exc.detail)))

    async def _push(self, call_id: int, queue: asyncio.Queue, up: asyncio.Queue, context: _CallContext) -> None:
        async def chunks():
            while True:
                item = await queue.get()
                if item is None:
                    return
                if item is _Cancelled:
                    raise _Cancelled()
                yield deserialize_chunk(item)

        try:
            ack = await self.service.push_tensor(chunks(), context)
            up.put_nowait(pb.ReverseUp(call_id=call_id, ack=ack))
        except _Aborted as exc:
            up.put_nowait(pb.ReverseUp(call_id=call_id, error=pb.ReverseError(code=exc.code.value[0],
                                                                              detail=exc.detail)))
        except _Cancelled:
            pass  # (the public side gave the call up: nothing waits for an answer)


__all__ = ["MAX_CALLS", "REOPEN_MAX_SECONDS", "REOPEN_SECONDS", "ReverseClient", "ReverseLink", "ReversePush",
           "serve_reverse"]
