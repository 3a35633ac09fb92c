"""Liveness rules that keep a stalled peer from corrupting the others (issue 10, part 1):
who is dead, who lags, who comes back (only a new incarnation), who gets our state."""
from __future__ import annotations

import time

from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.transport.membership.liveness import Liveness
from p2ptrain.transport.membership.views import View, Views


def membership(rank: int = 0, world_size: int = 4, max_lag: int = 5) -> Liveness:
    return Liveness(rank, world_size, Views(rank, tuple(range(world_size)), world_size), max_lag=max_lag)


def test_a_peer_seen_far_behind_is_lagging_and_neither_sent_to_nor_awaited():
    m = membership()
    m.step = 100
    m.note_step(1, 99)
    m.note_step(2, 90)
    assert not m.lagging(1) and m.lagging(2)
    assert m.live([1, 2, 3]) == [1, 3]
    assert m.awaited([1, 2, 3], step=99) == [1, 3]
    assert m.awaited([1, 2, 3], step=99, laggards=True) == [1, 2, 3]  # (rings: they cannot complete without it)
    m.mark_dead(3, "test")
    assert m.awaited([1, 2, 3], step=99, laggards=True) == [1, 2]


def test_a_node_runs_ahead_only_of_most_live_members_far_behind_it():
    """Most live members over the lag limit behind: this node runs ahead alone and holds back for
    them (Lifecycle.hold_back). Half of them behind, or laggards that are dead, or members within
    the lag limit: it does not."""
    m = membership(rank=0, world_size=5, max_lag=5)
    m.step = 100
    m.note_step(1, 90)
    m.note_step(2, 80)
    m.note_step(4, 98)
    assert m.runs_ahead() == []  # two of four behind: not most
    m.note_step(3, 10)
    assert m.runs_ahead() == [1, 2, 3]
    m.mark_dead(1, "test")
    m.mark_dead(2, "test")
    assert m.runs_ahead() == []  # of the live members 3 and 4, only 3 is behind
    m.step = 200
    m.note_step(4, 150)
    assert m.runs_ahead() == [3, 4]
    m.note_step(3, 199)
    m.note_step(4, 200)
    assert m.runs_ahead() == []


def test_lag_is_judged_when_seen_never_extrapolated():
    """A peer we last heard from at step 0 while we were at step 0 is not lagging at step 500:
    we simply have no news of it (a ring neighbour's neighbour, say)."""
    m = membership()
    m.note_step(3, 0)
    m.step = 500
    assert not m.lagging(3)
    m.note_step(3, 0)  # the same old step seen again now: it really is far behind
    assert m.lagging(3)
    m.note_step(3, 498)
    assert not m.lagging(3)


def test_a_dead_peer_returns_only_as_a_new_incarnation():
    m = membership()
    m.hello(2, ready=True, incarnation=11, current_step=0, resume_step=0)
    m.mark_dead(2, "probe")
    assert m.excludes(2)
    m.hello(2, ready=True, incarnation=11, current_step=40, resume_step=0)  # woke up from a stall
    m.heard_from(2, step=41)                                              # and sent us a share
    assert not m.alive(2), "a stalled peer that simply resumes must rejoin first"
    m.hello(2, ready=True, incarnation=12, current_step=90, resume_step=90)  # after its state transfer
    assert m.alive(2) and not m.excludes(2)
    # It may move on past step 90 (to the cluster's step): awaited from its first share on.
    assert m.live([2]) == [2] and m.awaited([2], step=90) == []
    m.heard_from(2, step=97, kind=pb.MESSAGE_KIND_PUSH_SUM)
    assert m.awaited([2], step=96) == [] and m.awaited([2], step=97) == [2]


def test_a_rejoined_peer_far_behind_our_step_is_sent_to_not_judged_lagging():
    """It resumes at the cluster's step, not at the step it announced: push to it at once."""
    m = membership(max_lag=5)
    m.step = 400
    m.mark_dead(3, "probe")
    m.hello(3, ready=True, incarnation=2, current_step=300, resume_step=301)
    assert m.live([3]) == [3] and not m.lagging(3)


