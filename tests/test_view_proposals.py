"""How a membership change is proposed (issue 28): where its switch lies, what it is made on, and
who takes a leaver's mass at the end of a run. At 64 simulated nodes with churn, views came after
their switch (the proposer's steps of the others were stale, a joiner's above all), a retry dropped
a joiner admitted meanwhile, and a member that had just finished acknowledged a leaver's mass it
never absorbed (Σ w one short). Real Transports on loopback, as tests/test_membership_attacks.py.
"""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from launcher.ports import free_ports
from p2ptrain.algorithms.sgp import SGP
from p2ptrain.metrics import NodeMetrics
from p2ptrain.topology import member_topology
from p2ptrain.transport import Transport, TransportOptions
from p2ptrain.transport.membership.views import DEFAULT_VIEW_MARGIN
from tests.cluster import run_cluster
from tests.test_transport import wait_until

WORLD = 4


@pytest.fixture
def cluster():
    """Nodes 0-2 are the initial members of a world of 4; rank 3 can join."""
    peers = [f"127.0.0.1:{p}" for p in free_ports(WORLD)]
    options = TransportOptions(probe_timeout=2.0, initial_members=3, send_timeout=5.0)
    transports = []

    def start(rank: int) -> Transport:
        transports.append(Transport(rank, WORLD, peers, listen=peers[rank], metrics=NodeMetrics(rank),
                                    options=options).start())
        return transports[-1]

    for rank in range(3):
        start(rank)
    yield transports, start
    for transport in transports:
        transport.stop()


def test_a_proposal_asks_the_members_their_steps_so_its_switch_lies_past_one_it_had_not_heard_of(cluster):
    """Node 1 is at step 40, which node 2 never heard of (no message between them): node 2's leave
    used to switch a margin past the steps it knew (8), 32 steps behind node 1, which then trained
    on past the switch with the old members (and only its reply to the view said so: the first
    view stayed, and a second went further). Now it asks first: its one view switches past 40."""
    transports, _ = cluster
    transports[1].membership.set_step(40)
    assert transports[2].membership.liveness.peer_step(1) in (None, 0)
    transports[2].membership.leave()
    wait_until(lambda: all(t.membership.latest.members == (0, 1) for t in transports), 30, "node 2's leave")
    latest = transports[0].membership.latest
    assert latest.epoch == 1 and latest.switch_step >= 40 + DEFAULT_VIEW_MARGIN


def test_a_change_made_already_is_not_proposed_again_and_a_change_keeps_what_came_meanwhile(cluster):
    """A change applies to the latest view when it is proposed: one that a view made already is no
    new view, and it keeps a member admitted meanwhile (a retry used to propose its first list
    again, and dropped the joiner: every node refused it as an eviction)."""
    transports, _ = cluster
    transports[2].membership.leave()
    wait_until(lambda: all(t.membership.latest.members == (0, 1) for t in transports), 30, "node 2's leave")
    held = transports[0].membership.latest
    transports[0].membership.propose(out={2})  # (node 2 is out already)
    assert transports[0].membership.latest == held
    transports[1].membership.propose(into={2}, out={0})
    wait_until(lambda: transports[0].membership.latest.members == (1, 2), 30, "node 1's change")
    assert transports[1].membership.latest.members == (1, 2)  # made on (0, 1): 2 in, 0 out


def test_a_joiner_proposes_on_the_views_its_survey_brought_once_they_are_vetted(cluster):
    """Node 2 left (view 1: members 0, 1) and is gone. Node 3 starts later holding the initial
    view; the replies to its survey carry view 1, passed on by nodes 0 and 1, which it vets (is it
    really node 2's?) before adopting it, with answers that come late here. It used to propose on
    the initial view meanwhile: (0, 1, 2, 3) at epoch 1, a lineage the members do not hold, and it
    was never admitted. Now it waits for the vetting and admits itself on view 1: (0, 1, 3) at
    epoch 2."""
    transports, start = cluster
    transports[2].membership.leave()
    wait_until(lambda: all(t.membership.latest.members == (0, 1) for t in transports), 30, "node 2's leave")
    transports[2].stop()  # (gone: the view reaches node 3 only passed on by nodes 0 and 1, so it is vetted)
    joiner = start(3)
    greetings = joiner.membership.greetings
    greet = greetings.greet

    async def slowly(peer, request, timeout, wait_for_ready=True):  # (every answer takes a second to come, so
        await asyncio.sleep(1.0)                                   # the vetting's outlasts the survey's)
        return await greet(peer, request, timeout, wait_for_ready)

    greetings.greet = slowly
    joiner.membership.propose(into={3})
    wait_until(lambda: all(t.membership.latest.members == (0, 1, 3) for t in transports[:2] + [joiner]), 30,
               "node 3's admission")
    assert joiner.membership.latest.epoch == 2 and joiner.membership.latest.proposer == 3


