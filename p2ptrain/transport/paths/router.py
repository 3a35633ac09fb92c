"""The router: which path a message to a peer takes, and taking it.

Paths: **direct** (the peer's TCP lane, or gRPC streaming) and **relayed via k** (a PushTensor
stream to k with `TensorHeader.route`, which k pipes on: forwarding.py). A route declared in the
settings always applies. Otherwise a peer is sent to directly until a direct send finds it
unreachable; then messages go through relay candidates (RouteTable) until the direct link is worth
trying again. The data plane decides the direct path: `grpc` never uses a lane; `auto` uses the
peer's lane when it offers one (learned from Hellos) and falls back to gRPC where it cannot be
connected to (nothing was sent then, so the fallback is safe); `tcp` insists on the lane.

Every attempt carries the same header (message id), so a copy that did arrive is answered
DUPLICATE, never applied twice; the emulated link (faults.py) is paid before either plane. Failures
leave as SendFailure. Runs on the node's loop thread; retries and settling are sending.py's.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.transport.errors import FailureKind, PeerError, SendFailure, describe
from p2ptrain.transport.faults import EmulatedLinks, LinkUnreachable
from p2ptrain.transport.lane_server import split_address
from p2ptrain.transport.paths.grpc_path import GrpcPath
from p2ptrain.transport.paths.lane_path import LaneClient, LaneUnavailable
from p2ptrain.transport.routes import RELAY_UNREACHABLE, RouteTable

log = logging.getLogger(__name__)

# Direct pushes in flight to one peer, on either plane: the Inbox's default max_receptions_per_sender.
IN_FLIGHT_PER_PEER = 8


class Greeter(Protocol):
    """Who greets peers (membership): its Hello tells where the peer's lane listens (LaneClient.learn)."""

    async def hello(self, peer: int, timeout: float, wait_for_ready: bool = True) -> pb.HelloReply: ...