def test_after_our_rejoin_a_peer_is_awaited_from_its_reply_or_its_first_training_message():
    """Nobody sent to us for the steps before it learned we were back: never wait for those."""
    m = membership(rank=0)
    m.rejoining()
    m.rejoined()
    m.step = 120
    assert m.awaited([1, 2, 3], step=120) == []
    m.confirmed(1, since_step=125)                                # answered our announce at its step 124
    m.heard_from(2, step=119, kind=pb.MESSAGE_KIND_STATE)        # the donor's state is no confirmation
    m.heard_from(3, step=122, kind=pb.MESSAGE_KIND_PUSH_SUM)     # its first share after our rejoin
    assert m.awaited([1, 2, 3], step=121) == []
    assert m.awaited([1, 2, 3], step=122) == [3]
    assert m.awaited([1, 2, 3], step=125) == [1, 3]


def test_a_restarted_process_asking_for_state_retires_its_earlier_self():
    m = membership()
    m.hello(1, ready=True, incarnation=5, current_step=30, resume_step=0)
    assert not m.may_donate_to(1, incarnation=5), "never left: no state for a forged want_state"
    m.hello(1, ready=False, incarnation=6, current_step=0, resume_step=0)  # a new process, fetching state
    assert not m.alive(1) and m.may_donate_to(1, incarnation=6)
    m.hello(1, ready=True, incarnation=7, current_step=31, resume_step=31)
    assert m.alive(1)


def test_donation_needs_a_peer_that_left_or_lags():
    m = membership()
    m.step = 50
    m.hello(3, ready=True, incarnation=9, current_step=49, resume_step=0)
    assert not m.may_donate_to(3, incarnation=9)
    m.note_step(3, 49)
    m.step = 80
    m.note_step(3, 49)
    assert m.may_donate_to(3, incarnation=9)  # lagging
    m2 = membership()
    m2.mark_dead(3, "probe")
    assert m2.may_donate_to(3, incarnation=0)


def test_a_node_catches_up_when_excluded_or_far_behind_and_forgets_old_news_after():
    m = membership(rank=2)
    assert not m.must_catch_up()
    m.step = 10
    for peer, step in ((0, 200), (1, 210), (3, 205)):
        m.note_step(peer, step)
    assert m.behind() == 195 and m.must_catch_up()
    m.rejoined()
    m.step = 211
    assert m.behind() == 0 and not m.must_catch_up()
    m.excluded(by_peer=1)
    assert m.must_catch_up() and m.excluded_by() == {1}
    m.rejoined()
    assert not m.must_catch_up()


def test_a_node_behind_only_finished_peers_does_not_try_to_catch_up():
    """Peers whose run is over give no state: trailing them is no reason to ask for one (a
    64-node churn run's last joiner waited 120 s for a donor at its last step). Behind the peers
    still training, it does catch up."""
    m = membership(rank=2)
    m.step = 10
    for peer, step in ((0, 200), (1, 210), (3, 205)):
        m.note_step(peer, step)
    for peer in (0, 1):
        m.note_finished(peer)
    assert m.behind() == 195 and m.must_catch_up()  # node 3 still trains
    m.note_finished(3)
    assert m.behind() == 0 and not m.must_catch_up()


def test_a_joiner_judges_whether_it_is_behind_only_by_what_it_saw_since_a_view_admitted_it():
    """Node 4 joins at step 30 (view 1). Before that it waited for nobody and ran from the state's
    step to the members' while they moved a few steps: what it saw then (members 20 steps ahead
    of it) says nothing about where it stands once admitted. It used to take itself for a laggard
    and leave to catch up (a link deadline lost by every member waiting for its share)."""
    views = Views(4, (0, 1, 2, 3), 5)
    m = Liveness(4, 5, views, max_lag=5)
    m.step = 8
    for peer in (0, 1, 2, 3):
        m.note_step(peer, 28)  # seen from step 8 of its run to the members' step
    views.adopt(View(1, 0, 30, (0, 1, 2, 3, 4), entering=(4,)))
    m.step = 31
    assert m.behind() == 0 and not m.must_catch_up()
    for peer in (0, 1, 2):
        m.note_step(peer, 45)  # seen since: far ahead now, and that counts
    assert m.behind() == 14 and m.must_catch_up()
    initial = membership(rank=2)  # (an initial member counts everything it saw, as before)
    initial.step = 8
    for peer in (0, 1, 3):
        initial.note_step(peer, 28)
    assert initial.behind() == 20 and initial.must_catch_up()


