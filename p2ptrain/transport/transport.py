"""The Transport of one node: moving tensors between peers, composed of named parts.

The loop thread (loop_thread.py) owns every gRPC object and the TCP lane. Receiving: the gRPC
service (server.py) and the lane (lane_server.py) feed the Inbox through one set of Answers
(reception.py); streams for another node go to the Forwarder. Sending: the Sender (ids, retries,
settling) asks the Router (paths/) which path a message takes. `membership` says who the members
are and who is alive. The training thread uses the blocking or future-returning methods below and
the parts themselves; the transport never knows what an algorithm means by a tensor.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Callable

import torch

from p2ptrain.addresses import split_address
from p2ptrain.settings.parsers import parse_relay_routes, parse_relays
from p2ptrain.transport import reachability
from p2ptrain.transport.errors import PeerError
from p2ptrain.transport.faults import EmulatedLinks
from p2ptrain.transport.forwarding import Forwarder
from p2ptrain.transport.framing import check_chunk_bytes
from p2ptrain.transport.hangups import Hangups
from p2ptrain.transport.health import ServingStatus
from p2ptrain.transport.inbox import Inbox
from p2ptrain.transport.lane_server import LaneServer
from p2ptrain.transport.loop_thread import LoopThread
from p2ptrain.transport.membership import Identity, Membership
from p2ptrain.transport.membership.greetings import Greetings
from p2ptrain.transport.membership.liveness import Liveness
from p2ptrain.transport.membership.views import Views
from p2ptrain.transport.message import Message
from p2ptrain.transport.options import TransportOptions
from p2ptrain.transport.paths.grpc_path import SERVICE_NAME, GrpcPath
from p2ptrain.transport.paths.lane_path import LanePath, LanePorts
from p2ptrain.transport.paths.reverse import ReverseLink
from p2ptrain.transport.paths.router import Router
from p2ptrain.transport.peer_identity import certified_server, identity_check
from p2ptrain.transport.reception import Answers
from p2ptrain.transport.routes import RouteTable
from p2ptrain.transport.sending import Sender
from p2ptrain.transport.server import PeerService, serve
from p2ptrain.transport.tuning import tune_process_for_transfer

WATCH_INTERVAL = 0.05  # seconds between re-checks of a gather that may be abandoned


log = logging.getLogger(__name__)

REVERSE_LINGER = 8.0  # seconds a node waits at its stop for the private peers that reach others through it
INDIRECT_PROBES = 2  # meeting neighbours: peers asked to probe one that does not answer (SWIM ping-req)

class Transport:
    """Tensor push/receive for node `rank` of `world_size`; peers[i] is node i's address. peers=None:
    addresses learned after start (`set_peer_addresses`, from a rendezvous); `listen` is then required.
    `loop`: run on that LoopThread's loop, shared with other nodes (a simulation), not on a thread of its own;
    `local`: those nodes' services (paths/local_calls.LocalServices), called in-process instead of by gRPC."""

    def __init__(self, rank: int, world_size: int, peers: list[str] | None, *, listen: str | None = None,
                 options: TransportOptions | None = None, metrics=None, config_fingerprint: str = "",
                 loop: LoopThread | None = None, local=None):
        if peers is None and not listen:
            raise ValueError("without peer addresses (learned after start) give the listen address")
        if peers is not None and len(peers) != world_size:
            raise ValueError(f"need one address per node: {len(peers)} addresses for world size {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside 0..{world_size - 1}")
        self.rank = rank
        self.world_size = world_size
        self.options = options = options or TransportOptions()
        check_chunk_bytes(options.chunk_bytes)
        self.metrics = metrics
        what = f"node {rank} transport"  # (`loop`: run on that loop, shared with others: a simulation's nodes)
        self.loop = loop.share(what) if loop is not None else LoopThread(f"p2ptrain-comm-{rank}", what)
        addresses = list(peers) if peers is not None else [""] * world_size
        self.listen = listen or f"[::]:{addresses[rank].rsplit(':', 1)[1]}"
        self.port: int | None = None
        self.health: ServingStatus | None = None  # grpc.health.v1 answer: SERVING once ready (health.py)
        self.lane_server: LaneServer | None = None
        # Under mutual TLS with identity certificates: whose claims each connection may make (SecurityError
        # here when our own certificate names another node).
        self.identity = identity_check(options.security, rank)
        self._server = None  # the gRPC server (server.serve), made on the loop thread
        self.service: PeerService | None = None  # its Peer service (answers calls down reverse streams too)
        self.reverse_links: dict[int, ReverseLink] = {}  # a private node's streams to its peers (reverse.py)
        self._reachability_found = False

        # Paths out: gRPC always, the lane unless data_plane is grpc, through emulated links if any.
        links = options.links if options.links is not None and not options.links.is_noop else None
        self.links = EmulatedLinks(links, rank, metrics) if links is not None else None
        self.grpc = GrpcPath(addresses, options.channel_options(), options.chunk_bytes, options.security, rank,
                            metrics=metrics)
        # (only where no token or node identity is to be checked: those need the real call)
        self.local = local if loop is not None and self.identity is None and not options.security.token else None
        self.grpc.local = self.local
        self.lane_ports = LanePorts(rank, required=options.data_plane == "tcp", retry_after=options.relay_retry_after) \
            if options.data_plane != "grpc" else None
        self.routes = RouteTable(rank, world_size, parse_relay_routes(options.relay_routes, world_size),
                                 parse_relays(options.relays, world_size), retry_after=options.relay_retry_after,
                                 blocked=self.links.blocked if self.links is not None else (lambda peer: False))

        # Who the members are.
        initial = range(world_size if options.initial_members is None else options.initial_members)
        views = Views(rank, tuple(initial), world_size)
        liveness = Liveness(rank, world_size, views, metrics, max_lag=options.max_lag)
        greetings = Greetings(Identity(rank, world_size, config_fingerprint), self.loop, self.grpc, liveness, views,
                              self.routes, probe_timeout=options.probe_timeout, lane_ports=self.lane_ports,
                              metrics=metrics, indirect_probes=INDIRECT_PROBES if options.meet == "neighbours" else 0)
        self.membership = Membership(views, liveness, greetings, view_margin=options.view_margin,
                                     view_notice=options.view_notice)
        self.dial_back = reachability.DialBack(rank, self.grpc, self.lane_ports, options.security,
                                               hello=greetings.hello_request, timeout=options.probe_timeout)
        if world_size > 1:
            greetings.check_reachability = self.check_reachability  # (as soon as peers answer: wait_for_peers)

        # Receiving, forwarding, sending.
        self.inbox = Inbox(rank, world_size, liveness, step_window=options.step_window, pin_memory=options.pin_memory)
        liveness.subscribe(self.inbox.wake)  # stop waiting for a peer declared dead
        self.hangups = Hangups(self.loop, self.inbox.awaited, greetings.check_gone)  # (a dead one: at once)
        self.answers = Answers(rank, self.inbox, liveness, metrics)
        self.forwarder = Forwarder(rank, world_size, self.grpc, send_timeout=options.send_timeout, links=self.links,
                                   metrics=metrics)
        self.lanes = LanePath(rank, options.security, self.lane_ports, addresses, greetings,
                              discovery_timeout=options.probe_timeout, metrics=metrics,
                              shared_memory=options.shared_memory) if self.lane_ports else None
        paths = [path for path in (self.lanes, self.grpc) if path is not None]  # tried in this order
        self.router = Router(rank, paths, self.grpc, self.routes, links=self.links, metrics=metrics)
        self.sender = Sender(rank, world_size, options, self.loop, self.router, self.grpc, greetings, liveness,
                             metrics)
        self.membership.outstanding = self.sender.outstanding  # (finish: acks before "finished")
        self.membership.sent_to = self.sender.sent_to          # (finish: whom to tell)

    # Lifecycle ------------------------------------------------------------------------------
    def start(self, timeout: float = 30.0) -> "Transport":
        tune_process_for_transfer()
        self.loop.start(self._start_server, timeout)  # re-raises a bind failure here
        return self

    async def _start_server(self) -> None:
        self.service = service = PeerService(
            self.answers, self.membership.greetings, self.world_size, self.forwarder, identity=self.identity,
            dial_back=self.dial_back, reverse_clients=self.grpc.reverse_clients, chunk_bytes=self.options.chunk_bytes)
        if self.lane_ports is not None:  # listening before any Hello can advertise it
            self.membership.greetings.lane_port = await self._start_lane()
        try:
            self._server, self.health, port = await serve(
                service.handler(), SERVICE_NAME, listen=self.listen, options=self.options.server_options(),
                security=self.options.security, metrics=self.metrics, serving=self.membership.greetings.ready,
                name=str(self.rank))
            if port == 0:
                raise PeerError(f"node {self.rank} could not listen on {self.listen}")
        except BaseException:
            if self.lane_server is not None:  # give its port back: this node does not start
                await self.lane_server.stop()
            raise
        self.port = port
        if self.local is not None and self.grpc.addresses[self.rank]:
            self.local.register(self.grpc.addresses[self.rank], service)

    async def _start_lane(self) -> int:
        """Listen for lane connections on the gRPC listen host; the port (0: no lane here)."""
        address = split_address(self.listen)
        if address is None:
            if self.options.data_plane == "tcp":
                raise PeerError(f"node {self.rank}: data_plane=tcp needs a host:port listen address, not "
                                f"{self.listen!r}")
            return 0
        self.lane_server = LaneServer(self.answers, self.world_size, self.options.security, identity=self.identity,
                                      hangups=self.hangups, shared_memory=self.options.shared_memory)
        peer_ports = frozenset(a[1] for a in map(split_address, self.grpc.addresses) if a is not None)
        return await self.lane_server.start(address[0], self.options.lane_port, avoid=peer_ports)

    @property
    def lane_port(self) -> int:
        """The port of this node's TCP lane (advertised in Hello); 0 when it offers none."""
        return self.membership.greetings.lane_port

    @property
    def peers(self) -> list[str]:
        """Every node's address, in rank order ("" for a joiner not heard of yet)."""
        return self.grpc.addresses

    def check_reachability(self) -> str:
        """Whether peers can dial this node (reachability.py): asked of peers it reached when
        `options.reachability` is auto, else taken from it; said in every Hello from now on.
        Returns "public", "private" or "unknown" (nobody could tell)."""
        greetings = self.membership.greetings
        if self._reachability_found:  # (wait_for_peers asked already)
            return reachability.SHOWN[greetings.reachability]
        found = reachability.NAMES[self.options.reachability]
        helpers = reachability.far_first([p for p in greetings.reached if p not in self.routes.private],
                                         self.grpc.addresses, self.rank, self.world_size)  # (private: no dial-back)
        notes: list[str] = []
        if found == reachability.NAMES["auto"] and helpers:
            found, notes = self.loop.submit(reachability.ask(self.grpc, helpers, self.rank, greetings.incarnation,
                                                             2 * self.dial_back.timeout + 5)).result()
        greetings.reachability = found
        self._reachability_found = found != reachability.NAMES["auto"]  # (unknown: ask again later)
        if self.metrics is not None:
            self.metrics.on_reachability(found)
        shown = reachability.SHOWN[found]
        if found == reachability.NAMES["private"]:
            self.loop.call(self._reach_out)
        if found == reachability.NAMES["private"] and notes:
            log.warning("node %d: peers cannot dial this node at %s (private: behind NAT or a firewall?): %s",
                        self.rank, self.grpc.addresses[self.rank], "; ".join(notes)[:500])
        else:
            log.info("node %d: reachability %s%s", self.rank, shown, f" ({'; '.join(notes)[:300]})" if notes else "")
        return shown

    def _reach_out(self) -> None:
        """Private: peers cannot dial this node, so it keeps a Reverse stream open to each peer it
        reached (now, and each one it reaches later), and they make their calls down it
        (reverse.py). Its lane is no longer offered (a connect to it would only wait out a
        timeout); the next Hellos say so."""
        greetings = self.membership.greetings
        greetings.lane_port = 0
        greetings.reach_out = self._open_reverse
        for peer in sorted(greetings.reached):
            self._open_reverse(peer)
            self.loop.spawn(greetings.hello(peer, self.options.probe_timeout, wait_for_ready=False))

    def _open_reverse(self, peer: int) -> None:
        """(On the loop thread.) A Reverse stream to `peer`, kept open from now on."""
        if peer not in self.reverse_links and self.grpc.addresses[peer]:
            greetings = self.membership.greetings
            link = self.reverse_links[peer] = ReverseLink(self.rank, peer, lambda: self.grpc.direct_client(peer),
                                                          self.service, lambda: greetings.incarnation,
                                                          certify=lambda: self._certified(peer))
            link.start()

    async def _certified(self, peer: int) -> bytes | None:
        """The certificate of the server a reverse stream to `peer` would open to, checked to name
        `peer` (None without node identity): the calls that come down it are judged as `peer`'s."""
        if self.identity is None:
            return None
        return await asyncio.get_running_loop().run_in_executor(
            None, certified_server, self.options.security, self.grpc.addresses[peer], peer,
            max(reachability.DIAL_SECONDS, self.options.probe_timeout))

    def set_peer_addresses(self, addresses: list[str]) -> None:
        """Every node's address, in rank order, learned once this server is bound (a rendezvous
        publishes `self.port`); call before anything is sent or greeted."""
        if len(addresses) != self.world_size:
            raise ValueError(f"need one address per node: {len(addresses)} addresses for world size "
                             f"{self.world_size}")
        self.grpc.set_addresses(addresses)

    def mark_ready(self) -> None:
        """Tell peers (through Hello) and health probes that this node now accepts tensors."""
        self.membership.greetings.ready = True
        if self.health is not None:
            self.health.set_serving(True)

    def stop(self) -> None:
        """Graceful: in-flight RPCs get `shutdown_grace` seconds, then channels close."""
        async def shutdown() -> None:
            if self.local is not None and self.service is not None:  # (calls to it go by gRPC from now on)
                self.local.unregister(self.grpc.addresses[self.rank], self.service)
            for link in self.reverse_links.values():
                await link.stop()
            await self.router.close()
            # Private peers reach others through this node (their streams, relays): it stays until
            # they have stopped too (their streams close), at most REVERSE_LINGER seconds.
            lingered = time.monotonic() + REVERSE_LINGER
            while any(not c.closed for c in self.grpc.reverse_clients.values()) and time.monotonic() < lingered:
                await asyncio.sleep(0.05)
            for client in list(self.grpc.reverse_clients.values()):  # (their Reverse calls end now, not cut)
                client.close()
            if self.grpc.reverse_clients:
                await asyncio.sleep(0.05)
            if self.health is not None:
                await self.health.drain()  # NOT_SERVING before the grace period: probes stop routing here
            if self._server is not None:
                await self._server.stop(self.options.shutdown_grace)
            if self.lane_server is not None:  # (its messages in flight had the grace period too)
                await self.lane_server.stop()
            if self.lanes is not None:
                await self.lanes.close()
            await self.grpc.close()
            if self.links is not None:
                self.links.cancel()
            self.sender.abandon_unsettled()

        self.loop.stop(shutdown, self.options.shutdown_grace)

    def __enter__(self) -> "Transport":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def run_on_loop(self, fn, *args):
        """fn(*args) run on the transport's loop thread, where its state lives; the result."""
        return self.loop.call(fn, *args)

    # Receiving --------------------------------------------------------------------------------
    def expect(self, kind: int, dtype: torch.dtype, numel: int, **kwargs) -> None:
        """Declare an accepted message kind (see Inbox.expect); call before peers send."""
        self.loop.call(functools.partial(self.inbox.expect, kind, dtype, numel, **kwargs))

    def unexpect(self, kind: int, channel: str | None = None) -> None:
        """Stop accepting `kind` (Inbox.unexpect)."""
        self.loop.call(self.inbox.unexpect, kind, channel)

    def receive_into(self, sender: int, kind: int, step: int, buffer: torch.Tensor | None, channel: str = "") -> None:
        """Land that message in `buffer`, or forget it with None (see Inbox.receive_into)."""
        self.loop.call(self.inbox.receive_into, sender, kind, channel, step, buffer)

    def recv(self, kind: int, step: int, senders: list[int], *, timeout: float | None = None,
             channel: str = "") -> dict[int, Message]:
        """Block until each sender's step-`step` message of `kind` arrived; raises TimeoutError."""
        if not senders:
            return {}
        return self.loop.submit(self.inbox.wait_for(kind, step, list(senders), channel, timeout)).result()

    def gather(self, kind: int, step: int, senders: list[int], *, channel: str = "",
               deadline: float | None = None, abandon: Callable[[], str | None] | None = None,
               laggards: bool = False) -> dict[int, Message]:
        """The step-`step` messages of the senders worth waiting for (Liveness.awaited), waiting
        at most `deadline` (default options.link_deadline) seconds. A sender that missed it counts
        as a dropped link for this step (its message is folded in later, if it comes) and gets a
        Hello probe: one that does not answer is declared dead and not waited for again. A sender
        whose lane connections closed is asked at once whether anything still listens at its
        address (hangups.py): a refused connect declares it dead, which ends the wait then.

        `abandon` (run on the loop thread): why waiting on is hopeless, or None. It is checked
        every WATCH_INTERVAL and ends the wait at once (a collective whose ring lost a member).
        During a wait longer than the link deadline, the missing senders are probed every link
        deadline: a dead one is noticed then, not at the end.

        `laggards`: wait for lagging senders too (a ring, which cannot complete without them: not
        waiting would let this node race ahead alone, leaving them further behind)."""
        liveness = self.membership.liveness
        awaited = liveness.awaited(senders, step, laggards=laggards)
        finished = liveness.finished()
        over = [p for p in senders if p in finished and liveness.alive(p)]  # what they sent is here by now
        if not awaited and not over:
            return {}
        timeout = self.options.link_deadline if deadline is None else deadline
        return self.loop.submit(self._gather(kind, step, awaited, channel, timeout, abandon, over)).result()

    async def _gather(self, kind: int, step: int, senders: list[int], channel: str,
                      timeout: float, abandon: Callable[[], str | None] | None = None,
                      over: list[int] = ()) -> dict[int, Message]:
        got = await self.inbox.wait_for(kind, step, list(over), channel, 0, partial=True) if over else {}
        if not senders:
            return got
        self.hangups.waiting(senders)
        if abandon is None and timeout <= self.options.link_deadline:
            got.update(await self.inbox.wait_for(kind, step, senders, channel, timeout, partial=True))
        else:
            got.update(await self._watched_wait(kind, step, senders, channel, timeout, abandon))
        liveness = self.membership.liveness
        for peer in senders:
            if peer not in got and liveness.alive(peer) and peer not in liveness.finished():
                if self.metrics is not None:
                    self.metrics.on_link_timeout(peer)
                self.loop.spawn(self.membership.greetings.probe(peer))
        return got

    async def _watched_wait(self, kind: int, step: int, senders: list[int], channel: str, timeout: float,
                            abandon: Callable[[], str | None] | None) -> dict[int, Message]:
        """Inbox.wait_for in slices of WATCH_INTERVAL (an arrival still ends a slice at once): between
        them `abandon` is asked (it reads state that changes without an arrival: views, send
        outcomes), senders no longer awaited for `step` are dropped (dead, finished, or rejoined
        from a state past it: Liveness.awaited) and, every link deadline, the live senders still
        missing are probed (a dead one is then declared dead, which ends the wait for it)."""
        liveness = self.membership.liveness
        began = probed = time.monotonic()
        got: dict[int, Message] = {}
        missing = list(senders)
        while True:
            left = began + timeout - time.monotonic()
            got.update(await self.inbox.wait_for(kind, step, missing, channel, max(0.0, min(WATCH_INTERVAL, left)),
                                                 partial=True))
            unanswered = [peer for peer in senders if peer not in got and liveness.alive(peer)]
            done = [peer for peer in unanswered if peer in liveness.finished()]  # (said so meanwhile)
            if done:  # everything they sent was acknowledged before they said it: here, or never sent
                got.update(await self.inbox.wait_for(kind, step, done, channel, 0, partial=True))
            # (nor is one that said meanwhile that it resumes past `step`, from another's state)
            missing = liveness.awaited([peer for peer in unanswered if peer not in done], step, laggards=True)
            if not missing or left <= WATCH_INTERVAL or (abandon is not None and abandon() is not None):
                return got
            if time.monotonic() - probed >= self.options.link_deadline:
                probed = time.monotonic()
                for peer in missing:
                    self.loop.spawn(self.membership.greetings.probe(peer))

    def take(self, kind: int, max_step: int, channel: str = "") -> list[Message]:
        """Messages of `kind` with step <= max_step that already arrived (non-blocking). Most calls
        find none (late shares, leavers' mass: twice a push-sum step), and learn so without a
        round trip to the loop thread (Inbox.holds)."""
        if not self.inbox.holds(kind, max_step, channel):
            time.sleep(0)  # (lets the loop thread, if it waits for the GIL, deliver what it has read)
            return []
        return self.loop.call(self.inbox.take, kind, max_step, channel)

    def recv_any(self, kind: int, timeout: float) -> list[Message]:
        """Every message of `kind` that arrived, whatever its step and sender, once there is at least
        one (a state transfer: a donor asked earlier may answer late, and its state is mass too)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            messages = self.take(kind, 2 ** 62)
            if messages:
                return messages
            time.sleep(0.02)
        raise TimeoutError(f"node {self.rank}: nothing of kind {kind} within {timeout:.0f}s")


__all__ = ["Transport"]
