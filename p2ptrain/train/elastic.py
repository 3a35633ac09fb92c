"""A node's membership lifecycle, as the training engine drives it at step boundaries:

    starting ─────────────────────┐
    joining (takes a donor's state)┴─► member ──► leaving ──► left
                                 catching up ◄─┘ (stalled: a peer excluded it, or it fell too far behind)

A joiner (a new member, or a restarted process) takes a live peer's state before its algorithm sets
up, then trains from the step its view switches at. A member serves the state requests of joiners at
step boundaries, where its state is consistent. A leaver proposes the members without itself,
trains up to the switch, and hands over what it holds (push-sum mass). A member that stalled takes
a state transfer from a peer that saw it leave and merges it (Algorithm.adopt_state). The
transport's Membership carries the protocol; this module only decides when.
"""
from __future__ import annotations

import enum
import logging
import time
from typing import TYPE_CHECKING

from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.train.errors import LeftCluster, NonFiniteError
from p2ptrain.train.state import ModelState
from p2ptrain.transport.errors import NoClusterToRejoin, PeerError
from p2ptrain.transport.validation import all_finite

if TYPE_CHECKING:
    from p2ptrain.algorithms.base import Algorithm
    from p2ptrain.communicator import Communicator
    from p2ptrain.transport.message import Message

log = logging.getLogger(__name__)
STATE = pb.MESSAGE_KIND_STATE
HOLD_BACK_POLL = 0.2  # seconds between looks at the members behind, while a node ahead waits for them
# a joiner gives up when no member made a step for this many peer timeouts (fetch_state)
STILL_CLUSTER_TIMEOUTS = 3


class Phase(enum.Enum):
    STARTING = "starting"
    JOINING = "joining"
    MEMBER = "member"
    CATCHING_UP = "catching up"
    LEAVING = "leaving"
    LEFT = "left"