def test_a_joiner_is_judged_lagging_only_by_what_it_was_seen_at_since_a_view_admitted_it():
    """The members' side of the same: node 0 saw joiner 4 at step 8 of its run to the members'
    step, while it was at step 28 itself. Once a view admits node 4 at step 30, that old sighting
    does not make it a laggard (it was neither sent to nor awaited, and waited a link deadline for
    node 0's share); one since does."""
    views = Views(0, (0, 1, 2, 3), 5)
    m = Liveness(0, 5, views, max_lag=5)
    m.step = 28
    m.note_step(4, 8)
    views.adopt(View(1, 0, 30, (0, 1, 2, 3, 4), entering=(4,)))
    m.step = 31
    assert not m.lagging(4) and m.live([1, 4]) == [1, 4]
    m.step = 50
    m.note_step(4, 31)
    assert m.lagging(4) and m.live([1, 4]) == [1]


def test_a_peer_is_known_by_the_steps_of_its_messages_per_kind_and_by_fresh_news_of_its_step():
    """Rings tell from a predecessor's messages that it gave a call up (sent_step: a message's own
    step, per kind, never an Ack's current step), and judge whether members are coming only from
    news heard since the call began (peer_step's heard_since). A restarted peer starts afresh."""
    m = membership()
    m.step = 10
    m.heard_from(1, 12, pb.MESSAGE_KIND_ALLREDUCE)
    m.heard_from(1, 11, pb.MESSAGE_KIND_ALLREDUCE)  # older news changes nothing
    m.note_step(1, 15)  # an Ack: its current step
    assert m.sent_step(1, pb.MESSAGE_KIND_ALLREDUCE) == 12 and m.sent_step(1, pb.MESSAGE_KIND_STATE) is None
    assert m.peer_step(1) == 15 and m.peer_step(1, heard_since=10) == 15 and m.peer_step(1, heard_since=11) is None
    assert m.sent_step(2, pb.MESSAGE_KIND_ALLREDUCE) is None and m.peer_step(2) is None
    m.hello(1, ready=True, incarnation=7, current_step=0, resume_step=0)
    m.hello(1, ready=True, incarnation=8, current_step=3, resume_step=3)  # a new process
    assert m.sent_step(1, pb.MESSAGE_KIND_ALLREDUCE) is None
    assert m.peer_step(1) == 10  # (a rejoined peer is taken to be at our step: not lagging)


def test_start_up_hellos_wait_longer_after_each_failure_and_never_past_the_deadline():
    """HelloAttempts: 1 s, then twice as long after each failed attempt, up to 16 s, never longer
    than what is left (fixed 1 s attempts all timed out on a crowded machine, and their retries
    kept it crowded). NotReadyBackoff.next_due: when the earliest "not ready" peer is asked again."""
    from p2ptrain.transport.membership.greetings import HelloAttempts, NotReadyBackoff

    attempts = HelloAttempts()
    assert attempts.length(3, remaining=60.0) == 1.0
    lengths = []
    for _ in range(6):
        attempts.failed(3)
        lengths.append(attempts.length(3, remaining=60.0))
    assert lengths == [2.0, 4.0, 8.0, 16.0, 16.0, 16.0]
    assert attempts.length(3, remaining=5.0) == 5.0 and attempts.length(4, remaining=60.0) == 1.0
    backoff = NotReadyBackoff()
    assert backoff.next_due([1, 2]) == 0.0  # never answered "not ready": ask now
    before = time.monotonic()
    backoff.note(1)
    backoff.note(2)
    backoff.note(2)  # (asked again: its pause doubled)
    assert before + 0.05 <= backoff.next_due([1, 2]) <= time.monotonic() + 0.05
    assert backoff.next_due([2]) >= before + 0.05 and backoff.next_due([]) == 0.0
