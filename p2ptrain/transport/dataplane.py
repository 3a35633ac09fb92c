"""Which way a direct push goes: the receiver's TCP lane (lane.py) or gRPC streaming (client.py).

The node's data_plane setting decides: `grpc` never uses a lane (and offers none); `auto` uses the
lane when the peer offers one and falls back to gRPC where it cannot (the peer advertised none, its
address is no host:port, or its lane cannot be connected to: nothing was sent then, so the fallback
is safe; a lane found unusable is left alone for `retry_after` seconds); `tcp` insists, and a peer
without a lane is a PeerError naming it. A peer's lane port comes from Hellos (ours to it, its to
us: peers.py); a first push to a peer not heard from yet asks it with one Hello. Relayed hops always
go by gRPC (relay.py): a relay pipes PushTensor streams on.

Runs on the node's loop thread; it picks the path only (retries are sending.py's).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

import grpc

from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.addresses import split_address
from p2ptrain.transport.client import ChannelPool
from p2ptrain.transport.errors import PeerError, rpc_error
from p2ptrain.transport.lane import LaneClient, LaneUnavailable

log = logging.getLogger(__name__)

# Direct pushes in flight to one peer, on either plane: the Inbox's default max_receptions_per_sender.
IN_FLIGHT_PER_PEER = 8
# Hello failures that mean nobody answered (yet): under auto the push goes by gRPC, which waits for the peer.
_NO_ANSWER = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


class DirectPath:
    """The direct pushes of node `rank` under `mode` ("auto" | "grpc" | "tcp"); `lanes` is None
    under "grpc". `hello(peer, timeout, wait_for_ready)` greets a peer (peers.py sets it): its
    reply tells the peer's lane port through learn()."""

    def __init__(self, rank: int, mode: str, channels: ChannelPool, lanes: LaneClient | None, *,
                 discovery_timeout: float, retry_after: float, metrics=None):
        self.rank = rank
        self.mode = mode
        self.channels = channels
        self.lanes = lanes
        self.discovery_timeout = discovery_timeout
        self.retry_after = retry_after
        self.metrics = metrics
        self.port = 0  # our own lane's port, advertised in our Hellos (0: none)
        self.hello: Callable[[int, float, bool], Awaitable[pb.HelloReply]] | None = None
        self._ports: dict[int, int] = {}          # peer -> the lane port it advertised (0: none)
        self._unusable: dict[int, float] = {}     # peer -> monotonic time until which its lane is not tried
        self._asking: dict[int, asyncio.Future] = {}
        self._slots: dict[int, asyncio.Semaphore] = {}  # per peer: pushes in flight

    def learn(self, peer: int, port: int) -> None:
        """`peer` advertised lane `port` in a Hello (0: it offers none)."""
        if self._ports.get(peer) != port:
            self._unusable.pop(peer, None)  # a new lane (restart): worth trying at once
            if self.lanes is not None:
                self.lanes.drop(peer)
        self._ports[peer] = port

    def refusal(self, peer: int) -> str:
        """Why data_plane tcp cannot push to `peer` ("" when it can, or when it is not known yet)."""
        if self.mode != "tcp" or self._ports.get(peer, 1):
            return ""
        return (f"node {self.rank}: node {peer} offers no TCP lane, which data_plane=tcp requires (run it with "
                "data_plane auto or tcp, or use data_plane auto / grpc here)")

    async def push(self, peer: int, header: pb.TensorHeader, payload: memoryview, timeout: float,
                   wait_for_ready: bool = True) -> pb.Ack:
        """Push to `peer` by the lane or gRPC (see the module doc), at most IN_FLIGHT_PER_PEER at a
        time (more would be refused as too_many_streams by a receiver's default limit); failures as
        PushTensor's."""
        deadline = time.monotonic() + timeout
        slots = self._slots.setdefault(peer, asyncio.Semaphore(IN_FLIGHT_PER_PEER))
        try:
            async with asyncio.timeout(timeout):
                await slots.acquire()
        except TimeoutError:
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, f"node {self.rank}: {IN_FLIGHT_PER_PEER} messages to "
                                                               f"node {peer} in flight for {timeout:.3g} s") from None
        try:
            return await self._push(peer, header, payload, deadline, wait_for_ready)
        finally:
            slots.release()

    async def _push(self, peer: int, header: pb.TensorHeader, payload: memoryview, deadline: float,
                    wait_for_ready: bool) -> pb.Ack:
        failed, failure = None, None  # the lane that could not be connected to, and why
        while True:
            target = await self._lane_of(peer, max(0.05, deadline - time.monotonic()), wait_for_ready)
            if target is None or target == failed:
                break
            try:
                ack = await self.lanes.push(peer, *target, header, payload, max(0.05, deadline - time.monotonic()))
            except LaneUnavailable as exc:
                self._ports.pop(peer, None)  # nothing was sent: ask its Hello where the lane is now (a
                again = failed is None       # restarted peer listens elsewhere) and try there, once
                failed, failure = target, exc
                if again:
                    continue
                break
            if self.metrics is not None:
                self.metrics.on_lane_message(peer)
            return ack
        if failure is not None:
            if self.mode == "tcp":
                raise rpc_error(grpc.StatusCode.UNAVAILABLE, str(failure))
            self._unusable[peer] = time.monotonic() + self.retry_after
            log.warning("%s; gRPC streaming to node %d for %.0f s", failure, peer, self.retry_after)
        elif self.mode == "tcp":
            raise PeerError(self._no_lane(peer))
        return await self._grpc(peer, header, payload, deadline, wait_for_ready)

    async def _grpc(self, peer: int, header: pb.TensorHeader, payload: memoryview, deadline: float,
                    wait_for_ready: bool) -> pb.Ack:
        return await self.channels.client(peer).push(header, payload, max(0.05, deadline - time.monotonic()),
                                                     wait_for_ready=wait_for_ready)

    def _no_lane(self, peer: int) -> str:
        if split_address(self.channels.addresses[peer]) is None:
            return (f"node {self.rank}: node {peer}'s address {self.channels.addresses[peer]!r} is no host:port, "
                    "which data_plane=tcp requires")
        if peer not in self._ports:
            return f"node {self.rank}: node {peer} did not say where its TCP lane is (no compatible Hello answer)"
        return self.refusal(peer)

    async def _lane_of(self, peer: int, timeout: float, wait_for_ready: bool) -> tuple[str, int] | None:
        """(host, port) of `peer`'s lane, or None where this push goes by gRPC."""
        if self.lanes is None or time.monotonic() < self._unusable.get(peer, 0.0):
            return None
        address = split_address(self.channels.addresses[peer])
        if address is None:
            return None
        if peer not in self._ports:
            await self._ask(peer, timeout if self.mode == "tcp" else min(timeout, self.discovery_timeout),
                            wait_for_ready)
        port = self._ports.get(peer, 0)
        return (address[0], port) if port else None

    async def _ask(self, peer: int, timeout: float, wait_for_ready: bool) -> None:
        """Hello `peer` once to learn its lane (concurrent pushes share the one Hello). A Hello that
        found no peer fails the push under tcp, and sends it by gRPC under auto (which waits for the
        peer as a push does); one the peer refused (a wrong token) fails it either way."""
        asking = self._asking.get(peer)
        if asking is None:
            asking = self._asking[peer] = asyncio.ensure_future(self.hello(peer, timeout, wait_for_ready))
            asking.add_done_callback(lambda _: self._asking.pop(peer, None))
        try:
            await asyncio.shield(asking)
        except grpc.aio.AioRpcError as exc:
            if self.mode == "tcp" or exc.code() not in _NO_ANSWER:
                raise


__all__ = ["DirectPath"]