class Lifecycle:
    """Node `comm.rank`'s phase, and the state transfers that move it on; `state` is its model."""

    def __init__(self, comm: Communicator, algorithm: Algorithm, state: ModelState, metrics=None):
        self.comm = comm
        self.membership = comm.membership
        self.algorithm = algorithm
        self.state = state
        self.metrics = metrics
        self.rank = comm.rank
        self.phase = Phase.JOINING if self.membership.joining else Phase.STARTING
        self.late_states: list[Message] = []  # states that arrived besides the one taken (see fetch_state)
        self.catch_ups = 0            # state transfers taken after stalling
        self.holds = 0                # times this node held back for members far behind it (hold_back)
        self.leave_at: int | None = None  # the step the members switch to a view without this node
        self._leave_requested = False
        self._catch_up_after = 0      # no new catch-up attempt before this step (after a failed one)
        # a (re)joiner's wall-clock times (time.time(), comparable with the launcher's fault log):
        # "asked" for a state, got the "state", "trained" its first step as a member (bench heal)
        self.timeline: dict[str, float] = {}

    # Joining ----------------------------------------------------------------------------------------
    def join(self) -> int:
        """Before the algorithm sets up: a joiner takes a donor's state into the model; the step it
        would continue at (0 for a node that starts with the others)."""
        if self.phase is not Phase.JOINING:
            return 0
        self.timeline["asked"] = time.time()
        joined = self.fetch_state()
        self.timeline["state"] = time.time()
        self.timeline["state_bytes"] = float(joined.tensor.numel() * joined.tensor.element_size())
        self.state.load(joined.tensor)
        return joined.step + 1

    def step_done(self) -> None:
        """After each step: the first one of a (re)joiner ends its join on the timeline."""
        if "asked" in self.timeline and "trained" not in self.timeline:
            self.timeline["trained"] = time.time()

    def joined(self, step: int) -> int:
        """After the algorithm set up (a joiner announced itself in comm.ready()): the step to start
        at, from `step` on: where the cluster is now, or the switch of the view that makes this node
        a member."""
        if self.phase is Phase.JOINING:
            step = max(step, self.membership.resume_step)
            step = self.membership.first_step_as_member(step) or step
        self._adopt_late_states()
        self.phase = Phase.MEMBER
        return step

    def fetch_state(self, timeout: float | None = None, serve_at: int | None = None) -> Message:
        """Ask the live peers for a state and wait for it (like hivemind's load_state_from_peers), as
        a new incarnation, so peers that declared this node dead take it back. Sets comm.joined.

        A donor serves at its next step boundary: one that sends nothing within a slice (a link
        deadline) is asked again, and another peer if it stopped answering. It never gives up while
        a member with state may still answer and the cluster moves on: it stops with
        NoClusterToRejoin once every peer is gone or holds no state itself (the run has finished),
        with PeerError when no member made a step for STILL_CLUSTER_TIMEOUTS peer timeouts (a
        donor's step boundary may come only after a switch's model and optimizer-state averages
        each waited up to the peer timeout for a stalled member, and its hand-outs: a joiner that
        gave up after one timeout exited while its donor was about to serve it), or (`timeout`, a
        catch-up: a member may train on alone and try again later) after `timeout` seconds. A member that
        catches up (`serve_at`: the step boundary it is at) serves state requests meanwhile: two
        nodes that each declared the other dead would otherwise wait for each other."""
        comm, membership, transport = self.comm, self.membership, self.comm.transport
        comm.expect(STATE, self.state.dtype, self.state.numel, preallocate=1)
        wait = max(1.0, comm.link_deadline)  # one slice of waiting for a donor, or between rounds
        started = moved_at = time.monotonic()
        furthest, empty_since = -1, None
        try:
            while True:
                if serve_at is not None:
                    self.serve_joiners(serve_at)
                answers = membership.ask_for_state()
                now = time.monotonic()
                if max(answers.ready.values(), default=-1) > furthest:  # the cluster still moves
                    furthest, moved_at = max(answers.ready.values()), now
                if answers.live:
                    empty_since = None
                elif empty_since is None:
                    empty_since = now
                still = STILL_CLUSTER_TIMEOUTS * comm.peer_timeout
                waited_out = now - moved_at >= still or (timeout is not None and now - started >= timeout)
                # every peer gone for two slices (one may be restarting too), or still gone when we give up,
                # or gone with one of them saying it finished the run (a restarting one would find nobody either)
                if empty_since is not None and (waited_out or now - empty_since >= 2 * wait or answers.finished):
                    raise NoClusterToRejoin(f"node {self.rank}: no live member has a state to give (the cluster has "
                                            f"finished): {answers.problems}")
                if waited_out:
                    raise PeerError(f"node {self.rank}: no state from any peer within "
                                    f"{min(still, timeout or still):.0f}s: {answers.problems}")
                if answers.donor is None:
                    self._abort_join_if_leaving()
                    time.sleep(min(0.5, wait))
                    continue
                try:
                    messages = transport.recv_any(STATE, timeout=wait)
                except TimeoutError:
                    self._abort_join_if_leaving()
                    log.info("node %d: no state from node %d yet; asking again", self.rank, answers.donor)
                    continue
                state, *late = [comm.received(m) for m in messages]
                self.late_states.extend(late)  # an earlier donor answered too: SGP merges that mass as well
                comm.joined = state
                membership.rejoined(state.step + 1)
                if membership.greetings.ready:  # caught up: a member again, if it was dropped
                    membership.reconcile()
                log.info("node %d: rejoined with node %d's state of step %d (ps-weight %.4g)", self.rank,
                         state.sender, state.step, state.ps_weight)
                return state
        finally:
            transport.unexpect(STATE)  # a state push nobody asked for is refused (the donor keeps it)

    def _abort_join_if_leaving(self) -> None:
        """Asked to leave (SIGTERM) while joining, before any state came: it holds nothing, so it
        just goes (a state that arrives later is refused, and its donor keeps it)."""
        if self._leave_requested and self.phase is Phase.JOINING:
            log.warning("node %d: asked to leave while joining; leaving before taking any state", self.rank)
            raise LeftCluster(self.rank, 0)

    def _adopt_late_states(self) -> None:
        """States that reached us while rejoining besides the one used (an earlier donor answered
        late): for push-sum they are mass, merged like the first."""
        while self.late_states:
            self.state.load(self.algorithm.adopt_state(self.late_states.pop(0), self.state.vector()))

    # As a member ------------------------------------------------------------------------------------
    def serve_joiners(self, step: int) -> None:
        """Give (re)joining peers this node's state at the boundary after `step`. A fresh process
        (a node new to the members, or one restarted after a crash: it holds nothing) gets its
        start state (Algorithm.welcome: push-sum mints it a new unit, since whatever its crashed
        self held is gone); a member catching up gets a share (Algorithm.donate_state). Once set up
        to receive everything, a joiner proposes itself as a member (Communicator.ready)."""
        self.membership.reconcile()
        for peer, holds_state in self.membership.take_state_requests():
            vector = self.state.vector()
            if not holds_state:
                changed = self.algorithm.welcome(peer, step, vector)
            else:
                changed = self.algorithm.donate_state(peer, step, vector)
            if changed is not None:
                self.state.load(changed)
            if self.metrics is not None:
                self.metrics.on_state_transfer(peer)
            log.info("step %d: sent this node's state to rejoining peer %d", step, peer)

    def keep_pace(self, step: int) -> None:
        """After `step`: a node that is no member at the next step (a joiner before the switch of
        the view that admits it) waits for nobody's shares, so on a light workload it ran far ahead
        of the members, past every switch proposed to admit it (joins of a minute at 64 simulated
        nodes). It steps no further ahead than the furthest live member it knows of, greeting that
        member for its step meanwhile, at most three link deadlines per step. Never active for a
        member."""
        membership, liveness = self.membership, self.membership.liveness

        def ahead_of() -> list[int]:
            """[the furthest member], while this node is outside the members and ahead of it."""
            if self.rank in membership.members(step + 1):
                return []
            finished = liveness.finished()
            members = [m for m in membership.live(membership.members(step + 1)) if m not in finished]
            known = {m: -1 if liveness.peer_step(m) is None else liveness.peer_step(m) for m in members}
            furthest = max(members, key=known.__getitem__, default=None)
            return [furthest] if furthest is not None and known[furthest] < step else []

        self._greet_while(step, ahead_of, 3 * self.comm.link_deadline)

    def hold_back(self, step: int) -> None:
        """After `step`: a node that finds most live members over the lag limit behind it waits for
        them, serving their state requests and greeting them for their steps, instead of racing on
        alone (each step it ran alone widened the gap, and a lone racer drags the run's end, and a
        chaos run's fault schedule, along with it). It waits at most two lag limits of steps at
        its pace, at least three link deadlines. Never active without faults."""
        membership = self.membership
        behind = membership.runs_ahead()
        if not behind:
            return
        self.holds += 1
        patience = max(3 * self.comm.link_deadline, membership.seconds_for_lag(2))
        log.info("node %d: at step %d, most members (%s) are over the lag limit behind; waiting up to %.0fs for "
                 "them", self.rank, step, behind, patience)
        behind = self._greet_while(step, membership.runs_ahead, patience)
        if behind:
            log.warning("node %d: members %s still over the lag limit behind after %.0fs; training on", self.rank,
                        behind, patience)

    def await_members_at_end(self, step: int) -> None:
        """Before the end of the run's agreement (Algorithm.agree_at_end), at the last step `step`:
        wait for the members last heard of over the lag limit behind it, neither dead nor finished,
        greeting them for their steps, then greet the other members once. Rings skip their rounds
        while a pending view drops a member, so when that view switches past the end the members
        run apart at compute speed, and one stalled meanwhile was past the step window: every end
        agreement with it failed at once ("may differ at the end") and the members ended apart.
        One that answers comes level and agrees with them; one that does not is declared dead,
        and the agreement leaves it out (it ends alone, as a node the members saw die); the
        greeting finds those gone since (a member that finished and exited), so that every node
        takes the same members. At most two lag limits at this node's pace, at least three link
        deadlines. The engine calls it only where the algorithm ended apart
        (Algorithm.apart_at_end): never without faults. A leaver is no member there: it skips it."""
        membership, liveness = self.membership, self.membership.liveness
        if self.rank not in membership.members(step):
            return

        def others() -> list[int]:
            gone = liveness.finished() | liveness.dead()
            return [m for m in membership.members(step) if m != self.rank and m not in gone]

        def far_behind() -> list[int]:
            return [m for m in others() if (liveness.peer_step(m) or 0) + liveness.max_lag < step]

        behind = far_behind()
        if behind:
            patience = max(3 * self.comm.link_deadline, membership.seconds_for_lag(2))
            log.info("node %d: at the last step %d, members %s were last heard over the lag limit behind; waiting "
                     "up to %.0fs for them", self.rank, step, behind, patience)
            behind = self._greet_while(step, far_behind, patience)
            if behind:
                log.warning("node %d: members %s still over the lag limit behind after %.0fs; the run ends without "
                            "waiting longer", self.rank, behind, patience)
        membership.refresh(others())

    def _greet_while(self, step: int, waiting_on, patience: float) -> list[int]:
        """While `waiting_on()` names peers (for at most `patience` seconds), serve state requests
        at this boundary and greet those peers for their steps, every HOLD_BACK_POLL; the peers
        still named at the end ([] once none is)."""
        deadline = time.monotonic() + patience
        peers = waiting_on()
        while peers and time.monotonic() < deadline:
            self.serve_joiners(step)
            self.membership.refresh(peers)
            peers = waiting_on()
            if peers:
                time.sleep(HOLD_BACK_POLL)
        return peers

    def catch_up(self, step: int) -> int:
        """After `step`: if this node stalled (a peer excluded it, or it trails the cluster by more
        than the lag limit), take a state transfer from a peer that saw it leave and merge it;
        returns the step to continue at."""
        membership = self.membership
        membership.recheck_if_isolated()
        if step < self._catch_up_after or not membership.must_catch_up():
            return step + 1
        self.phase = Phase.CATCHING_UP
        log.warning("node %d: fell behind at step %d (%s); catching up", self.rank, step, membership.lag_report())
        try:
            # a member may train on alone and try again: wait about two lag limits of steps at its pace
            patience = membership.seconds_for_lag(2)
            donated = self.fetch_state(timeout=max(3 * self.comm.link_deadline, patience), serve_at=step)
        except (TimeoutError, RuntimeError) as exc:  # e.g. the others have finished: train on alone
            log.warning("node %d: could not catch up (%s); training on from step %d", self.rank, exc, step + 1)
            membership.abandon_catch_up()
            self._catch_up_after = step + membership.liveness.max_lag
            self.phase = Phase.MEMBER
            return step + 1
        self.state.load(self.algorithm.adopt_state(donated, self.state.vector()))
        self._adopt_late_states()
        self.catch_ups += 1
        if not all_finite(self.state.vector()):
            raise NonFiniteError(self.rank, donated.step, "model after catching up")
        self.phase = Phase.MEMBER
        resume = max(step + 1, donated.step + 1, membership.resume_step)
        return max(resume, membership.first_step_as_member(resume) or resume)  # re-admitted: from its view's switch

    # Leaving ----------------------------------------------------------------------------------------
    def request_leave(self) -> None:
        """Leave at the next step boundary (SIGTERM in an elastic run, or the user's request)."""
        self._leave_requested = True

    def leave_due(self, step: int) -> int | None:
        """With a leave requested: propose it once (Membership.reconcile proposes again if a
        concurrent change won); once `step` is the last step as a member, the step the others
        switch at (the caller finishes, then hand_over), else None."""
        if not self._leave_requested:
            return None
        if self.phase is not Phase.LEAVING:
            self.phase = Phase.LEAVING
            self.membership.leave()
        self.leave_at = self.membership.first_step_without_me(step + 1)
        if self.leave_at is None or step + 1 < self.leave_at:
            return None
        return self.leave_at

    def hand_over(self, leave_at: int) -> None:
        """Give what this node holds that the others need to a live member that stays, in the order
        Membership.hand_over_order gives (the first one waits for it at its own finish)."""
        membership, liveness = self.membership, self.membership.liveness
        stays = membership.hand_over_order(self.rank, leave_at)
        if not stays:
            log.warning("node %d: no member to hand over to at step %d: members %s, dead %s, finished %s", self.rank,
                        leave_at, list(membership.members(leave_at)), sorted(liveness.dead()),
                        sorted(liveness.finished()))
        self.algorithm.hand_over(stays, leave_at)
        self.phase = Phase.LEFT


__all__ = ["Lifecycle", "Phase"]
