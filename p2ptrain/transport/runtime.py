"""The Transport of one node: the facade the rest of p2ptrain uses to move tensors between peers.

It composes the parts and bridges threads, nothing more: the loop thread (loop.py) owns every grpc.aio
object and the TCP lane; the server (server.py) and the lane (lane.py) receive into the Inbox
(inbox.py); sending.py pushes, retries and settles; relay.py picks direct or relayed routes and
dataplane.py the lane or gRPC for a direct one; peers.py does the Hello protocol; membership.py
judges who is alive. The training thread talks to the Transport only through the blocking /
future-returning methods below. It never knows what an algorithm means by a tensor.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import time

import grpc
import torch

from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.addresses import split_address
from p2ptrain.transport.client import ChannelPool
from p2ptrain.transport.dataplane import DirectPath
from p2ptrain.transport.errors import PeerError, PeerUnreachable
from p2ptrain.transport.faults import EmulatedLinks
from p2ptrain.transport.framing import check_chunk_bytes
from p2ptrain.transport.health import ServingStatus
from p2ptrain.transport.inbox import Inbox
from p2ptrain.transport.lane import LaneClient, LaneServer
from p2ptrain.transport.loop import LoopThread
from p2ptrain.transport.membership import Membership
from p2ptrain.transport.message import Message
from p2ptrain.transport.options import TransportOptions
from p2ptrain.transport.peers import ClusterSurvey, Peers
from p2ptrain.transport.relay import Relay
from p2ptrain.transport.sending import Sender
from p2ptrain.transport.server import SERVICE_NAME, Identity, PeerService, serve
from p2ptrain.transport.tuning import tune_process_for_transfer


class Transport:
    """Tensor push/receive for node `rank` of `world_size`; peers[i] is node i's address. peers=None:
    addresses learned after start (`set_peer_addresses`, from a rendezvous); `listen` is then required."""

    def __init__(self, rank: int, world_size: int, peers: list[str] | None, *, listen: str | None = None,
                 options: TransportOptions | None = None, metrics=None, config_fingerprint: str = ""):
        if peers is None and not listen:
            raise ValueError("without peer addresses (learned after start) give the listen address")
        if peers is not None and len(peers) != world_size:
            raise ValueError(f"need one address per node: {len(peers)} addresses for world size {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside 0..{world_size - 1}")
        self.rank = rank
        self.world_size = world_size
        self.peers = list(peers) if peers is not None else [""] * world_size
        self.options = options = options or TransportOptions()
        check_chunk_bytes(options.chunk_bytes)
        self.listen = listen or f"[::]:{self.peers[rank].rsplit(':', 1)[1]}"
        self.metrics = metrics
        self.identity = Identity(rank, world_size, config_fingerprint)
        self.inbox = Inbox(rank, world_size, step_window=options.step_window, pin_memory=options.pin_memory)
        self.membership = Membership(rank, world_size, metrics, max_lag=options.max_lag)
        self.membership.on_change = lambda: self.inbox.wake()  # stop waiting for a peer declared dead
        self.inbox.on_deliver = self.membership.heard_from
        self.inbox.excluded = self.membership.dead
        self.port: int | None = None
        self.health: ServingStatus | None = None  # grpc.health.v1 answer: SERVING once ready (health.py)
        self._server: grpc.aio.Server | None = None
        self._bridge = LoopThread(f"p2ptrain-comm-{rank}", f"node {rank} transport")
        links = options.links
        self._links = links if links is not None and not links.is_noop else None  # None: no emulation cost
        self._emulation = EmulatedLinks(self._links, rank, metrics) if self._links is not None else None
        self._channels = ChannelPool(self.peers, options.channel_options(), options.chunk_bytes, options.security)
        self._lanes = LaneClient(rank, options.security) if options.data_plane != "grpc" else None
        self._lane_server: LaneServer | None = None
        self._direct = DirectPath(rank, options.data_plane, self._channels, self._lanes,
                                  discovery_timeout=options.probe_timeout, retry_after=options.relay_retry_after,
                                  metrics=metrics)
        self._relay = Relay(rank, world_size, options, self._channels, self._emulation, metrics=metrics,
                            direct=self._direct)
        self._peers = Peers(self.identity, self.peers, self._bridge, self._channels, self.membership,
                            self._relay.table, probe_timeout=options.probe_timeout, direct=self._direct,
                            initial_members=options.initial_members)
        self._direct.hello = self._peers.hello
        self.views = self._peers.views  # who trains together from which step (views.py)
        self.membership.is_member = lambda peer: peer in self.views.latest.members
        self.membership.joins_later = lambda peer: self.views.member_since(peer) > 0
        self._sender = Sender(rank, world_size, options, self._bridge, self._channels, self._relay, self._peers,
                              self.membership, metrics)

    # Lifecycle ------------------------------------------------------------------------------
    def start(self, timeout: float = 30.0) -> "Transport":
        tune_process_for_transfer()
        self._bridge.start(self._start_server, timeout)  # re-raises a bind failure here
        return self

    async def _start_server(self) -> None:
        peers, membership = self._peers, self.membership
        service = PeerService(self.inbox, self.identity, self.metrics, current_step=lambda: membership.step,
                              is_ready=lambda: peers.ready, on_peer_ready=peers.ready_peers.add,
                              on_hello=peers.on_hello, excludes=membership.excludes,
                              incarnation=lambda: peers.incarnation, lane_port=lambda: self._direct.port,
                              view=lambda: peers.views.latest.to_proto())
        service.forwarder = self._relay  # streams addressed to another node are piped on (relay.py)
        if self._lanes is not None:  # listening before any Hello can advertise it
            self._direct.port = await self._start_lane(service)
        try:
            self._server, self.health, port = await serve(
                service.handler(), SERVICE_NAME, listen=self.listen, options=self.options.server_options(),
                security=self.options.security, metrics=self.metrics, serving=self._peers.ready)
            if port == 0:
                raise PeerError(f"node {self.rank} could not listen on {self.listen}")
        except BaseException:
            if self._lane_server is not None:  # give its port back: this node does not start
                await self._lane_server.stop()
            raise
        self.port = port

    async def _start_lane(self, service: PeerService) -> int:
        """Listen for lane connections on the gRPC listen host; the port (0: no lane here)."""
        address = split_address(self.listen)
        if address is None:
            if self.options.data_plane == "tcp":
                raise PeerError(f"node {self.rank}: data_plane=tcp needs a host:port listen address, not "
                                f"{self.listen!r}")
            return 0
        self._lane_server = LaneServer(service, self.options.security)
        peer_ports = frozenset(a[1] for a in map(split_address, self.peers) if a is not None)
        return await self._lane_server.start(address[0], self.options.lane_port, avoid=peer_ports)

    @property
    def lane_port(self) -> int:
        """The port of this node's TCP lane (advertised in Hello); 0 when it offers none."""
        return self._direct.port

    def set_peer_addresses(self, addresses: list[str]) -> None:
        """Every node's address, in rank order, learned once this server is bound (a rendezvous
        publishes `self.port`); call before anything is sent or greeted."""
        if len(addresses) != self.world_size:
            raise ValueError(f"need one address per node: {len(addresses)} addresses for world size "
                             f"{self.world_size}")
        self._channels.set_addresses(addresses)
        self.peers[:] = addresses  # in place: Peers (Hello messages) shares this list

    def stop(self) -> None:
        """Graceful: in-flight RPCs get `shutdown_grace` seconds, then channels close."""
        async def shutdown() -> None:
            if self.health is not None:
                await self.health.drain()  # NOT_SERVING before the grace period: probes stop routing here
            if self._server is not None:
                await self._server.stop(self.options.shutdown_grace)
            if self._lane_server is not None:  # (its messages in flight had the grace period too)
                await self._lane_server.stop()
            if self._lanes is not None:
                await self._lanes.close()
            await self._channels.close()
            if self._emulation is not None:
                self._emulation.cancel()
            self._sender.abandon_unsettled()

        self._bridge.stop(shutdown, self.options.shutdown_grace)

    def __enter__(self) -> "Transport":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # Bridge ---------------------------------------------------------------------------------
    def call_soon(self, fn, *args) -> None:
        """Run fn(*args) on the transport's loop thread (e.g. tests freezing it as SIGSTOP would)."""
        self._bridge.call_soon(fn, *args)

    def _submit(self, coro) -> concurrent.futures.Future:  # (tests reach the loop through these)
        return self._bridge.submit(coro)

    @staticmethod
    async def _call(fn, *args, **kwargs):
        return fn(*args, **kwargs)

    @property
    def _loop(self) -> asyncio.AbstractEventLoop | None:
        return self._bridge.loop

    @property
    def _thread(self):
        return self._bridge.thread

    @property
    def _ids(self):
        return self._sender.message_ids

    # Sending --------------------------------------------------------------------------------
    def send(self, peer: int, tensor: torch.Tensor, *, kind: int, step: int, ps_weight: float = 0.0,
             relay_count: float = 0.0, channel: str = "", codec: int = pb.CODEC_NONE,
             codec_params: tuple[float, ...] = (), dtype: torch.dtype | None = None,
             numel: int | None = None, shape: tuple[int, ...] | None = None,
             reliable: bool = False, settle: bool = False) -> concurrent.futures.Future:
        """Push `tensor` to `peer`; a future of its Ack (see sending.Sender.send for `reliable`,
        `settle` and codec payloads). Ownership of `tensor` passes until the future is done."""
        return self._sender.send(peer, tensor, kind=kind, step=step, ps_weight=ps_weight, relay_count=relay_count,
                                 channel=channel, codec=codec, codec_params=codec_params, dtype=dtype,
                                 numel=numel, shape=shape, reliable=reliable, settle=settle)

    def outstanding(self, peer: int) -> list[concurrent.futures.Future]:
        """Futures of our sends to `peer` not acknowledged yet, oldest first."""
        return self._sender.outstanding(peer)

    # Receiving --------------------------------------------------------------------------------
    def expect(self, kind: int, dtype: torch.dtype, numel: int, **kwargs) -> None:
        """Declare an accepted message kind (see Inbox.expect); call before peers send."""
        self._bridge.call(functools.partial(self.inbox.expect, kind, dtype, numel, **kwargs))

    def unexpect(self, kind: int, channel: str | None = None) -> None:
        """Stop accepting `kind` (Inbox.unexpect)."""
        self._bridge.call(self.inbox.unexpect, kind, channel)

    def set_step(self, step: int) -> None:
        """The node's current step: the centre of the accepted step window."""
        self.membership.step = step
        self._peers.pace.note(step)
        if self._bridge.started:
            self._bridge.call_soon(self.inbox.set_step, step)

    def recv(self, kind: int, step: int, senders: list[int], *, timeout: float | None = None,
             channel: str = "") -> dict[int, Message]:
        """Block until each sender's step-`step` message of `kind` arrived; raises TimeoutError."""
        if not senders:
            return {}
        return self._bridge.submit(self.inbox.wait_for(kind, step, list(senders), channel, timeout)).result()

    def gather(self, kind: int, step: int, senders: list[int], *, channel: str = "",
               deadline: float | None = None) -> dict[int, Message]:
        """The step-`step` messages of the senders worth waiting for (membership.awaited), waiting
        at most `deadline` (default options.link_deadline) seconds. A sender that missed it counts
        as a dropped link for this step (its message is folded in later, if it comes) and gets a
        Hello probe: one that does not answer is declared dead and not waited for again."""
        awaited = self.membership.awaited(senders, step)
        if not awaited:
            return {}
        timeout = self.options.link_deadline if deadline is None else deadline
        return self._bridge.submit(self._gather(kind, step, awaited, channel, timeout)).result()

    async def _gather(self, kind: int, step: int, senders: list[int], channel: str,
                      timeout: float) -> dict[int, Message]:
        got = await self.inbox.wait_for(kind, step, senders, channel, timeout, partial=True)
        for peer in senders:
            if peer not in got and self.membership.alive(peer):
                if self.metrics is not None:
                    self.metrics.on_link_timeout(peer)
                self._bridge.spawn(self._peers.probe(peer))
        return got

    def take(self, kind: int, max_step: int, channel: str = "") -> list[Message]:
        """Messages of `kind` with step <= max_step that already arrived (non-blocking)."""
        return self._bridge.call(self.inbox.take, kind, max_step, channel)

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

    # Peers ------------------------------------------------------------------------------------
    @property
    def incarnation(self) -> int:
        """New at every start and every completed rejoin (peers.py)."""
        return self._peers.incarnation

    @property
    def resume_step(self) -> int:
        """The step a rejoined node resumes at (sent in its Hellos)."""
        return self._peers.resume_step

    def hello(self, peer: int, timeout: float = 10.0) -> pb.HelloReply:
        return self._bridge.submit(self._peers.hello(peer, timeout)).result(timeout + 5)

    def probe(self, peer: int) -> bool:
        """Hello `peer` once without waiting for a connection; declares it dead if it does not answer."""
        return self._bridge.submit(self._peers.probe(peer)).result(self.options.probe_timeout + 10)

    def wait_for_peers(self, timeout: float = 60.0, *, require_ready: bool = False) -> None:
        """Hello every peer until it is up (and ready, with require_ready); PeerError otherwise
        (see Peers.wait_for_peers)."""
        self._peers.wait_for_peers(timeout, require_ready=require_ready)

    def wait_for_step(self, step: int, timeout: float = 60.0) -> None:
        """Wait until every live peer reports a current step >= `step` (Peers.wait_for_step)."""
        self._peers.wait_for_step(step, timeout)

    def survey(self, timeout: float = 2.0) -> ClusterSurvey:
        """How many peers answer a Hello, and whether the cluster already runs (Peers.survey)."""
        return self._peers.survey(timeout)

    def cluster_running(self, timeout: float = 2.0) -> bool:
        return self.survey(timeout).running

    @property
    def ready(self) -> bool:
        """mark_ready() was called: this node accepts tensors."""
        return self._peers.ready

    def mark_ready(self) -> None:
        """Tell peers (through Hello) and health probes that this node now accepts tensors."""
        self._peers.ready = True
        if self.health is not None:
            self.health.set_serving(True)

    def announce_ready(self) -> int:
        """Tell every peer (one Hello each, failures ignored) that this node is ready again; returns
        the step it resumes at: `resume_step`, or the furthest step a peer is at when it learns, if
        the cluster moved on while this node fetched and loaded its state. Nobody sent it anything
        for the steps in between, so running them would only push mass out (SGP: w halves with
        every step that brings nothing in); and a peer of a lockstep ring (AllReduce, Pipe-SGD)
        that reports step s is inside step s, waiting for this node's share of it, so s (not s + 1)
        keeps the ring's rounds aligned."""
        steps = self._peers.announce_ready()
        if steps and max(steps) > self._peers.resume_step:
            self.resume_at(max(steps))
        return self._peers.resume_step

    def resume_at(self, step: int) -> None:
        """A rejoined node continues at `step`: centre its step window there and say so in Hellos."""
        self._peers.resume_step = step
        self.set_step(step)

    def rejoined(self, step: int) -> int:
        """A state transfer completed: resume at `step` or later (announce_ready) as a new
        incarnation (so peers that declared this node dead take it back) and tell every peer once
        this node is ready (a restarted node announces after its setup). Returns the step."""
        self._peers.rejoined()
        self.resume_at(step)
        return self.announce_ready() if self._peers.ready else step

    # Elastic membership (views.py) ---------------------------------------------------------------
    def propose_view(self, members) -> int:
        """Propose that `members` train together from a step `view_margin` past the furthest step
        known of any member, and tell every old and new member; returns the switch step in force
        (see Peers.propose_view)."""
        return self._peers.propose_view(members, self.options.view_margin, self.options.view_notice)

    def joining(self, peer: int) -> bool:
        """`peer` is not a member of the latest view: it joins (a state request from it is served)."""
        return self._peers.joining(peer)

    def request_state(self, timeout: float) -> int:
        """Ask live peers for their model state until a ready one accepts; returns its rank (the
        state arrives as a MESSAGE_KIND_STATE push; see Peers.request_state)."""
        return self._peers.request_state(timeout)

    def has_state_requests(self) -> bool:
        return self._peers.has_state_requests()

    def take_state_requests(self) -> list[int]:
        """Peers that asked (in a Hello) for our model state since the last call."""
        return self._peers.take_state_requests()


# TransportOptions and the errors are imported from here too (node.py, train/loop.py, tests).
__all__ = ["Transport", "TransportOptions", "PeerError", "PeerUnreachable", "ClusterSurvey"]
