"""Membership: who trains together from which step, who is alive, and what this node stands for.

One object over three parts: views.py (which ranks are members from which step: agreed by every
node), liveness.py (which peers this node considers alive, lagging or dead) and greetings.py (the
Hello protocol that carries both). Algorithms see it through the Members protocol
(algorithms/base.py); the engine drives joins, leaves, rejoins and catch-ups through it.

What a node stands for is state, not a one-off request: itself in (unless it leaves, or must
catch up first), itself out when leaving, and with `drop_dead` the peers it declared dead out.
`reconcile()` proposes exactly that whenever the latest view differs, so a proposal that lost to a
concurrent one is made again on top of the winner, and nodes with opposite wishes cannot flip-flop.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import time
from typing import Callable, Iterable

from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.transport.membership.greetings import ClusterSurvey, Greetings, StateAnswers
from p2ptrain.transport.membership.liveness import Liveness
from p2ptrain.transport.membership.placement import neighbours_apart, place
from p2ptrain.transport.membership.views import View, Views

log = logging.getLogger(__name__)

# A layout is proposed once this node has a pace (a few steps in), to switch this many seconds of
# steps ahead (a Hello round to every member takes milliseconds): fast steps (DiLoCo's inner ones)
# would otherwise pass a margin of steps before the view reached every member, and a ring whose
# members disagree on its order fails until they agree (measured: a 1.1 s stall at the first sync).
PLACEMENT_NOTICE = 0.1
PLACEMENT_AFTER = 10  # steps into the run (a pace from the first two steps is no pace)
PLACEMENT_TRIES = 100  # steps it waits for every member's reachability at most (a peer may never say)
LAY_OUT_WAIT = 5.0  # seconds the lowest public node waits for every peer's reachability before step 0
FINISH_ANNOUNCE_SECONDS = 5.0  # finish(): at most this long for acks, then the peers' "finished" Hellos


class Membership:
    """Node `rank`'s membership. Queries may come from any thread; proposals, waits and state
    requests from the training thread."""

    def __init__(self, views: Views, liveness: Liveness, greetings: Greetings, *, view_margin: int,
                 view_notice: float = 0.0):
        self.rank = liveness.rank
        self.world_size = liveness.world_size
        self.views = views
        self.liveness = liveness
        self.greetings = greetings
        self.identity = greetings.identity  # what this node says about itself in Hellos
        self.view_margin = view_margin  # steps between a proposal and its switch, at the least
        self.view_notice = view_notice  # ... and at least this many seconds at this node's pace
        self.joining = False     # this node (re)joins a running cluster: it takes a donor's state first
        self.wants_in = True     # stands for itself as a member (a joiner: once set up to receive)
        self.leaving = False     # stands for a view without itself
        self.drop_dead = False   # stands for views without the peers it declared dead (rings)
        self._leaves_taken: frozenset[tuple[int, int]] = frozenset()  # (leaver, epoch of the view that dropped it)
        self.refused_leaves = 0
        self._rechecked_at = -(2 ** 62)  # the step of the last recheck_if_isolated Hellos
        self._placing = PLACEMENT_TRIES  # reconciles left to ask place_by_reachability (0: decided)
        # peer -> futures of our sends to it not acknowledged yet (the transport's Sender.outstanding)
        self.outstanding: Callable[[int], list[concurrent.futures.Future]] | None = None
        self.sent_to: Callable[[], set[int]] | None = None  # the peers we sent tensors to (the Sender's)

    # Who trains together (views) ------------------------------------------------------------------
    @property
    def latest(self) -> View:
        return self.views.latest

    def view_order(self) -> tuple[int, int]:
        """The latest view's (epoch, proposer): it changes exactly when a view is adopted."""
        return self.views.latest.order

    def members(self, step: int) -> tuple[int, ...]:
        """The ranks that train together at `step` (the topology or the ring is built over them)."""
        return self.views.members_at(step)

    def placed(self, step: int) -> tuple[int, ...]:
        """The members at `step` in the order rings and graphs lay them out (placement.py)."""
        return self.views.placed_at(step)

    def switches_at(self, step: int) -> bool:
        """The members change at `step` (a ring re-forms, and first re-synchronizes the model)."""
        return self.views.switches_at(step)

    def entering(self, step: int) -> tuple[int, ...]:
        """Members that enter at `step`'s switch with a donor's copy (View.entering; () elsewhere)."""
        return self.views.entering_at(step)

    def first_switch(self, after: int, until: int) -> int | None:
        """The first step in (after, until] at which the members change, as the views held here say."""
        return self.views.first_switch(after, until)

    def first_step_as_member(self, step: int) -> int | None:
        """The first step >= `step` at which this node is a member (a joiner: its view's switch)."""
        return self.views.first_step_as_member(self.rank, step)

    def first_step_without_me(self, step: int) -> int | None:
        """The first step >= `step` at which this node is no member (a leaver stops before it)."""
        return self.views.first_step_without(self.rank, step)

    def departing(self, step: int) -> frozenset[int]:
        """Members at `step` that the latest view drops and that did not propose it themselves: a
        ring with them cannot complete (they died), so it is not tried until the view switches."""
        latest = self.views.latest
        return frozenset(set(self.members(step)) - set(latest.members) - {latest.proposer})

    def split_members(self, step: int) -> tuple[int, ...] | None:
        """The members of a view this node refused because it evicts a peer alive here, when that
        view is in force at `step` for the nodes that took it (its proposer and the evicted, at
        least): they train over other members there than this node, so a ring with them cannot
        complete until a greater view switches (the evicted proposing itself back, or a re-formed
        ring). None without such a refusal, so always without faults."""
        for view in reversed(self.greetings.refused_evictions):
            if view.switch_step <= step and not self.views.supersedes(view, step):
                return view.members
        return None

    def leaves_due(self, step: int) -> list[int]:
        """The leavers whose mass this node is offered first and has not taken: live, unfinished
        nodes that a view in force by `step` dropped, whose hand-over tries this node first
        (hand_over_order at that switch). A member that finished
        refuses a LEAVE, so this one waits for those at its finish (PushSum.take_over_at_end)."""
        latest, liveness, due = self.views.latest, self.liveness, []
        for peer in sorted(self.views.members_ever - set(latest.members) - {self.rank}):
            dropping = self.views.dropping_view(peer)
            if dropping is None or dropping.switch_step > step or (peer, dropping.epoch) in self._leaves_taken \
                    or not liveness.alive(peer) or peer in liveness.finished():
                continue
            if self.hand_over_order(peer, dropping.switch_step)[:1] == [self.rank]:
                due.append(peer)
        return due

    def hand_over_order(self, leaver: int, step: int) -> list[int]:
        """The members at `step` that `leaver` offers its mass to, in turn: those in step first, then
        those that lag (alive, they take it over when they get there), never one that died or
        finished its run (it would not take it over)."""
        candidates = [m for m in self.members(step) if m != leaver]
        liveness = self.liveness
        stays = self.live(candidates)
        return stays + [m for m in candidates if m not in stays and liveness.alive(m) and m not in liveness.finished()]

    def accept_leave(self, peer: int, weight: float) -> str:
        """Whether to absorb push-sum mass `weight` that `peer` hands over as it leaves: "" (yes,
        once) or why not. Only a member that the current or a pending view drops may hand over,
        once per time it was a member, and no more than all the mass of its last members (Σ w of
        push-sum is the member count). A refusal is logged and counted (rejected_messages, "leave")."""
        dropping = self.views.dropping_view(peer)
        if dropping is None:
            reason = (f"node {peer} is a member of the latest view" if peer in self.views.latest.members
                      else f"node {peer} never was a member")
        elif (peer, dropping.epoch) in self._leaves_taken:
            reason = f"node {peer} already handed over its mass when view {dropping.epoch} dropped it"
        else:
            held = len(self.views.view_at(max(dropping.switch_step - 1, 0)).members)
            reason = "" if 0.0 < weight <= held else \
                f"weight {weight:.4g} is not in (0, {held}] (the mass its {held} members hold)"
        if not reason:
            self._leaves_taken = self._leaves_taken | {(peer, dropping.epoch)}
            return ""
        self.refused_leaves += 1
        if self.liveness.metrics is not None:
            self.liveness.metrics.on_rejected("leave")
        log.warning("node %d: refused a LEAVE of node %d: %s", self.rank, peer, reason)
        return reason

    # Who is alive (liveness) ----------------------------------------------------------------------
    def live(self, peers: Iterable[int]) -> list[int]:
        """The peers not considered dead or lagging (algorithms neither send to nor wait for them)."""
        return self.liveness.live(peers)

    def all_alive(self) -> bool:
        """No peer is dead or lagging (a collective over all nodes can complete)."""
        liveness = self.liveness
        return not liveness.dead() and not any(liveness.lagging(p) for p in liveness.peers)

    def dead(self) -> frozenset[int]:
        return self.liveness.dead()

    def finished(self) -> frozenset[int]:
        """The peers that said their run is over."""
        return self.liveness.finished()

    def peer_step(self, peer: int, heard_since: int | None = None) -> int | None:
        """The latest step `peer` was heard at (a message, an Ack, a Hello); None if never, or
        (with `heard_since`) not since this node was at that step."""
        return self.liveness.peer_step(peer, heard_since)

    def sent_step(self, peer: int, kind: int) -> int | None:
        """The latest step of a `kind` message from `peer` (None: none came)."""
        return self.liveness.sent_step(peer, kind)

    def seconds_for_lag(self, lags: int = 1) -> float:
        """About how long this node takes for `lags` lag limits of steps at its measured pace (0.0
        before it has one): how long a member up to the lag limit behind needs to come level (one
        further behind catches up by state transfer instead)."""
        return self.greetings.pace.seconds_for(lags * self.liveness.max_lag)

    def probe(self, peer: int) -> bool:
        """Hello `peer` once without waiting for a connection (from the training thread); declares it
        dead if it does not answer."""
        greetings = self.greetings
        return greetings.loop.submit(greetings.probe(peer)).result(greetings.probe_timeout + 10)

    def must_catch_up(self) -> bool:
        """A peer declared this node dead (it stalled), or it trails the cluster by more than the
        lag limit: it must rejoin through a state transfer. Lag alone does not count while a
        pending view drops a dead member and keeps this node: rings skip their rounds until that
        switch, so the members run apart at compute speed, and the switch re-aligns them; a node
        still behind after it catches up then. (Else a survivor of a crash, a few fast steps
        behind, asked a donor that waited for it in the switch average: both stalled a link
        deadline.)"""
        liveness = self.liveness
        if not liveness.must_catch_up():
            return False
        if liveness.excluded_by():
            return True
        latest, step = self.views.latest, liveness.step
        return not (latest.switch_step > step and self.rank in latest.members and self.departing(step))

    def recheck_if_isolated(self) -> bool:
        """If this node considers at least half of the other members dead, it may be the one that
        went away (a long freeze: everyone declared it dead while it declared them dead). Hello
        those peers again, at most once per lag limit of steps, in the background: an answer that
        excludes it makes must_catch_up() true. Returns whether it looked isolated."""
        others = [p for p in self.views.latest.members if p != self.rank]
        dead = [p for p in others if p in self.liveness.dead()]
        if not dead or 2 * len(dead) < len(others):
            return False
        step = self.liveness.step
        if step >= self._rechecked_at + self.liveness.max_lag:
            self._rechecked_at = step
            self.greetings.loop.submit(self.greetings.recheck_dead(dead))  # (not waited for)
        return True

    def runs_ahead(self) -> list[int]:
        """The members this node runs ahead of, alone (Liveness.runs_ahead)."""
        return self.liveness.runs_ahead()

    def refresh(self, peers: Iterable[int]) -> None:
        """Hello `peers` once, together (probes: each reply tells its step now; a peer that does not
        answer is declared dead)."""
        greetings = self.greetings
        futures = [greetings.loop.submit(greetings.probe(peer)) for peer in peers]
        for future in futures:
            future.result(greetings.probe_timeout + 10)

    def lag_report(self) -> str:
        """Why this node must catch up, for logs."""
        return f"excluded by {sorted(self.liveness.excluded_by())}, {self.liveness.behind()} steps behind the cluster"

    # What this node stands for (proposals) -------------------------------------------------------
    def reconcile(self) -> int:
        """Propose the members this node stands for, if the latest view differs (see the module
        doc). Cheap when nothing differs; returns the latest view's switch step."""
        latest = set(self.views.latest.members)
        out = {self.rank} if self.leaving else set()
        if self.drop_dead:
            out |= set(self.liveness.dead()) & latest
        into = {self.rank} if self.wants_in and not self.leaving and not self.liveness.must_catch_up() else set()
        target = (latest | into) - out
        if target and target != latest:  # (the last member cannot leave: it trains on)
            self.propose(into=into - latest, out=out & latest)
        elif self._placing and self.liveness.step >= PLACEMENT_AFTER and self.greetings.pace.steps_in(PLACEMENT_NOTICE):
            self._placing -= 1  # (once decided, never again: later views keep the layout)
            if self.place_by_reachability() is not None:
                self._placing = 0
        return self.views.latest.switch_step

    def leave(self) -> None:
        """Stand for the members without this node: it trains up to the step before they switch
        (first_step_without_me), then hands over what it holds and stops."""
        self.leaving = self.greetings.leaving = True
        self.reconcile()

    def drop_dead_members(self) -> None:
        """From now on, stand for the members without those this node declared dead (a ring
        re-forms without them; one that rejoins is no longer dead, and proposes itself again)."""
        self.drop_dead = True
        self.reconcile()

    def realign(self) -> None:
        """Propose the current members again, unless a switch is pending: a new view over the same
        ranks, at whose switch every ring member averages the model with a long deadline, which
        brings nodes that fell out of step (rounds failing forever) back together."""
        if self.views.latest.switch_step <= self.liveness.step:
            log.warning("node %d: the ring keeps failing; proposing to re-form it", self.rank)
            self.propose()

    def lay_out(self, timeout: float) -> None:
        """Before this node says it is ready (the others wait for that): if it may be the lowest
        public member, greet every peer, wait (at most LAY_OUT_WAIT seconds) until each has said
        whether it is public, and propose a layout, so that it is in every view before step 0."""
        greetings = self.greetings
        others = greetings.others()
        if greetings.reachability != pb.REACHABILITY_PUBLIC or any(
                greetings.peer_reachability.get(m) == pb.REACHABILITY_PUBLIC for m in others if m < self.rank):
            return
        greetings.wait_for_peers(timeout)
        deadline = time.monotonic() + LAY_OUT_WAIT
        while (decided := self.place_by_reachability()) is None and time.monotonic() < deadline:
            unknown = [m for m in others if m not in greetings.peer_reachability]
            futures = [greetings.loop.submit(greetings.hello(peer, 1.0, wait_for_ready=False)) for peer in unknown]
            for future in futures:
                with contextlib.suppress(Exception):  # (not up to it yet: asked again)
                    future.result(5)
            time.sleep(0.1)
        if decided is not None:
            self._placing = 0

    def place_by_reachability(self) -> bool | None:
        """Lay the members out so that private peers behind different NATs are no ring neighbours
        (placement.py): proposed once every member's reachability is known, by the lowest-ranked
        public member alone, and only when it has fewer such neighbours than the order in force.
        Private peers are grouped by the host their Hellos came from (their NAT's). True if proposed,
        False if there is nothing to propose here, None while a member's reachability is unknown."""
        greetings = self.greetings
        latest = self.views.latest
        said = {m: greetings.peer_reachability.get(m, pb.REACHABILITY_UNKNOWN) for m in latest.members}
        said[self.rank] = greetings.reachability
        if pb.REACHABILITY_UNKNOWN in said.values():
            return None
        public = [m for m, value in said.items() if value == pb.REACHABILITY_PUBLIC]
        if not public or min(public) != self.rank:
            return False
        nat_of = {m: greetings.seen_from.get(m) or f"node {m}" for m, value in said.items()
                  if value == pb.REACHABILITY_PRIVATE}
        order = place(latest.members, nat_of)
        if neighbours_apart(order, nat_of) >= neighbours_apart(latest.placed, nat_of):
            return False
        log.info("node %d: laying the members out as %s (private behind NATs: %s)", self.rank, list(order),
                 {m: nat_of[m] for m in sorted(nat_of)})
        greetings.propose_view(self.view_margin, max(self.view_notice, PLACEMENT_NOTICE), placement=order)
        return True

    def propose(self, into=(), out=()) -> int:
        """Propose that the members with `into` and without `out` (applied to the latest view when
        it is proposed; neither: the same members again) train together from `view_margin` steps
        past the furthest step any member is at (and `view_notice` seconds at the pace of the
        steps), and tell every old and new member; returns the switch step in force."""
        return self.greetings.propose_view(self.view_margin, self.view_notice, into=into, out=out)

    # Steps, start-up and rejoining -----------------------------------------------------------------
    @property
    def step(self) -> int:
        return self.liveness.step

    @property
    def resume_step(self) -> int:
        """The step a rejoined node resumes at (said in its Hellos)."""
        return self.greetings.resume_step

    def set_step(self, step: int) -> None:
        """This node's current step (the lag and the pace of view switches are measured from it)."""
        self.liveness.step = step
        self.greetings.pace.note(step)

    def survey(self, timeout: float = 2.0, everyone: bool = False, peers=None) -> ClusterSurvey:
        """How many peers answer a Hello, and whether the cluster already runs (`everyone`: a
        (re)joiner also asks the ranks of no view it knows; `peers`: only those; Greetings.survey)."""
        return self.greetings.survey(timeout, everyone, peers)

    def hello(self, peer: int, timeout: float = 10.0) -> pb.HelloReply:
        """Greet `peer` once (from the training thread), waiting up to `timeout` for it to come up;
        its reply (SendFailure if it gives none)."""
        greetings = self.greetings
        return greetings.loop.submit(greetings.hello(peer, timeout)).result(timeout + 5)

    def wait_for_peers(self, timeout: float = 60.0, *, require_ready: bool = False, peers=None) -> None:
        """Hello every peer (or those of `peers`) until it is up (and ready, with require_ready);
        PeerError otherwise."""
        self.greetings.wait_for_peers(timeout, require_ready=require_ready, peers=peers)

    def wait_for_step(self, step: int, timeout: float) -> None:
        """Wait until every live peer reports a current step >= `step` (the cluster resumed from
        checkpoints of the same step: a peer still at step 0 would refuse our messages)."""
        self.greetings.wait_for_step(step, timeout)

    def asking_for_state(self) -> frozenset[int]:
        return self.greetings.asking_for_state()

    def entered(self, peer: int, step: int) -> None:
        """`peer` entered at `step`'s switch and took the members' state from this node there: it
        trains with them from that step on, so it is awaited from it (no first message of its own
        needs to confirm it, as after a rejoin)."""
        self.liveness.confirmed(peer, step)

    def take_state_requests(self) -> list[tuple[int, bool]]:
        """Peers that asked (in a Hello) for this node's state since the last call, each with
        whether it holds state already (a member catching up: it gets a share, not a new unit)."""
        return self.greetings.take_state_requests()

    def ask_for_state(self) -> StateAnswers:
        """Ask the peers once for their state (the first ready one that accepts sends it as a STATE
        message); how each answered. Waits for nobody's messages until they have sent to us."""
        self.liveness.rejoining()
        return self.greetings.ask_for_state()

    def finish(self) -> None:
        """This node's training is over: it answers Hellos still, but serves no state request (a
        joiner asking it would wait for a step boundary that never comes), and it tells the peers
        it exchanged tensors with, so none waits for a message it will never send
        (Greetings.announce_finished). Only they wait for its messages: a peer this node stopped
        sending to (it lagged, or stalled) got some before. (Telling every peer it met, as before,
        told every proposer and joiner of the run too: 90 Hellos a node at 256 simulated nodes
        with churn, O(n) per node where its neighbours are O(log n).)"""
        self.greetings.finished = True
        if self.outstanding is not None:
            among = self.sent_to() | self.liveness.senders() if self.sent_to is not None else None
            self.greetings.announce_finished(self.outstanding, FINISH_ANNOUNCE_SECONDS, among)

    def rejoined(self, step: int) -> int:
        """A state transfer completed: resume at `step` or later as a new incarnation (so peers
        that declared this node dead take it back), and tell every peer once this node is ready (a
        restarted node announces after its setup). Returns the step it resumes at."""
        self.greetings.rejoined()
        self.resume_at(step)
        return self.announce_ready() if self.greetings.ready else step

    def abandon_catch_up(self) -> None:
        """No donor could be had (e.g. the others finished): train on, forgetting who excluded us."""
        self.liveness.rejoined()

    def announce_ready(self) -> int:
        """Tell every peer (one Hello each, failures ignored) that this node is ready again; returns
        the step it resumes at: the resume step, or the furthest step a peer is at when it learns, if
        the cluster moved on while this node fetched and loaded its state. Nobody sent it anything
        for the steps in between, so running them would only push mass out (SGP: w halves with
        every step that brings nothing in); and a peer of a lockstep ring (AllReduce, Pipe-SGD)
        that reports step s is inside step s, waiting for this node's share of it, so s (not s + 1)
        keeps the ring's rounds aligned."""
        steps = self.greetings.announce_ready()
        if steps and max(steps) > self.greetings.resume_step:
            self.resume_at(max(steps))
        return self.greetings.resume_step

    def resume_at(self, step: int) -> None:
        """A rejoined node continues at `step`: say so in Hellos and measure lags from there."""
        self.greetings.resume_step = step
        self.set_step(step)


__all__ = ["Membership"]