def test_a_proposal_on_a_pending_view_never_switches_before_it_and_keeps_its_newcomers_entering(cluster):
    """Node 0 admits node 3 from step S (a view not in force yet). Node 2 then proposes its own
    leave with a shorter lead, which would switch before S: node 3 would be a member at steps it
    never trained as one (a 64-node run waited a link deadline for such a joiner's share). It
    switches at S instead, replacing the pending view there, and node 3 still enters there."""
    transports, start = cluster
    start(3)
    transports[0].membership.propose(into={3})
    wait_until(lambda: all(t.membership.latest.members == (0, 1, 2, 3) for t in transports), 30, "node 3's admission")
    admitted = transports[1].membership.latest
    assert admitted.switch_step >= DEFAULT_VIEW_MARGIN and admitted.entering == (3,)
    transports[2].membership.greetings.propose_view(2, out={2})
    wait_until(lambda: all(t.membership.latest.members == (0, 1, 3) for t in transports), 30, "node 2's leave")
    left = transports[2].membership.latest
    assert left.switch_step == admitted.switch_step and left.entering == (3,) and left.dropping == (2,)
    assert transports[0].membership.members(admitted.switch_step - 1) == (0, 1, 2)


def test_a_member_that_finished_refuses_a_leavers_mass_so_a_member_still_training_takes_it():
    """Node 0 finishes its run; node 2 then leaves and tries node 0 first. Node 0 used to accept the
    LEAVE and never absorb it (Σ w one unit short of the member count); now it refuses, node 1
    takes the mass over and retires one unit: w0 + w1 is 2, exactly."""
    finished, handed = threading.Event(), threading.Event()

    def body(rank, comm):
        sgp = SGP(comm, member_topology("exponential", comm.world_size, comm.membership.members), overlap=0)
        z = sgp.setup(torch.full((4,), float(rank), dtype=torch.float64))
        for step in range(4):
            z = sgp.after_step(step, z)
        if rank == 0:
            sgp.finish()
            finished.set()
            handed.wait(60)
            return sgp.w, sgp.mass.retired_w, None
        if rank == 2:
            finished.wait(60)
            comm.membership.leave()
            took = sgp.mass.hand_over([0, 1], 4)
            handed.set()
            return 0.0, 0.0, took
        handed.wait(60)
        sgp.mass.take_over(4)
        sgp.finish()
        return sgp.w, sgp.mass.retired_w, None

    results = run_cluster(3, body, options=TransportOptions(send_timeout=30.0, initial_members=3), timeout=60)
    assert results[2][2] is True
    assert results[0][1] == 0.0 and results[1][1] == 1.0
    assert results[0][0] + results[1][0] == pytest.approx(2.0, abs=1e-12)


def test_the_member_a_late_leaver_tries_first_waits_for_its_mass_at_the_end():
    """Node 2's leave switches at the last step: nodes 0 and 1 train up to it and finish while node 2
    is still handing over (a second late here). Every member refused its LEAVE once it had finished,
    so the leaver left with its unit. Node 0, the member its hand-over tries first, now waits for
    that mass at its finish (until it has it, or hears the leaver finished): it takes it, and node
    1, which is not tried first, does not wait."""
    proposed = threading.Event()

    def body(rank, comm):
        sgp = SGP(comm, member_topology("exponential", comm.world_size, comm.membership.members), overlap=0)
        z = sgp.setup(torch.full((4,), float(rank), dtype=torch.float64))
        if rank == 2:
            comm.membership.leave()
            proposed.set()
        proposed.wait(60)
        switch = comm.membership.latest.switch_step
        for step in range(switch if rank == 2 else switch + 1):
            z = sgp.after_step(step, z)
        if rank == 2:
            sgp.finish()
            time.sleep(1.0)  # (a slow hand-over: the members have finished by now)
            took = sgp.mass.hand_over([0, 1], switch)
            comm.membership.finish()
            return 0.0, 0.0, took
        sgp.finish()
        return sgp.w, sgp.mass.retired_w, None

    results = run_cluster(3, body, options=TransportOptions(send_timeout=30.0, initial_members=3,
                                                            link_deadline=30.0), timeout=90)
    assert results[2][2] is True, "no member took the leaver's mass"
    assert results[0][1] == 1.0 and results[1][1] == 0.0
    assert results[0][0] + results[1][0] == pytest.approx(2.0, abs=1e-12)


