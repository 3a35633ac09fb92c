"""Greetings: what a node learns from and tells its peers through Hello. Start-up (wait_for_peers),
probes of silent peers, surveys of a running cluster, readiness, rejoining, state-transfer requests
and the spreading of membership views.

Liveness (liveness.py) judges who is alive from what Hellos say; views.py holds who trains when;
the lane path learns where each peer's TCP lane listens. This module never sends a tensor, and
reaches peers only through the gRPC path's Hello (every failure a SendFailure).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import random
import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.transport.errors import FailureKind, PeerError, SendFailure, describe
from p2ptrain.transport.loop_thread import LoopThread
from p2ptrain.transport.membership import vetting
from p2ptrain.transport.membership.identity import Identity
from p2ptrain.transport.membership.liveness import Liveness
from p2ptrain.transport.membership.views import MAX_ADDRESS, View, Views, brief, gossip_targets
from p2ptrain.transport.paths.grpc_path import GrpcPath, nothing_listens
from p2ptrain.transport.paths.lane_path import LanePorts
from p2ptrain.transport.routes import RouteTable

log = logging.getLogger(__name__)
MAX_REFUSED_EVICTIONS = 8  # refused evictions remembered (Membership.split_members)


class StepPace:
    """How fast this node's steps go (the last ~32 set_step calls): a view's switch must lie far
    enough ahead that every member hears of it first, in steps as in seconds."""

    def __init__(self, window: int = 32):
        self._times: deque = deque(maxlen=window)

    def note(self, step: int) -> None:
        """Step `step` starts now; a jump (a rejoin resuming further on) starts the pace afresh."""
        if self._times and step != self._times[-1][1] + 1:
            if step <= self._times[-1][1]:
                return
            self._times.clear()
        self._times.append((time.monotonic(), step))

    def seconds_for(self, steps: int) -> float:
        """About how long this node takes for `steps` steps (0.0 before it has a pace)."""
        if len(self._times) < 2:
            return 0.0
        (t0, s0), (t1, s1) = self._times[0], self._times[-1]
        return steps * (t1 - t0) / (s1 - s0) if s1 > s0 else 0.0

    def steps_in(self, seconds: float) -> int:
        """About how many steps this node runs in `seconds` (0 before it has a pace)."""
        if len(self._times) < 2:
            return 0
        (t0, s0), (t1, s1) = self._times[0], self._times[-1]
        return int(seconds * (s1 - s0) / (t1 - t0)) + 1 if t1 > t0 else 0


@dataclass
class StateAnswers:
    """How the peers answered one round of state requests (Greetings.ask_for_state)."""
    donor: int | None = None                              # the peer that accepted: its state is coming
    ready: dict[int, int] = field(default_factory=dict)   # ready members that answered -> their step
    silent: set[int] = field(default_factory=set)         # no answer in time: stalled, slow, or partitioned
    gone: set[int] = field(default_factory=set)           # nothing listens, or no state to give (not ready)
    finished: set[int] = field(default_factory=set)       # ... of them, members that finished the run
    problems: dict[int, str] = field(default_factory=dict)

    @property
    def live(self) -> bool:
        """A member with state may still answer: one did, or one may only be slow."""
        return bool(self.ready or self.silent)


@dataclass(frozen=True)
class ClusterSurvey:
    reachable: int  # peers that answered a Hello
    running: bool   # one of them is ready and past step 0
    furthest: int = 0  # the furthest step a compatible peer is at
    furthest_peer: int | None = None  # ... and which peer said so
    silent: int = 0    # peers that did not answer in time but may be alive (frozen, busy, partitioned)
    answered_in: float = 0.0  # seconds until the last answer came (the Hellos all went out at once)


def new_incarnation() -> int:
    return secrets.randbits(63) | 1  # never 0 (0 = an old peer that sends none)


FINISHED = "finished its run"  # a want_state refusal that means: this member will never serve one

WAIT_ROUND = 0.25  # seconds wait_for_peers lets pass at most between two looks at its peers
SPREAD_FACTOR = 2  # a view's switch lies at least this many survey round trips ahead (propose_view)
VETTING_WAIT_PROBES = 3  # a proposal waits at most this many probe timeouts for views being vetted
# A Hello that got no answer (TimeoutError: ours; CancelledError: the loop cancelled it, e.g. at a stop).
FAILED = (SendFailure, concurrent.futures.TimeoutError, concurrent.futures.CancelledError)


class PerPeerDoubling:
    """A length per peer: `first`, then twice as long after each double(), up to `longest`."""

    def __init__(self, first: float = 1.0, longest: float = 16.0) -> None:
        self.first, self.longest = first, longest
        self._length: dict[int, float] = {}

    def current(self, peer: int) -> float:
        return self._length.get(peer, self.first)

    def double(self, peer: int) -> None:
        self._length[peer] = min(self.longest, 2 * self.current(peer))


class NotReadyBackoff:
    """When to ask a peer that answered "not ready" again: after 50 ms, then twice as long each
    time up to 5 s. A peer that turns ready greets the peers it waits for at once, and those
    waiting for it are among them (neighbourhoods are symmetric), so each learns it then; the
    asks are the fallback. Setting up takes seconds on a crowded machine, and hundreds of nodes
    asking every 50 ms only load the loops that are setting up."""

    FIRST, LONGEST = 0.05, 5.0

    def __init__(self) -> None:
        self._pause = PerPeerDoubling(self.FIRST, self.LONGEST)
        self._due: dict[int, float] = {}  # peer -> when to ask it again

    def due(self, peer: int) -> bool:
        return time.monotonic() >= self._due.get(peer, 0.0)

    def note(self, peer: int) -> None:
        self._due[peer] = time.monotonic() + self._pause.current(peer)
        self._pause.double(peer)

    def next_due(self, peers) -> float:
        """The earliest time.monotonic() at which one of `peers` is to be asked again (0: now)."""
        return min((self._due.get(peer, 0.0) for peer in peers), default=0.0)


class HelloAttempts(PerPeerDoubling):
    """How long a start-up Hello may wait for its answer: 1 s, then twice as long after each that
    failed, up to 16 s. On a crowded machine answers take longer than a second: with fixed 1 s
    attempts, every Hello timed out and was sent again at once, and the retries alone kept the
    loops saturated (512 simulated nodes on 2 cores: no Hello answered after the first seconds).
    A longer attempt loses nothing: a Hello waits for its peer to come up and returns when it does."""

    def length(self, peer: int, remaining: float) -> float:
        return min(remaining, self.current(peer))

    failed = PerPeerDoubling.double


class Greetings:
    """Node `identity.node_id`'s Hello exchanges with its peers (addresses: `grpc.addresses`).
    Blocking methods are for the training thread; coroutines and `on_hello` run on the loop thread."""

    def __init__(self, identity: Identity, loop: LoopThread, grpc: GrpcPath, liveness: Liveness, views: Views,
                 routes: RouteTable, *, probe_timeout: float, lane_ports: LanePorts | None = None, metrics=None,
                 indirect_probes: int = 0):
        self.identity = identity
        self.lane_ports = lane_ports  # where the peers' TCP lanes listen, from their Hellos; None: gRPC only
        self.lane_port = 0  # our own lane's port, advertised in our Hellos (0: none)
        self.rank = identity.node_id
        self.world_size = identity.world_size
        self.loop = loop
        self.grpc = grpc
        self.addresses = grpc.addresses
        self.liveness = liveness
        self.views = views
        self.routes = routes
        self.probe_timeout = probe_timeout
        self.indirect_probes = indirect_probes  # peers asked to probe one that does not answer us (0: none)
        self.incarnation = new_incarnation()  # new at every start and every completed rejoin
        self.resume_step = 0                  # the step a rejoined node resumes at (sent in its Hellos)
        self.ready = False                    # this node accepts tensors (mark_ready)
        self.ready_peers: set[int] = set()    # peers that told us (in their Hello or reply) they are ready
        self.reached: set[int] = set()        # peers we delivered to: later connect failures fail fast
        self._probing: set[int] = set()
        self._state_requests: list[int] = []  # peers that asked for our model state (Hello want_state)
        self._holding_state: set[int] = set()  # ... of them, those that asked while ready (they hold state)
        self.finished = False                  # this node's training is over: it serves no state request
        self.leaving = False                   # this node asked to leave (said in replies: Membership.leave)
        self.pace = StepPace()
        self.metrics = metrics
        self.announced: set[int] = set()      # peers that greeted us, or answered our Hello as themselves
        self._vetting: dict[tuple[int, int], asyncio.Task] = {}  # views whose claims are being confirmed
        self.refused_views = 0
        self.views_held: dict[int, tuple[int, tuple[int, int]]] = {}  # peer -> (its incarnation, the latest
        # view order it showed us it holds)
        self.refused_evictions: tuple[View, ...] = ()  # views refused for evicting a live peer (newest last)
        self.reachability = pb.REACHABILITY_UNKNOWN  # can peers dial us? (reachability.py; said in Hellos)
        self.peer_reachability: dict[int, int] = {}  # ... each peer's, as its latest Hello or reply said
        self.seen_from: dict[int, str] = {}  # the host each peer's own Hellos last came from (behind NAT: the NAT's)
        self.vouched: set[int] = set()  # peers that a peer we reached has met (HelloReply.met)
        self.vouched_ready: set[int] = set()  # ... and knows to be ready (HelloReply.ready_peers)
        self.check_reachability = None  # () -> str: Transport's check, run in wait_for_peers once peers answer
        self.reach_out = None  # (peer) -> None: a private node's reverse stream to a peer it reached (Transport)

    def others(self) -> list[int]:
        """The peers to greet: the members of the latest view (every node, in a static run), and
        every earlier member whose address is known (a node that left may still answer)."""
        latest = set(self.views.latest.members)
        return [peer for peer in range(self.world_size)
                if peer != self.rank and (peer in latest or (peer in self.views.members_ever and self.addresses[peer]))]

    def unviewed(self) -> list[int]:
        """Every other rank whose address is known but that others() leaves out: where a (re)joining
        process may still find the cluster. It starts with the initial view only, so the members
        admitted since (joiners) are in no view it knows, and its initial members may all have left."""
        known = set(self.others())
        return [peer for peer in range(self.world_size)
                if peer != self.rank and peer not in known and self.addresses[peer]]

    def learn_address(self, peer: int, address: str) -> None:
        if len(address) > MAX_ADDRESS or not address.isprintable():
            log.warning("node %d: ignored an unusable address for node %d (%r...)", self.rank, peer, address[:40])
            return
        if 0 <= peer < self.world_size and self.grpc.learn_address(peer, address):
            log.info("node %d: node %d is at %s", self.rank, peer, address)

    def adopt_view(self, message: pb.View, sender: int) -> bool:
        """A view a peer sent (Hello or reply); True if it was adopted now. One out of bounds is
        refused; one asserting what this node has not seen for itself is adopted once the nodes it
        names confirm it (vetting.py), in the background."""
        if (message.epoch, message.proposer) <= self.views.latest.order:
            return False  # (nothing new: not even parsed; a digest of a view says only its order)
        try:
            view = View.from_proto(message, self.world_size)
        except ValueError as exc:
            self._refuse_view(sender, str(exc))
            return False
        furthest = max([self.liveness.step, self.resume_step] +
                       [s for s in map(self.liveness.peer_step, range(self.world_size)) if s is not None])
        base = self.views.named_base(view)
        reason = vetting.refusal(view, self.views.latest, furthest, base)
        if reason:
            self._refuse_view(sender, reason, view)
            return False
        doubts = vetting.doubts(view, sender, base or self.views.base_of(view), rank=self.rank,
                                announced=self.announced, live=self._live_members, exact=base is not None)
        if doubts:
            if view.order not in self._vetting:
                self._vetting[view.order] = self.loop.spawn(self._confirm(view, sender, doubts))
            return False
        return self._adopt(view, sender)

    def _live_members(self, ranks) -> list[int]:
        members = self.views.latest.member_set
        return [p for p in self.liveness.live(ranks) if p in members]

    def _adopt(self, view: View, sender: int) -> bool:
        for member, address in zip(view.members, view.addresses):
            if member != self.rank:
                self.learn_address(member, address)
        if not self.views.adopt(view):
            return False
        # Pass it on once, as gossip: a proposer reaches the nodes it knows of, and one it could not
        # reach (a blocked link), a concurrent proposal's loser or a joiner it never heard of may be
        # known here only. A view that came from another node than its proposer goes to the members
        # at exponential offsets after this node (O(log m) calls, all reached within O(log m) hops);
        # one from its proposer, which greeted every member itself, only to the next member on the
        # ring but the proposer (which then hears of it twice: the proposer's Hello may have failed;
        # skipping the proposer gives the member after it a second source too), so that a change
        # costs each node 2 calls, not 1 + log2 m. To the live former members the view leaves out
        # either way.
        spread = [p for p in gossip_targets(view.members, self.rank) if p not in (sender, view.proposer)]
        others = set(spread if sender != view.proposer else spread[:1])
        others |= set(self.liveness.live(self.views.members_ever - set(view.members)))
        for peer in sorted(p for p in others - {self.rank, sender, view.proposer} if self.addresses[p]):
            self.loop.spawn(self._pass_on(peer))
        return True

    def _refuse_view(self, sender: int, reason: str, view: View | None = None) -> None:
        self.refused_views += 1
        if self.metrics is not None:
            self.metrics.on_rejected("view")
        if self.refused_views <= 10 or self.refused_views % 100 == 0:
            what = f"view {view.epoch} of node {view.proposer}" if view else "a view"
            log.warning("node %d: refused %s from node %d: %s (%d refused)", self.rank, what, sender,
                        reason[:300], self.refused_views)

    async def _confirm(self, view: View, sender: int, doubts: vetting.Doubts) -> None:
        """Adopt `view` once every node it makes a claim about confirms it (see vetting.py)."""
        try:
            reason = await self._doubt_reason(view, sender, doubts)
            if reason:
                self._refuse_view(sender, reason, view)
            elif view.order > self.views.latest.order:
                self._adopt(view, sender)
        finally:
            self._vetting.pop(view.order, None)

    async def _vetted(self, timeout: float) -> None:
        """Wait (at most `timeout`) until the views being vetted now are adopted or refused."""
        if self._vetting:
            await asyncio.wait(list(self._vetting.values()), timeout=timeout)

    async def _holds(self, peer: int, view: View) -> bool | None:
        """Whether `peer`'s latest view is `view` or a later one (greet adopts a later one); None
        when it does not answer."""
        if not self.addresses[peer]:
            return None
        try:
            reply = await self.greet(peer, self.hello_request(), self.probe_timeout, wait_for_ready=False)
        except SendFailure:
            return None
        if not reply.view.members:  # (none, or a digest: it holds our latest view, which may have
            latest = self.views.latest  # passed `view` meanwhile)
            return reply.HasField("view") and (reply.view.epoch, reply.view.proposer) == latest.order \
                and (latest.order > view.order or latest == view)
        try:
            theirs = View.from_proto(reply.view, self.world_size)
        except ValueError:
            return False
        return theirs is not None and (theirs.order > view.order or theirs == view)

    async def _doubt_reason(self, view: View, sender: int, doubts: vetting.Doubts) -> str:
        if doubts.passed_on:  # its proposer's own latest view must be this one (or a later one) ...
            held = await self._holds(view.proposer, view)
            if held is None:  # ... or, the proposer being gone (it left, or died), another member's:
                # first the view's own members (its proposer sent it to each of them), then those of
                # its base here (a restarted process's base is its initial view, whose members may
                # all have left since); until one holds it, or two answered that they do not
                base = self.views.base_of(view)
                witnesses = [p for p in self.liveness.live(dict.fromkeys(view.members + base.members))
                             if p not in (self.rank, sender, view.proposer) and self.addresses[p]]
                answered = 0
                for witness in witnesses:
                    held = await self._holds(witness, view)
                    if held:
                        break
                    answered += held is not None
                    if answered == 2:
                        break
                if held is None:
                    return f"passed on, and neither its proposer {view.proposer} nor another member confirms it"
            if not held:
                return "passed on, but the node asked does not hold it"
        for member in sorted(doubts.newcomers):
            try:
                reply = await self.greet(member, self.hello_request(), self.probe_timeout, wait_for_ready=False)
            except SendFailure as exc:
                return f"new member {member} does not answer ({describe(exc)})"
            if not reply.compatible or reply.node_id != member:
                return f"new member {member} does not answer as itself"
            self.announced.add(member)
        for member in sorted(doubts.dropped_live):
            alive, reply = await self.probe_reply(member)
            if alive and reply is not None and reply.leaving:
                continue  # its own leave (this node, a joiner since, did not see it ask)
            if alive:
                if view.proposer in self.views.latest.members:  # its proposer (and the evicted) hold it
                    self.refused_evictions = (*self.refused_evictions[-(MAX_REFUSED_EVICTIONS - 1):], view)
                return f"it drops node {member}, which is alive here and did not leave"
        return ""

    async def _pass_on(self, peer: int) -> None:
        try:
            await self.greet(peer, self.hello_request(), 2.0, wait_for_ready=False)
        except SendFailure:
            pass  # gone, or not up yet: it hears of the view in its next Hello

    # Loop thread --------------------------------------------------------------------------------
    def hello_request(self) -> pb.HelloRequest:
        me = self.identity
        return pb.HelloRequest(node_id=me.node_id, world_size=me.world_size, ready=self.ready,
                               protocol_version=me.protocol_version, config_fingerprint=me.config_fingerprint,
                               step=self.resume_step, current_step=self.liveness.step,
                               incarnation=self.incarnation, lane_port=self.lane_port,
                               view=self.views.latest.wire, address=self.addresses[self.rank],
                               reachability=self.reachability, finished=self.finished)

    async def greet(self, peer: int, request: pb.HelloRequest, timeout: float,
                    wait_for_ready: bool = True) -> pb.HelloReply:
        """Hello `peer` and note what its reply says about it and us, and how long it took (relays
        go nearest first) when it did not wait for the peer to come up."""
        sent = time.monotonic()
        if request.HasField("view") and request.view.members and self._holds_ours(peer):
            trimmed = pb.HelloRequest()  # (it holds our view or a later one already: O(n) bytes saved)
            trimmed.CopyFrom(request)
            trimmed.view.CopyFrom(self.views.latest.digest())
            request = trimmed
        reply = await self.grpc.client(peer).hello(request, timeout, wait_for_ready=wait_for_ready)
        if reply.compatible and reply.node_id == peer:
            if reply.HasField("view"):  # (its latest view, or only the order of it where that is ours)
                self._note_view_held(peer, reply.incarnation, reply.view)
            if not wait_for_ready:
                self.routes.note_rtt(peer, time.monotonic() - sent)
            self.announced.add(peer)
            self.reached.add(peer)  # it is up: a refused connection from now on means it went away
            if self.lane_ports is not None:
                self.lane_ports.learn(peer, reply.lane_port, reply.incarnation)
            self._note_reachability(peer, reply.reachability)
            if self.reachability == pb.REACHABILITY_PRIVATE and self.reach_out is not None:
                self.reach_out(peer)  # (once per peer: the peers waiting for us meet us down it)
            if reply.ready:
                self.ready_peers.add(peer)
                self.liveness.note_ready(peer, reply.incarnation)
            self.vouched.update(m for m in reply.met[:self.world_size] if 0 <= m < self.world_size and m != self.rank)
            self.vouched_ready.update(m for m in reply.ready_peers[:self.world_size]
                                      if 0 <= m < self.world_size and m != self.rank)
            for other in reply.private_peers[:self.world_size]:  # (second hand: what they said themselves wins)
                if 0 <= other < self.world_size and other != self.rank and other not in self.peer_reachability:
                    self.routes.note_private(other, True)
            self.liveness.note_step(peer, reply.step)
            if reply.finished:
                self.liveness.note_finished(peer)
            if reply.caller_excluded:
                self.liveness.excluded(by_peer=peer)
            if reply.HasField("view"):
                self.adopt_view(reply.view, peer)
        return reply

    async def hello(self, peer: int, timeout: float, wait_for_ready: bool = True) -> pb.HelloReply:
        """Hello `peer`, waiting up to `timeout` for it to come up (with wait_for_ready)."""
        return await self.greet(peer, self.hello_request(), timeout, wait_for_ready)

    async def probe(self, peer: int) -> bool:
        """Hello `peer` without waiting for a connection; declare it dead if it does not answer.
        Two private nodes cannot greet each other (their messages go through relays): no probe."""
        if peer in self._probing:
            return self.liveness.alive(peer)
        return (await self.probe_reply(peer))[0]

    async def probe_reply(self, peer: int) -> tuple[bool, pb.HelloReply | None]:
        """probe() (even while another one is under way), and the reply (None where no Hello
        went out: a private peer this private node cannot greet)."""
        if (self.reachability == pb.REACHABILITY_PRIVATE and peer in self.routes.private
                and peer not in self.grpc.reverse_clients):
            return self.liveness.alive(peer), None
        self._probing.add(peer)
        try:
            return True, await self.greet(peer, self.hello_request(), self.probe_timeout, wait_for_ready=False)
        except SendFailure as exc:
            if exc.kind not in (FailureKind.GONE, FailureKind.DENIED) and await self._answers_others(peer):
                log.warning("node %d: node %d does not answer this node (%s) but answers others: alive", self.rank,
                            peer, describe(exc))
                return True, None
            self.liveness.mark_dead(peer, f"no answer to a probe: {describe(exc)}")
            return False, None
        finally:
            self._probing.discard(peer)

    async def _answers_others(self, peer: int) -> bool:
        """SWIM's indirect probe: ask `indirect_probes` peers this node reached and knows ready
        (its neighbours, when it meets only those) to Hello `peer` themselves; True if one of them
        got an answer. A link down between two live nodes then evicts neither (the data goes
        through relays); silence everywhere (a stall, a crash) still fails every probe."""
        helpers = [p for p in self.ready_peers & self.reached if p != peer and self.liveness.alive(p)]
        if not self.indirect_probes or not helpers:
            return False
        request = self.hello_request()
        request.probe_for = peer
        asked = random.sample(helpers, min(self.indirect_probes, len(helpers)))
        replies = await asyncio.gather(*(self.greet(h, request, 2 * self.probe_timeout, wait_for_ready=False)
                                         for h in asked), return_exceptions=True)
        return any(isinstance(reply, pb.HelloReply) and reply.probed for reply in replies)

    async def probe_for(self, caller: int, peer: int) -> bool:
        """(A peer's indirect probe.) Whether `peer` answers our own Hello; nothing is marked here:
        the caller judges. Only a known peer other than the caller and us is greeted."""
        if not 0 <= peer < self.world_size or peer in (self.rank, caller) or not self.addresses[peer]:
            return False
        try:
            await self.greet(peer, self.hello_request(), self.probe_timeout, wait_for_ready=False)
            return True
        except SendFailure:
            return False

    async def check_gone(self, peer: int) -> None:
        """Declare `peer` dead if nothing listens at its address any more (a refused connect: its
        process is gone, hangups.py). Only that definitive answer counts here: a peer that answers,
        is silent or is reached otherwise than directly (a private peer, a declared route, a direct
        link found down: its address may refuse us while the peer is fine) is left to the waits'
        deadlines and the probes."""
        routes = self.routes
        if (not self.liveness.alive(peer) or peer in routes.private or peer in self.grpc.reverse_clients
                or routes.declared(peer) is not None or routes.blocked(peer) or not routes.direct_ok(peer)):
            return
        if await nothing_listens(self.addresses[peer]):
            self.liveness.mark_dead(peer, f"its connections closed and a connect to {self.addresses[peer]} is refused")

    async def recheck_dead(self, peers: list[int]) -> None:
        """Hello peers we declared dead, once, without marking anything: one that answers and
        excludes us tells us that we are the one who went away (liveness.excluded), so we rejoin."""
        for peer in peers:
            try:
                await self.greet(peer, self.hello_request(), self.probe_timeout, wait_for_ready=False)
            except SendFailure:
                continue

    def answer(self, request: pb.HelloRequest, observed: str = "") -> pb.HelloReply:
        """Our reply to a peer's Hello (the gRPC service asks on the loop thread): who we are, our
        step, view and lane, whether we are ready, and whether we consider the caller dead.
        `observed`: the host the call came from (placement.py groups private peers by it)."""
        me = self.identity
        reason = me.compatibility(request.world_size, request.protocol_version, request.config_fingerprint)
        ready = self.ready
        peer = request.node_id
        known = not reason and 0 <= peer < me.world_size and peer != me.node_id
        latest = self.views.latest
        # (O(n) parts only where they say something: our view where the caller lacks it, whom we
        # met and know ready to a caller that may be private, the one that reads them)
        theirs = (request.view.epoch, request.view.proposer) if request.HasField("view") else None
        same = theirs == latest.order  # (then the reply says only its order: the caller holds it)
        vouch = request.reachability != pb.REACHABILITY_PUBLIC
        if known and observed:
            self.seen_from[peer] = observed[:MAX_ADDRESS]
        if known and ready and request.ready:
            # Both sides learn from this one exchange that the other is ready: the caller need not
            # be asked again (it may finish its run and leave before we would ask).
            self.ready_peers.add(peer)
        if known:
            reason = self.on_hello(request)  # membership news; a refused want_state says why
        return pb.HelloReply(node_id=me.node_id, world_size=me.world_size, protocol_version=me.protocol_version,
                             config_fingerprint=me.config_fingerprint, step=self.liveness.step,
                             compatible=not reason or known, reason=reason, ready=ready,
                             caller_excluded=known and self.liveness.excludes(peer), incarnation=self.incarnation,
                             lane_port=self.lane_port, view=latest.digest() if same else latest.wire,
                             reachability=self.reachability, met=sorted(self.announced) if vouch else (),
                             private_peers=sorted(p for p, v in self.peer_reachability.items()
                                                  if v == pb.REACHABILITY_PRIVATE),
                             ready_peers=sorted(self.ready_peers) if vouch else (), leaving=self.leaving,
                             finished=self.finished)

    def on_hello(self, request: pb.HelloRequest) -> str:
        """Membership news from a Hello; returns why a want_state request is refused ("" = served)."""
        peer = request.node_id
        self.announced.add(peer)
        self.learn_address(peer, request.address)
        if request.HasField("view"):
            self._note_view_held(peer, request.incarnation, request.view)
            self.adopt_view(request.view, peer)
        if self.lane_ports is not None:
            self.lane_ports.learn(peer, request.lane_port, request.incarnation)
        self._note_reachability(peer, request.reachability)
        was_dead = not self.liveness.alive(peer)
        known_before = self.liveness.incarnation(peer)
        self.liveness.hello(peer, ready=request.ready, incarnation=request.incarnation,
                              current_step=request.current_step, resume_step=request.step)
        if request.finished:
            self.liveness.note_finished(peer)
        if was_dead and self.liveness.alive(peer):  # back from the dead: connect afresh, no backoff
            self.loop.spawn(self.grpc.reset(peer))
        if not request.want_state:
            return ""
        if self.finished:
            return f"node {self.rank} {FINISHED}"
        if not (self.liveness.may_donate_to(peer, request.incarnation, known_before) or self.joining(peer)):
            log.warning("node %d: peer %d asked for our state but never left (not dead, lagging or restarted "
                        "here); refused", self.rank, peer)
            return f"node {self.rank} will not hand its state to node {peer}: it never saw that node leave"
        if peer not in self._state_requests:
            log.info("node %d: peer %d asks for our state (to rejoin)", self.rank, peer)
            self._state_requests.append(peer)
        if request.ready:  # a member catching up (or a joiner whose view lost to a concurrent one) holds state
            self._holding_state = self._holding_state | {peer}
        return ""

    def _note_view_held(self, peer: int, incarnation: int, view: pb.View) -> None:
        """`peer` (as `incarnation`: a restarted process starts from its first view again) holds
        `view` (or its digest): our Hellos to it need not carry views up to that one."""
        order = (view.epoch, view.proposer)
        known = self.views_held.get(peer)
        if known is None or known[0] != incarnation or known[1] < order:
            self.views_held[peer] = (incarnation, order)

    def _holds_ours(self, peer: int) -> bool:
        """`peer`, as we last heard of it, holds our latest view (or a later one)."""
        known = self.views_held.get(peer)
        return (known is not None and known[0] == self.liveness.incarnation(peer)
                and known[1] >= self.views.latest.order)

    def _note_reachability(self, peer: int, value: int) -> None:
        if value in (pb.REACHABILITY_PUBLIC, pb.REACHABILITY_PRIVATE):  # (an unknown enum value says nothing)
            self.peer_reachability[peer] = value
            self.routes.note_private(peer, value == pb.REACHABILITY_PRIVATE)

    def joining(self, peer: int) -> bool:
        """`peer` is not a member of the latest view: it joins (or comes back after leaving)."""
        return peer not in self.views.latest.member_set

    def _pop_state_requests(self) -> list[tuple[int, bool]]:
        requests, self._state_requests = self._state_requests, []
        holding, self._holding_state = self._holding_state, set()
        return [(peer, peer in holding) for peer in requests]

    # Training thread ----------------------------------------------------------------------------
    def asking_for_state(self) -> frozenset[int]:
        """The peers whose state requests wait for this node's next step boundary (a snapshot)."""
        return frozenset(self._state_requests)

    def take_state_requests(self) -> list[tuple[int, bool]]:
        """Peers that asked (in a Hello) for our model state since the last call, each with whether
        it holds state already (it asked as a ready node: a split, never a new unit). Called at every
        step boundary: a racy peek first spares the hop to the loop thread when nobody asked."""
        if not self._state_requests:
            return []
        return self.loop.call(self._pop_state_requests)

    def rejoined(self) -> None:
        """A state transfer completed: a new incarnation, so peers that declared us dead take us back."""
        self.incarnation = new_incarnation()
        self.liveness.rejoined()

    def announce_finished(self, outstanding: Callable[[int], list[concurrent.futures.Future]],
                          timeout: float, among=None) -> None:
        """This node's run is over: tell the peers it met (or those of `among`: the peers it
        exchanged tensors with, Membership.finish), once each, so none waits a link deadline for
        a message it will never send. To each only once every message it sent that peer was
        acknowledged (`outstanding(peer)`: the Hello must not overtake one), all within `timeout`."""
        deadline = time.monotonic() + timeout
        request = self.hello_request()
        futures = []
        for peer in sorted((self.announced | self.reached if among is None else set(among)) - {self.rank}):
            if not self.liveness.alive(peer):
                continue
            concurrent.futures.wait(outstanding(peer), max(0.0, deadline - time.monotonic()))
            futures.append(self._hello_once(peer, request, 2.0))
        concurrent.futures.wait(futures, max(0.0, deadline - time.monotonic()))

    def _hello_once(self, peer: int, request: pb.HelloRequest, timeout: float) -> concurrent.futures.Future:
        """One Hello that does not wait for a connection, as a future for the training thread."""
        return self.loop.submit(self.greet(peer, request, timeout, wait_for_ready=False))

    def ask_for_state(self) -> StateAnswers:
        """One round of Hellos with want_state to every peer (those that excluded this node first:
        they saw it leave, so they donate), until a ready one accepts. Says who answered how, so the
        caller can tell busy donors (wait) from a finished cluster (give up). The state itself
        arrives as a MESSAGE_KIND_STATE push."""
        request = self.hello_request()
        request.want_state = True
        answers = StateAnswers()
        preferred = sorted(self.liveness.excluded_by())
        # (the ranks of no view known here last: asked only when no member it knows of donates)
        for peer in preferred + [p for p in self.others() + self.unviewed() if p not in preferred]:
            try:
                reply = self._hello_once(peer, request, 2.0).result(10)
            except FAILED as exc:
                answers.problems[peer] = describe(exc)
                gone = isinstance(exc, SendFailure) and exc.kind in (FailureKind.GONE, FailureKind.DENIED)
                (answers.gone if gone else answers.silent).add(peer)
                continue
            if reply.compatible and reply.ready and not reply.reason:
                answers.donor = peer
                answers.ready[peer] = reply.step
                return answers
            answers.problems[peer] = reply.reason[:200] or "not ready"
            if reply.compatible and reply.ready and not reply.reason.endswith(FINISHED):
                answers.ready[peer] = reply.step  # a member that would not donate (yet): it trains on
            else:
                answers.gone.add(peer)  # starting or rejoining itself, or finished: no state to give
                if reply.compatible and reply.node_id == peer and reply.reason.endswith(FINISHED):
                    self.liveness.note_finished(peer)
                    answers.finished.add(peer)
        return answers

    def survey(self, timeout: float = 2.0, everyone: bool = False, peers=None) -> ClusterSurvey:
        """Hello every peer once (without waiting for connections): how many answer, and whether a
        compatible, ready one is past step 0, i.e. this node was restarted into a running cluster
        (at a fresh start no node passes step 0 before every node is ready). With `everyone` (a
        (re)joiner), when the peers of others() show no running cluster, also every other rank whose
        address is known (unviewed). `peers`: only those."""
        if peers is not None:
            return self._survey(list(peers), timeout)
        found = self._survey(self.others(), timeout)
        if not everyone or found.running:
            return found
        extra = self._survey(self.unviewed(), timeout)
        ahead = max(found, extra, key=lambda s: (s.furthest_peer is not None, s.furthest))  # (ties: found)
        return ClusterSurvey(reachable=found.reachable + extra.reachable, running=extra.running,
                             furthest=ahead.furthest, silent=found.silent + extra.silent,
                             furthest_peer=ahead.furthest_peer)

    def _survey(self, peers: list[int], timeout: float) -> ClusterSurvey:
        began = time.monotonic()
        futures = [self._hello_once(peer, self.hello_request(), timeout) for peer in peers]
        answered: dict[concurrent.futures.Future, float] = {}
        for future in futures:
            future.add_done_callback(lambda done: answered.setdefault(done, time.monotonic()))
        reachable, running, furthest, silent, answered_in, furthest_peer = 0, False, 0, 0, 0.0, None
        for peer, future in zip(peers, futures):
            try:
                reply = future.result(timeout + 5)
            except FAILED as exc:
                silent += not (isinstance(exc, SendFailure) and exc.kind in (FailureKind.GONE, FailureKind.DENIED))
                continue
            # (when the answer came, not when it was looked at; a gone or silent peer's wait is no spread)
            answered_in = max(answered_in, answered.get(future, time.monotonic()) - began)
            reachable += 1
            running |= bool(reply.compatible and reply.ready and reply.step > 0)
            if reply.compatible and (furthest_peer is None or reply.step > furthest):
                furthest, furthest_peer = reply.step, peer
        return ClusterSurvey(reachable=reachable, running=running, furthest=furthest, silent=silent,
                             answered_in=answered_in, furthest_peer=furthest_peer)

    def announce_ready(self) -> list[int]:
        """Tell every peer (one Hello each, failures ignored) that this node is ready again and
        resumes at `resume_step`; returns the steps the peers that answered were at when they
        learned it (each sends to this node from its next step on)."""
        steps = []
        for future in [self.loop.submit(self._announce(peer)) for peer in self.others()]:
            try:
                reply = future.result(10)
            except FAILED:
                continue
            if reply.compatible and reply.ready:
                steps.append(reply.step)
        return steps

    async def _announce(self, peer: int) -> pb.HelloReply:
        reply = await self.greet(peer, self.hello_request(), 2.0, wait_for_ready=False)
        if reply.compatible and reply.ready and reply.node_id == peer:
            # It marked us alive before answering, so its pushes from its next step on reach us; and
            # from the switch of the view that made us a member, if it knew that view before.
            since, member_since = reply.step + 1, self.views.member_since(self.rank)
            theirs = reply.view.members or self.views.latest.members  # (a digest: it holds ours)
            if member_since and self.rank in theirs:
                since = min(since, member_since)
            if reply.step + self.liveness.max_lag >= self.resume_step:
                # we were the one away (a freeze): a peer we declared dead meanwhile, level with the
                # cluster we rejoined, is alive for us again (one far behind must rejoin itself)
                self.liveness.mark_alive(peer)
            self.liveness.confirmed(peer, since_step=since)
        return reply

    def propose_view(self, margin: int, notice: float = 0.0, *, into=(), out=(),
                     placement: tuple[int, ...] | None = None) -> int:
        """Propose that the latest view's members with `into` and without `out` train together from
        `margin` steps past the furthest step any old or new member is at (asked of them first: the
        steps known here may be stale, a joiner's above all; a retry goes by the replies to the view
        it retries), and at least `notice` seconds and
        SPREAD_FACTOR times that survey's round trip ahead at this node's pace, or from the switch
        of a view still pending if that comes sooner and at least half the margin ahead, and never
        before a pending view's switch (it is replaced there); and Hello
        the view to each of them (failures ignored: a node that misses it hears of it in its next
        Hello). A reply from a node already at the switch step means it may have gone past it
        with the old members: propose again further on. The change applies to the latest view
        when the view is made (on the loop thread): a concurrent view adopted meanwhile (a joiner
        admitted during the survey) is kept, and a change one made already is not proposed again.
        Returns the switch step of the latest view (another proposer's, if its view won).
        `placement`: the members' ring order (None: keep; without a change, what is proposed)."""
        into, out = frozenset(into), frozenset(out)
        for attempt in range(3):
            if self._changed_members(into, out, placement) is None:
                break
            targets = self._view_targets(into)
            if attempt == 0:  # (a retry knows the steps from the replies to the view it retries)
                spread = self._survey(targets, 2.0).answered_in  # (each reply notes the peer's step)
                # Views the replies carried that are still being vetted (a joiner's first survey
                # brings every change since the initial view): wait for them, so the change is
                # made on the latest view, not on one the members have long left behind.
                self.loop.submit(self._vetted(VETTING_WAIT_PROBES * self.probe_timeout)).result()
            ahead = max(margin, self.pace.steps_in(max(notice, SPREAD_FACTOR * spread)))
            known = [self.liveness.step] + [s for s in map(self.liveness.peer_step, targets) if s is not None]
            switch = max(known) + ahead
            pending = self.views.latest.switch_step
            if (attempt == 0 and max(known) + max(1, ahead // 2) <= pending < switch) or pending > switch:
                # A view not in force yet switches early enough: switch with it, replacing it there.
                # Nodes that never took it (a concurrent proposal's loser, or a node that refused
                # it: it dropped a node alive there) then hold the same members for every step.
                # Never before it: its newcomers would be members before they enter (one was
                # awaited, at steps it never trained as a member, for a link deadline).
                switch = pending
            view = self.loop.call(self._propose, into, out, switch, placement)
            if view is None:
                break
            margin = 2 * ahead  # (if a node was past it, the next try goes further)
            request = self.hello_request()  # (it carries the view)
            futures = {peer: self._hello_once(peer, request, 2.0) for peer in self._view_targets(into)}
            past = []
            for peer, future in futures.items():
                try:
                    reply = future.result(10)
                except FAILED:
                    continue
                if reply.compatible and reply.step >= view.switch_step:
                    past.append(peer)
            if not past or self.views.latest != view:
                break
            if self._changed_members(into, out, placement) is None:  # (a join or leave is in the view: not again)
                log.warning("node %d: node(s) %s already at step %d when view %d arrived: they trained the steps "
                            "since over the members before it (what they sent is voided or folded in late)",
                            self.rank, brief(past), view.switch_step, view.epoch)
                break
            log.warning("node %d: node(s) %s already at step %d when view %d arrived; proposing again", self.rank,
                        brief(past), view.switch_step, view.epoch)
        return self.views.latest.switch_step

    def _changed_members(self, into, out, placement) -> list[int] | None:
        """The latest view's members with `into` and without `out`; None when there is nothing to
        propose (no member left, a change made already, a layout that is no order of them)."""
        latest = self.views.latest
        members = sorted((set(latest.members) | into) - out)
        if not members or (into or out) and members == list(latest.members) \
                or placement is not None and sorted(placement) != members:
            return None
        return members

    def _view_targets(self, into) -> list[int]:
        """Whom a view is told to: every member it has had, and the new ones."""
        return [p for p in sorted((self.views.members_ever | into) - {self.rank}) if self.addresses[p]]

    def _propose(self, into, out, switch: int, placement) -> View | None:
        """(Loop thread: no view is adopted between reading the latest and proposing on it.)"""
        members = self._changed_members(into, out, placement)
        if members is None:
            return None
        # (the addresses nodes may lack: every node of a run is configured with the same list,
        # so those of the joiners, learned since, and our own; O(n) bytes less per Hello)
        told = {m: self.addresses[m] for m in members if m in self.grpc.learned or m == self.rank}
        return self.views.propose(members, switch, told, placement)

    def wait_for_step(self, step: int, timeout: float) -> None:
        """Hello every live peer until it reports a current step >= `step` (the cluster resumed
        from checkpoints of the same step); PeerError naming the laggards after `timeout`."""
        deadline = time.monotonic() + timeout
        waiting = set(self.liveness.live(self.others()))
        while waiting and time.monotonic() < deadline:
            futures = {peer: self.loop.submit(self.hello(peer, 1.0)) for peer in waiting}
            for peer, future in futures.items():
                try:
                    if future.result(10).step >= step:
                        waiting.discard(peer)
                except FAILED:
                    continue
            if waiting:
                time.sleep(0.05)
        if waiting:
            raise PeerError(f"node {self.rank}: node(s) {sorted(waiting)} did not resume at step {step} within "
                            f"{timeout:.0f}s (did every node load a checkpoint of the same step?)")

    def wait_for_peers(self, timeout: float = 60.0, *, require_ready: bool = False, peers=None) -> None:
        """Hello every peer (or those of `peers`), waiting for it to come up (and, with
        require_ready, to have its algorithm set up, so nothing we send is refused as unexpected).
        Raises PeerError on an incompatible peer at once, or on one still unreachable / not ready
        after `timeout`."""
        deadline = time.monotonic() + timeout
        near = None if peers is None else set(peers)
        waiting = {peer for peer in self.others()  # routed: not greeted
                   if not self.routes.skip_hello(peer) and (near is None or peer in near)}
        check_after = min(2, len(waiting))  # peers reached before this node asks whether it is private
        last_problem: dict[int, str] = {}
        cannot_connect: set[int] = set()  # peers whose last Hello failed
        inflight: dict[int, concurrent.futures.Future] = {}  # Hellos asked and not yet taken
        not_ready = NotReadyBackoff()  # (a peer that becomes ready says so itself: see answer())
        attempts = HelloAttempts()
        while waiting:
            if require_ready:
                waiting -= self.ready_peers  # a peer that said so in its own Hello may be gone by now
            if self.check_reachability is not None and len(self.reached) >= check_after:
                check, self.check_reachability = self.check_reachability, None
                check()  # (private: it reaches out now, so the peers waiting for it meet it)
            if self.reachability == pb.REACHABILITY_PRIVATE:
                # a private peer (maybe behind another NAT: a Hello to it would wait out its
                # attempt) counts as met once a peer it reached has met it (and with require_ready,
                # knows it ready): their messages go through that peer, or directly on one LAN
                vouched = self.vouched_ready if require_ready else self.vouched
                waiting -= vouched & self.routes.private
            if not waiting:
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            private = self.reachability == pb.REACHABILITY_PRIVATE
            asked = waiting | (self.reached if private else set())
            for peer in asked:
                if peer not in inflight and not_ready.due(peer):
                    inflight[peer] = self.loop.submit(self.hello(peer, attempts.length(peer, remaining)))
            for peer in asked:
                future = inflight.get(peer)
                if future is None or not future.done():
                    continue  # (said it was not ready: asked again later; or on its way: taken when it ends)
                del inflight[peer]
                try:
                    reply = future.result()
                except FAILED as exc:
                    attempts.failed(peer)
                    last_problem[peer] = f"unreachable: {describe(exc)}"
                    cannot_connect.add(peer)
                    continue
                cannot_connect.discard(peer)
                if peer not in waiting:
                    continue  # (asked again for whom it met)
                reason = reply.reason[:200] or self.identity.compatibility(
                    reply.world_size, reply.protocol_version, reply.config_fingerprint)
                if not reply.compatible or reason:
                    raise PeerError(f"node {self.rank}: node {peer} at {self.addresses[peer]} incompatible: "
                                    f"{reason}")
                if reply.node_id != peer:
                    raise PeerError(f"node {self.rank}: address {self.addresses[peer]} answers as node "
                                    f"{reply.node_id}, expected {peer}")
                if self.lane_ports is not None and self.lane_ports.refusal(peer):
                    raise PeerError(self.lane_ports.refusal(peer))
                if require_ready and not reply.ready:
                    last_problem[peer] = "not ready (still setting up)"
                    not_ready.note(peer)
                    continue
                self.reached.add(peer)
                self.routes.mark_reached(peer)  # a relay candidate from now on
                waiting.discard(peer)
            if waiting:
                self._pause(inflight, not_ready.next_due(waiting - inflight.keys()), deadline)
        if waiting:
            problems = "; ".join(f"node {p} at {self.addresses[p]} {last_problem.get(p, 'did not answer')}"
                                 for p in sorted(waiting))
            raise PeerError(f"node {self.rank}: after {timeout:.0f}s: {problems}")

    @staticmethod
    def _pause(inflight: dict[int, concurrent.futures.Future], due: float, deadline: float) -> None:
        """Between two rounds of wait_for_peers: until a Hello in flight is answered, a peer is due
        to be asked again, or at most WAIT_ROUND (a peer may say it is ready in a Hello of its own),
        but at least NotReadyBackoff.FIRST. Hundreds of nodes in one process, each polling every
        50 ms, used two thirds of its CPU and starved the loop that answers the Hellos."""
        now = time.monotonic()
        pause = min(max(due - now, NotReadyBackoff.FIRST), WAIT_ROUND, max(0.0, deadline - now))
        pending = [future for future in inflight.values() if not future.done()]
        if pending:
            concurrent.futures.wait(pending, pause, return_when=concurrent.futures.FIRST_COMPLETED)
        else:
            time.sleep(pause)


__all__ = ["ClusterSurvey", "FAILED", "FINISHED", "Greetings", "StateAnswers", "StepPace", "new_incarnation"]
