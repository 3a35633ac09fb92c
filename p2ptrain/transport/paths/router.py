"""The router: which path a message to a peer takes, and taking it.

Paths: **direct** (the node's direct paths in order: the peer's TCP lane, then gRPC streaming; a
path that cannot carry the message raises PathUnavailable and the next one is tried) and **relayed
via k** (a PushTensor stream to k with `TensorHeader.route`, which k pipes on: forwarding.py). A
route declared in the settings always applies. Otherwise a peer is sent to directly until a direct
send finds it unreachable; then messages go through relay candidates (RouteTable) until the direct
link is worth trying again.

Every attempt carries the same header (message id), so a copy that did arrive is answered
DUPLICATE, never applied twice; the emulated link (faults.py) is paid before any path. Failures
leave as SendFailure. Runs on the node's loop thread; retries and settling are sending.py's.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.transport.errors import FailureKind, SendFailure, describe
from p2ptrain.transport.faults import EmulatedLinks, LinkUnreachable
from p2ptrain.transport.paths import DirectPath, PathUnavailable
from p2ptrain.transport.paths.grpc_path import GrpcPath
from p2ptrain.transport.routes import RELAY_UNREACHABLE, RouteTable

log = logging.getLogger(__name__)

# Direct pushes in flight to one peer, on either plane: the Inbox's default max_receptions_per_sender.
IN_FLIGHT_PER_PEER = 8
DIRECT = -1  # Router.via of a peer reached directly (else the rank of the relay)
REVERSE = -2  # ... of a private peer reached down the reverse stream it opened (reverse.py)
PROBE_SECONDS = 5.0  # a background connect to a private peer behind another NAT gives up after this


class Router:
    """The sends of node `rank`: declared routes, relays on unreachable peers, else the first of
    `paths` that can carry the message; relayed hops go by `relay` (gRPC streams are piped on)."""

    def __init__(self, rank: int, paths: Sequence[DirectPath], relay: GrpcPath, routes: RouteTable, *,
                 links: EmulatedLinks | None = None, metrics=None):
        self.rank = rank
        self.paths = tuple(paths)
        self.relay = relay
        self.routes = routes
        self.links = links
        self.metrics = metrics
        self.via: dict[int, int] = {}  # per peer: how its last delivered message went (DIRECT, or a relay's rank)
        self._slots: dict[int, asyncio.Semaphore] = {}  # per peer: direct pushes in flight
        self._probing: set[int] = set()  # private peers whose direct link is being tried (_probe_direct)
        self._probes: set[asyncio.Task] = set()

    def paths_taken(self) -> dict[int, str]:
        """How each peer was last reached: "direct" or "via K" (the run's report)."""
        named = {DIRECT: "direct", REVERSE: "reverse"}
        return {peer: named.get(via, f"via {via}") for peer, via in sorted(self.via.items())}

    def _took(self, peer: int, via: int, ack: pb.Ack) -> pb.Ack:
        if via == DIRECT and peer in self.relay.reverse_clients:
            via = REVERSE
        if self.via.get(peer) != via:  # (a dict lookup per message; the gauge only on a change)
            self.via[peer] = via
            if self.metrics is not None:
                self.metrics.on_peer_via(peer, via)
        return ack

    async def push(self, peer: int, header: pb.TensorHeader, payload: memoryview, reliable: bool,
                   timeout: float, wait_for_ready: bool = True) -> pb.Ack:
        """Deliver header + payload to `peer`, directly or relayed; SendFailure when no way worked."""
        routes = self.routes
        declared = routes.declared(peer)
        if declared is not None:
            return self._took(peer, declared[0],
                              await self._hop(declared, peer, header, payload, reliable, timeout, wait_for_ready))
        failure: SendFailure | None = None
        if self._behind_another_nat(peer):
            # never reached directly (nor down the stream it opened): relay this message, and find
            # out off its path whether a direct link works (a LAN neighbour), instead of waiting out
            # a connect that another NAT swallows (seconds, again each retry_after)
            self._probe_direct(peer)
        elif routes.direct_ok(peer):
            # Detecting unreachable peers: fail fast on a refused connect when a relay is there to try.
            fast = routes.detects(peer) and bool(routes.candidates(peer))
            try:
                ack = await self._hop((), peer, header, payload, reliable, timeout, wait_for_ready and not fast)
                routes.mark_reached(peer)
                return self._took(peer, DIRECT, ack)
            except LinkUnreachable as exc:
                failure = exc
            except SendFailure as exc:
                if not (fast and exc.kind.no_connection):
                    raise
                failure = exc
            routes.mark_unreachable(peer)
            log.info("node %d: peer %d unreachable directly (%s); relaying for %.0fs", self.rank, peer,
                     describe(failure), routes.retry_after)
        candidates = routes.candidates(peer, header.message_id)
        if failure is None and not candidates:  # down earlier, no relay now: maybe the link healed
            ack = await self._hop((), peer, header, payload, reliable, timeout, wait_for_ready)
            routes.mark_reached(peer)
            return self._took(peer, DIRECT, ack)
        for i, via in enumerate(candidates):
            last = i == len(candidates) - 1
            try:
                ack = await self._hop((via,), peer, header, payload, reliable, timeout,
                                      wait_for_ready and (last or not routes.detects(peer)))
            except LinkUnreachable as exc:
                routes.mark_unreachable(via)
                failure = exc
                continue
            except SendFailure as exc:
                if exc.kind is FailureKind.TIMEOUT:
                    routes.demote(via)  # stalled? the retry (same message id) takes the next relay
                if last or not exc.kind.no_connection:
                    raise
                routes.mark_unreachable(via)
                failure = exc
                continue
            if ack.status == pb.Ack.STATUS_REJECTED and ack.reason == RELAY_UNREACHABLE and not last:
                continue  # this relay cannot reach the peer either: nothing delivered, try the next
            return self._took(peer, via, ack)
        raise failure if failure is not None else SendFailure(FailureKind.UNREACHABLE,
                                                              f"node {self.rank}: no relay to reach {peer}")

    async def close(self) -> None:
        """Stop the background connects (before the channels close)."""
        for task in list(self._probes):
            task.cancel()
        await asyncio.gather(*self._probes, return_exceptions=True)

    def _behind_another_nat(self, peer: int) -> bool:
        routes = self.routes
        return (peer in routes.private and not routes.reached(peer) and peer not in self.relay.reverse_clients
                and bool(routes.candidates(peer)))

    def _probe_direct(self, peer: int) -> None:
        """Connect to `peer` directly in the background (at most once per retry_after): reached,
        it is sent to directly from then on; else its direct link is marked down again."""
        routes = self.routes
        if peer in self._probing or not routes.direct_ok(peer):
            return
        self._probing.add(peer)

        async def probe() -> None:
            try:
                if await self.relay.connects(peer, PROBE_SECONDS):
                    routes.mark_reached(peer)
                    log.info("node %d: private peer %d is reachable directly (a LAN neighbour)", self.rank, peer)
                else:
                    routes.mark_unreachable(peer)
            finally:
                self._probing.discard(peer)
        self._probes.add(task := asyncio.ensure_future(probe()))
        task.add_done_callback(self._probes.discard)

    async def _hop(self, route: tuple[int, ...], peer: int, header: pb.TensorHeader, payload: memoryview,
                   reliable: bool, timeout: float, wait_for_ready: bool) -> pb.Ack:
        del header.route[:]
        header.route.extend(route)
        hop = route[0] if route else peer
        if self.links is not None:  # before either data plane: the emulated link applies to both
            await self.links.emulate(hop, len(payload), reliable)
        if route:  # relayed hops always go by gRPC: a relay pipes PushTensor streams on
            return await self.relay.push(hop, header, payload, timeout, wait_for_ready)
        return await self._direct(hop, header, payload, timeout, wait_for_ready)

    async def _direct(self, peer: int, header: pb.TensorHeader, payload: memoryview, timeout: float,
                      wait_for_ready: bool) -> pb.Ack:
        """By the first path that can carry it, at most IN_FLIGHT_PER_PEER at a time (more would be
        refused as too_many_streams by a receiver's default limit)."""
        deadline = time.monotonic() + timeout
        slots = self._slots.setdefault(peer, asyncio.Semaphore(IN_FLIGHT_PER_PEER))
        try:
            async with asyncio.timeout(timeout):
                await slots.acquire()
        except TimeoutError:
            raise SendFailure(FailureKind.TIMEOUT, f"node {self.rank}: {IN_FLIGHT_PER_PEER} messages to node "
                                                   f"{peer} in flight for {timeout:.3g} s") from None
        try:
            unavailable = None
            for path in self.paths:
                try:
                    return await path.push(peer, header, payload, max(0.05, deadline - time.monotonic()),
                                           wait_for_ready)
                except PathUnavailable as exc:
                    unavailable = exc  # nothing was sent: the next path may carry it
            raise unavailable or PathUnavailable(f"node {self.rank}: no path to node {peer}")
        finally:
            slots.release()


__all__ = ["Router", "IN_FLIGHT_PER_PEER"]