@pytest.mark.parametrize("proposer", [7, 3])
def test_a_view_from_its_proposer_is_passed_on_to_one_member_so_a_change_costs_each_node_one_call(proposer):
    """Node 7 of 8 leaves, or node 3 proposes the same members again: the proposer asks the 7
    others their steps and tells them its view (14 calls), and each adopter, having the view from
    its proposer, passes it on to the next member on the ring but the proposer only (1 call each:
    it used to go to the members at offsets 1, 2 and 4, 3 calls each), in case the proposer's
    Hello to that member failed. Node 2 passes node 3's view on to node 4, which thus has two
    sources like every other member."""
    n = 8
    peers = [f"127.0.0.1:{p}" for p in free_ports(n)]
    options = TransportOptions(probe_timeout=2.0, send_timeout=5.0)
    transports = [Transport(rank, n, peers, listen=peers[rank], metrics=NodeMetrics(rank), options=options).start()
                  for rank in range(n)]

    def hellos() -> list[int]:
        return [t.metrics.rpc_totals.get("Hello", [0])[0] for t in transports]

    try:
        before = hellos()
        if proposer == 7:
            transports[7].membership.leave()
        else:
            transports[proposer].membership.propose()
        members = tuple(range(7)) if proposer == 7 else tuple(range(n))
        wait_until(lambda: all(t.membership.latest.members == members and t.membership.latest.epoch == 1
                               for t in transports if t.rank in members), 30, "the view")
        expected = [2 * 7 if rank == proposer else 1 for rank in range(n)]
        wait_until(lambda: [a - b for a, b in zip(hellos(), before)] == expected, 30, "the passing on")
        time.sleep(0.5)  # (and nothing more)
        assert [a - b for a, b in zip(hellos(), before)] == expected
    finally:
        for transport in transports:
            transport.stop()


def test_a_finished_node_tells_the_peers_it_exchanged_tensors_with_not_every_peer_it_met():
    """Node 0 of 4 met everyone; it sent a tensor to node 1 and got one from node 2. At its end it
    tells those two that its run is over, 2 calls: only a peer it exchanged tensors with can wait
    for one of its messages. It used to tell every peer it met (3 here; 90 a node at 256 simulated
    nodes with churn, where every proposer and joiner greets every member)."""
    from p2ptrain._proto import p2ptrain_pb2 as pb

    n, kind = 4, pb.MESSAGE_KIND_BENCH
    peers = [f"127.0.0.1:{p}" for p in free_ports(n)]
    options = TransportOptions(probe_timeout=2.0, send_timeout=5.0)
    transports = [Transport(rank, n, peers, listen=peers[rank], metrics=NodeMetrics(rank), options=options).start()
                  for rank in range(n)]
    try:
        for transport in transports:
            transport.expect(kind, torch.float32, 4, preallocate=0)
            transport.mark_ready()
        for transport in transports:
            transport.membership.wait_for_peers(30, require_ready=True)  # (everyone met everyone)
        for sender, receiver in ((0, 1), (2, 0)):
            ack = transports[sender].sender.send(receiver, torch.ones(4), kind=kind, step=0).result(10)
            assert ack.status == pb.Ack.STATUS_ACCEPTED
            transports[receiver].recv(kind, 0, [sender], timeout=10)[sender].release()
        calls = lambda: transports[0].metrics.rpc_totals.get("Hello", [0])[0]  # noqa: E731
        before = calls()
        transports[0].membership.finish()
        assert calls() == before + 2
        wait_until(lambda: all(0 in transports[r].membership.liveness.finished() for r in (1, 2)), 10,
                   "nodes 1 and 2 hearing that node 0 finished")
        assert 0 not in transports[3].membership.liveness.finished()
    finally:
        for transport in transports:
            transport.stop()