class Router:
    """The sends of node `rank`: declared routes, relays on unreachable peers, lane or gRPC."""

    def __init__(self, rank: int, grpc: GrpcPath, lanes: LaneClient | None, routes: RouteTable, greeter: Greeter,
                 *, links: EmulatedLinks | None = None, discovery_timeout: float = 2.0, metrics=None):
        self.rank = rank
        self.grpc = grpc
        self.lanes = lanes  # None: data_plane grpc
        self.routes = routes
        self.greeter = greeter
        self.links = links
        self.discovery_timeout = discovery_timeout
        self.metrics = metrics
        self._slots: dict[int, asyncio.Semaphore] = {}  # per peer: direct pushes in flight
        self._asking: dict[int, asyncio.Future] = {}    # per peer: the Hello that asks where its lane is

    async def push(self, peer: int, header: pb.TensorHeader, payload: memoryview, reliable: bool,
                   timeout: float, wait_for_ready: bool = True) -> pb.Ack:
        """Deliver header + payload to `peer`, directly or relayed; SendFailure when no way worked."""
        routes = self.routes
        declared = routes.declared(peer)
        if declared is not None:
            return await self._hop(declared, peer, header, payload, reliable, timeout, wait_for_ready)
        failure: SendFailure | None = None
        if routes.direct_ok(peer):
            # Detecting unreachable peers: fail fast on a refused connect when a relay is there to try.
            fast = routes.detect and bool(routes.candidates(peer))
            try:
                ack = await self._hop((), peer, header, payload, reliable, timeout, wait_for_ready and not fast)
                routes.mark_reached(peer)
                return ack
            except LinkUnreachable as exc:
                failure = exc
            except SendFailure as exc:
                if not (fast and exc.kind.no_connection):
                    raise
                failure = exc
            routes.mark_unreachable(peer)
            log.info("node %d: peer %d unreachable directly (%s); relaying for %.0fs", self.rank, peer,
                     describe(failure), routes.retry_after)
        candidates = routes.candidates(peer)
        if failure is None and not candidates:  # down earlier, no relay now: maybe the link healed
            ack = await self._hop((), peer, header, payload, reliable, timeout, wait_for_ready)
            routes.mark_reached(peer)
            return ack
        for i, via in enumerate(candidates):
            last = i == len(candidates) - 1
            try:
                ack = await self._hop((via,), peer, header, payload, reliable, timeout,
                                      wait_for_ready and (last or not routes.detect))
            except LinkUnreachable as exc:
                routes.mark_unreachable(via)
                failure = exc
                continue
            except SendFailure as exc:
                if last or not exc.kind.no_connection:
                    raise
                routes.mark_unreachable(via)
                failure = exc
                continue
            if ack.status == pb.Ack.STATUS_REJECTED and ack.reason == RELAY_UNREACHABLE and not last:
                continue  # this relay cannot reach the peer either: nothing delivered, try the next
            routes.remember_via(peer, via)
            return ack
        raise failure if failure is not None else SendFailure(FailureKind.UNREACHABLE,
                                                              f"node {self.rank}: no relay to reach {peer}")

    async def _hop(self, route: tuple[int, ...], peer: int, header: pb.TensorHeader, payload: memoryview,
                   reliable: bool, timeout: float, wait_for_ready: bool) -> pb.Ack:
        del header.route[:]
        header.route.extend(route)
        hop = route[0] if route else peer
        if self.links is not None:  # before either data plane: the emulated link applies to both
            await self.links.emulate(hop, len(payload), reliable)
        if route:  # relayed hops always go by gRPC: a relay pipes PushTensor streams on
            return await self.grpc.client(hop).push(header, payload, timeout, wait_for_ready=wait_for_ready)
        return await self._direct(hop, header, payload, timeout, wait_for_ready)

    # Direct: the lane or gRPC -------------------------------------------------------------------
    async def _direct(self, peer: int, header: pb.TensorHeader, payload: memoryview, timeout: float,
                      wait_for_ready: bool) -> pb.Ack:
        """At most IN_FLIGHT_PER_PEER at a time (more would be refused as too_many_streams by a
        receiver's default limit)."""
        deadline = time.monotonic() + timeout
        slots = self._slots.setdefault(peer, asyncio.Semaphore(IN_FLIGHT_PER_PEER))
        try:
            async with asyncio.timeout(timeout):
                await slots.acquire()
        except TimeoutError:
            raise SendFailure(FailureKind.TIMEOUT, f"node {self.rank}: {IN_FLIGHT_PER_PEER} messages to node "
                                                   f"{peer} in flight for {timeout:.3g} s") from None
        try:
            return await self._lane_or_grpc(peer, header, payload, deadline, wait_for_ready)
        finally:
            slots.release()

    async def _lane_or_grpc(self, peer: int, header: pb.TensorHeader, payload: memoryview, deadline: float,
                            wait_for_ready: bool) -> pb.Ack:
        lanes = self.lanes
        failed, failure = None, None  # the lane that could not be connected to, and why
        while True:
            target = await self._lane_of(peer, max(0.05, deadline - time.monotonic()), wait_for_ready)
            if target is None or target == failed:
                break
            try:
                ack = await lanes.push(peer, *target, header, payload, max(0.05, deadline - time.monotonic()))
            except LaneUnavailable as exc:
                lanes.forget(peer)          # nothing was sent: ask its Hello where the lane is now (a
                again = failed is None      # restarted peer listens elsewhere) and try there, once
                failed, failure = target, exc
                if again:
                    continue
                break
            if self.metrics is not None:
                self.metrics.on_lane_message(peer)
            return ack
        if failure is not None:
            if lanes.required:
                raise SendFailure(FailureKind.UNREACHABLE, failure.detail)
            lanes.set_aside(peer)
            log.warning("%s; gRPC streaming to node %d for %.0f s", failure.detail, peer, lanes.retry_after)
        elif lanes is not None and lanes.required:
            raise PeerError(self._no_lane(peer))
        return await self.grpc.client(peer).push(header, payload, max(0.05, deadline - time.monotonic()),
                                                 wait_for_ready=wait_for_ready)

    def _no_lane(self, peer: int) -> str:
        address = self.grpc.addresses[peer]
        if split_address(address) is None:
            return f"node {self.rank}: node {peer}'s address {address!r} is no host:port, which data_plane=tcp requires"
        if not self.lanes.known(peer):
            return f"node {self.rank}: node {peer} did not say where its TCP lane is (no compatible Hello answer)"
        return self.lanes.refusal(peer)

    async def _lane_of(self, peer: int, timeout: float, wait_for_ready: bool) -> tuple[str, int] | None:
        """(host, port) of `peer`'s lane, or None where this push goes by gRPC."""
        lanes = self.lanes
        if lanes is None:
            return None
        address = split_address(self.grpc.addresses[peer])
        if address is None:
            return None
        if not lanes.known(peer):
            await self._ask(peer, timeout if lanes.required else min(timeout, self.discovery_timeout), wait_for_ready)
        port = lanes.port_of(peer)
        return (address[0], port) if port else None

    async def _ask(self, peer: int, timeout: float, wait_for_ready: bool) -> None:
        """Hello `peer` once to learn its lane (concurrent pushes share the one Hello). A Hello that
        found no peer fails the push under tcp, and sends it by gRPC under auto (which waits for the
        peer as a push does); one the peer refused (a wrong token) fails it either way."""
        asking = self._asking.get(peer)
        if asking is None:
            asking = self._asking[peer] = asyncio.ensure_future(self.greeter.hello(peer, timeout, wait_for_ready))
            asking.add_done_callback(lambda _: self._asking.pop(peer, None))
        try:
            await asyncio.shield(asking)
        except SendFailure as exc:
            if self.lanes.required or not (exc.kind.no_connection or exc.kind in (FailureKind.TIMEOUT,
                                                                                  FailureKind.CANCELLED)):
                raise


__all__ = ["Greeter", "Router", "IN_FLIGHT_PER_PEER"]
