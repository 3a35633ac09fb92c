"""Membership nobody can forge (issue 23): forged views and LEAVE messages sent with the project's
own raw gRPC clients to real Transports on loopback are refused with a reason and counted, change
nothing, and never crash a node; the honest protocol still goes through.

World of 4 with nodes 0-2 as the initial members: rank 3 never joined (a ghost's rank).
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from types import SimpleNamespace

import grpc
import pytest
import torch
from torch import nn

from launcher.ports import free_ports
from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.algorithms.sgp import SGP
from p2ptrain.metrics import NodeMetrics
from p2ptrain.node import Node
from p2ptrain.topology import member_topology
from p2ptrain.train.optimizer import DecentralizedOptimizer
from p2ptrain.transport import Transport, TransportOptions
from p2ptrain.transport.framing import encode_data, encode_header, serialize_identity
from p2ptrain.transport.membership import vetting
from p2ptrain.transport.membership.greetings import ClusterSurvey
from p2ptrain.transport.membership.views import View, Views
from p2ptrain.transport.server import HELLO_METHOD, PROTOCOL_VERSION, PUSH_METHOD
from tests.cluster import run_cluster
from tests.test_transport import wait_until

WORLD = 4
_ids = itertools.count(1 << 40)


@pytest.fixture
def trio():
    peers = [f"127.0.0.1:{p}" for p in free_ports(WORLD)]
    options = TransportOptions(probe_timeout=1.0, initial_members=3, send_timeout=5.0)
    transports = [Transport(r, WORLD, peers, listen=peers[r], metrics=NodeMetrics(r), options=options).start()
                  for r in range(3)]
    channels = [grpc.insecure_channel(p) for p in peers[:3]]
    hellos = [c.unary_unary(HELLO_METHOD, request_serializer=pb.HelloRequest.SerializeToString,
                            response_deserializer=pb.HelloReply.FromString) for c in channels]

    def hello(to: int, as_node: int, view: pb.View) -> pb.HelloReply:
        request = pb.HelloRequest(node_id=as_node, world_size=WORLD, protocol_version=PROTOCOL_VERSION, view=view)
        return hellos[to](request, timeout=10)

    yield transports, hello
    for channel in channels:
        channel.close()
    for transport in transports:
        transport.stop()


def _refused(transport: Transport) -> float:
    return _rejected(transport, "view")


def _rejected(transport: Transport, reason: str) -> float:
    return transport.metrics.registry.get_sample_value(
        "p2ptrain_rejected_messages_total", {"node": str(transport.rank), "reason": reason}) or 0.0


def _expect_refusal(transport: Transport, before: float, timeout: float = 30.0) -> None:
    wait_until(lambda: _refused(transport) > before, timeout, "the view's refusal")
    assert transport.membership.latest == View(0, 0, 0, (0, 1, 2)), transport.membership.latest


def test_a_view_naming_a_ghost_member_is_refused(trio):
    """Before: adopted, and every node spent a probe timeout per ghost. Now: the ghost must answer a
    Hello as itself (it never greeted anyone), so the view is refused."""
    transports, hello = trio
    for address in ("", f"127.0.0.1:{free_ports(1)[0]}"):  # no address, or one where nobody listens
        before = _refused(transports[0])
        view = pb.View(epoch=1, proposer=1, switch_step=20, members=[0, 1, 2, 3],
                       addresses=["", "", "", address] if address else [])
        hello(0, 1, view)
        _expect_refusal(transports[0], before)


def test_a_view_forged_as_another_nodes_is_confirmed_with_it_and_refused(trio):
    """Node "2" passes on a view "of node 0" that drops live node 2 (switch step 1): node 1 asks
    node 0, which never proposed it."""
    transports, hello = trio
    before = _refused(transports[1])
    hello(1, 2, pb.View(epoch=1, proposer=0, switch_step=1, members=[0, 1]))
    _expect_refusal(transports[1], before)


def test_a_view_that_evicts_a_live_member_is_refused(trio):
    """Its claimed proposer sends it itself: node 1 probes node 2, which answers: it did not leave."""
    transports, hello = trio
    before = _refused(transports[1])
    hello(1, 0, pb.View(epoch=1, proposer=0, switch_step=5, members=[0, 1]))
    _expect_refusal(transports[1], before)
    assert transports[1].membership.liveness.alive(2)


def test_a_view_proposed_while_another_is_pending_switches_with_it_so_a_refuser_holds_the_same_members(trio):
    """Node 0 (which lost node 2, say) proposes the members without live node 2: node 1 refuses it,
    node 2 takes it. Node 2, still alive and wanting in, proposes itself back before the switch:
    that view switches at the pending one's step, so all three nodes hold the same members at
    every step. (It used to switch a margin past the furthest step: from the first switch to the
    second, nodes 0 and 2 trained without node 2 and node 1 with it, and a ring of theirs failed
    every step in between.)"""
    transports, _ = trio
    before = _refused(transports[1])
    dropping = transports[0].membership.propose(out={2})
    _expect_refusal(transports[1], before)
    wait_until(lambda: transports[2].membership.latest.epoch == 1, 30, "node 2 taking the view that drops it")
    # node 1 knows that the nodes holding the refused view train without node 2 from its switch on:
    # a ring of it with them fails at once there instead of by deadlines
    refuser = transports[1].membership
    assert refuser.split_members(dropping - 1) is None and refuser.split_members(dropping) == (0, 1)
    assert transports[0].membership.split_members(dropping) is None  # (it holds the view itself)
    for transport in transports:
        transport.membership.set_step(2)  # everyone moved on a little, still short of the switch
    transports[2].membership.reconcile()  # it stands for itself: the members with it again
    wait_until(lambda: all(t.membership.latest.epoch == 2 for t in transports), 30, "the view that re-admits node 2")
    assert transports[2].membership.latest.switch_step == dropping
    assert refuser.split_members(dropping) is None  # the greater view is in force there for everyone
    members = [[t.membership.members(step) for step in range(3 * dropping)] for t in transports]
    assert members[0] == members[1] == members[2]
    assert members[1][dropping - 1] == members[1][dropping] == (0, 1, 2)


@pytest.mark.parametrize("fields", [
    dict(epoch=2 ** 64 - 1, proposer=2 ** 32 - 1, switch_step=2 ** 63),  # the reported one
    dict(epoch=2 ** 60, proposer=0, switch_step=10),   # out of range
    dict(epoch=5000, proposer=0, switch_step=10),      # jumps too far past the latest epoch
    dict(epoch=1, proposer=0, switch_step=2 ** 40),    # switches absurdly far ahead
    dict(epoch=1, proposer=0, switch_step=0),          # only the initial view switches at 0
])
def test_out_of_range_views_are_refused_and_leaving_still_works(trio, fields):
    """Before: the huge view was adopted everywhere (no later proposal could win) and a normal leave
    then crashed the leaver in View.to_proto. Now: refused at once; node 2 leaves normally after."""
    transports, hello = trio
    before = _refused(transports[1])
    hello(1, 0, pb.View(members=[0, 1, 2], **fields))
    _expect_refusal(transports[1], before, timeout=5)
    transports[2].membership.leave()  # proposes (0, 1) and tells the others: to_proto must not fail
    for transport in transports:
        wait_until(lambda t=transport: t.membership.latest.members == (0, 1), 30, "the leave's view")
    assert transports[0].membership.latest.epoch == 1


def test_a_view_that_switches_before_the_pending_view_it_replaces_is_refused(trio):
    """Node 0 proposes the same members from step 40 (adopted: nothing to confirm), then a view on
    top of it that switches at step 10, before it. An honest proposer never does (Views.propose);
    its newcomers would be members at steps before they enter. Refused; the view after it that
    keeps to the rule is adopted."""
    transports, hello = trio
    pending = pb.View(epoch=1, proposer=0, switch_step=40, members=[0, 1, 2])
    hello(1, 0, pending)
    wait_until(lambda: transports[1].membership.latest.order == (1, 0), 10, "the pending view")
    before = _refused(transports[1])
    hello(1, 0, pb.View(epoch=2, proposer=0, switch_step=10, members=[0, 1, 2], base_proposer=0))
    wait_until(lambda: _refused(transports[1]) > before, 10, "the early view's refusal")
    assert transports[1].membership.latest.order == (1, 0)
    hello(1, 0, pb.View(epoch=2, proposer=0, switch_step=40, members=[0, 1, 2], base_proposer=0))
    wait_until(lambda: transports[1].membership.latest.order == (2, 0), 10, "the view that keeps to the rule")
    assert _refused(transports[1]) == before + 1


def test_a_proposal_made_while_a_later_switch_is_pending_switches_with_it():
    """The proposer side of the rule: a switch step read before a view with a later switch came in
    moves to that switch (Views.propose), and receivers judge it by the same rule."""
    views = Views(rank=1, initial=(0, 1, 2), capacity=4)
    assert views.adopt(View(1, 0, 40, (0, 1, 2)))
    proposed = views.propose((0, 1), switch_step=12)
    assert proposed.switch_step == 40 and proposed.dropping == (2,)
    base = View(1, 0, 40, (0, 1, 2))
    assert vetting.refusal(proposed, base, furthest_step=0, base=base) == ""
    early = View(2, 1, 39, (0, 1), base_proposer=0, dropping=(2,))
    assert "before step 40" in vetting.refusal(early, base, furthest_step=0, base=base)
    assert vetting.refusal(early, base, furthest_step=0) == ""  # (no base held: nothing to judge by)


def test_a_huge_view_is_refused_with_a_short_log_line(trio, caplog):
    """Before: a 10^6-member view was refused but logged in full (~7.8 MB per Hello)."""
    transports, hello = trio
    before = _refused(transports[0])
    with caplog.at_level(logging.WARNING):
        hello(0, 1, pb.View(epoch=1, proposer=1, switch_step=10, members=range(10 ** 6)))
        _expect_refusal(transports[0], before, timeout=5)
    lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert lines and max(map(len, lines)) < 500, [len(line) for line in lines]


def test_a_passed_on_view_its_proposer_confirms_is_adopted(trio):
    """The honest path still goes through: node 0 proposes (locally), node "2" passes it on to node
    1, node 1 asks node 0 and adopts it."""
    transports, hello = trio
    view = transports[0].run_on_loop(transports[0].membership.views.propose, (0, 1, 2), 40)
    hello(1, 2, view.to_proto())
    wait_until(lambda: transports[1].membership.latest == view, 30, "the confirmed view")
    assert _refused(transports[1]) == 0


# LEAVE --------------------------------------------------------------------------------------------

def _leave_refusals(transport: Transport) -> float:
    return _rejected(transport, "leave")


def test_leave_is_accepted_once_from_a_member_the_view_drops_and_within_its_mass(trio):
    transports, _ = trio
    membership = transports[0].membership
    assert "member of the latest view" in membership.accept_leave(1, 1.0)   # node 1 is not leaving
    assert "never was a member" in membership.accept_leave(3, 1.0)
    transports[1].membership.leave()
    wait_until(lambda: membership.latest.members == (0, 2), 30, "node 1's leave")
    assert "not in (0, 3]" in membership.accept_leave(1, 3.5)               # more than 3 members hold
    assert "not in (0, 3]" in membership.accept_leave(1, float("nan"))
    assert membership.accept_leave(1, 1.25) == ""
    assert "already handed over" in membership.accept_leave(1, 1.0)         # once per time it was a member
    assert _leave_refusals(transports[0]) == 5


def test_forged_leaves_in_a_static_sgp_run_are_refused_and_mass_is_exact():
    """Before: two LEAVEs (w = 1.5, x = 0) "from member 1", which is not leaving, were both absorbed:
    Σ w went from 2.000 to 2.667 and every model was pulled toward 0. Now both are refused."""
    dim, steps, forged_at = 8, 40, 10

    def body(rank, comm):
        torch.manual_seed(rank)
        model = nn.Linear(dim, 1, bias=False).double()
        with torch.no_grad():
            model.weight.fill_(3.0)
        sgp = SGP(comm, member_topology("exponential", comm.world_size, comm.membership.members), overlap=1)
        opt = DecentralizedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model=model, algorithm=sgp,
                                     comm=comm)
        while opt.local_step < steps:
            if rank == 0 and opt.local_step == forged_at:
                _forge_leaves(comm.transport.grpc.addresses[1], dim, opt.local_step)
            loss = model(torch.ones(4, dim, dtype=torch.float64)).pow(2).mean() * 0  # keeps the model: no drift
            opt.zero_grad()
            loss.backward()
            opt.step()
        opt.finish()
        return sgp.w, model.weight.detach().clone(), _leave_refusals(comm.transport)

    results = run_cluster(2, body, options=TransportOptions(send_timeout=30.0), metrics=True, timeout=120)
    assert sum(w for w, _, _ in results) == pytest.approx(2.0, abs=1e-9)
    for _, weight, _ in results:
        assert torch.allclose(weight, torch.full_like(weight, 3.0)), weight  # nothing pulled toward 0
    assert results[1][2] == 2  # node 1 refused both, and counted them


def _forge_leaves(address: str, dim: int, step: int) -> None:
    with grpc.insecure_channel(address) as channel:
        push = channel.stream_unary(PUSH_METHOD, request_serializer=serialize_identity,
                                    response_deserializer=pb.Ack.FromString)
        for at in (step, step + 1):  # (two of one step: the inbox refuses the second as a duplicate)
            header = pb.TensorHeader(sender=0, receiver=1, step=at, kind=pb.MESSAGE_KIND_LEAVE,
                                     dtype=pb.DTYPE_FLOAT64, numel=dim, payload_bytes=8 * dim, ps_weight=1.5,
                                     message_id=next(_ids))
            push(iter([encode_header(header), encode_data(bytes(8 * dim))]), timeout=10)


def test_a_concurrent_proposal_that_never_heard_of_a_joiner_does_not_drop_it():
    """Nodes 3 and 4 join at once: node 1 holds node 0's view admitting 3 when node 4's own view of
    the same epoch (proposed on top of the initial view, without 3) arrives. It drops nobody: it is
    judged against its base, adopted as the greater view, and node 3's donor proposes 3 again on
    top of it (the loser's change; Membership.reconcile)."""
    views = Views(rank=1, initial=(0, 1, 2), capacity=5)
    assert views.adopt(View(1, 0, 20, (0, 1, 2, 3)))
    concurrent = View(1, 4, 22, (0, 1, 2, 4))
    assert views.base_of(concurrent).members == (0, 1, 2)
    found = vetting.doubts(concurrent, 4, views.base_of(concurrent), rank=1, announced={3, 4}, live=list)
    assert not found, found
    # the same view after this node already held an epoch-1 view with 3 would have read as an eviction
    assert vetting.doubts(concurrent, 4, views.latest, rank=1, announced={3, 4}, live=list).dropped_live == {3}
    # a later epoch that drops 3 on purpose is still a doubt to confirm
    assert vetting.doubts(View(2, 4, 30, (0, 1, 2, 4)), 4, views.latest, rank=1, announced={3, 4},
                          live=list).dropped_live == {3}


def test_a_concurrent_admission_of_another_epoch_is_no_eviction_but_a_named_drop_still_is():
    """Node 1 holds node 3's own admission (epoch 1). Node 4's lineage never heard of node 3: its
    base is node 2's epoch-1 view, and node 4 proposes itself in on top of it (epoch 2). Compared
    with node 1's own epoch-1 view, it drops node 3: a live member, so every node refused it, the
    proposer kept it, and a 64-node churn run crawled a link deadline a step. The view names its
    base and what it drops: node 1 does not hold that base, so only a named drop is an eviction."""
    views = Views(rank=1, initial=(0, 1, 2), capacity=6)
    assert views.adopt(View(1, 3, 20, (0, 1, 2, 3), entering=(3,)))
    other_lineage = Views(rank=4, initial=(0, 1, 2), capacity=6)
    assert other_lineage.adopt(View(1, 2, 18, (0, 1, 2)))
    proposed = other_lineage.propose((0, 1, 2, 4), switch_step=30)
    assert (proposed.epoch, proposed.base_proposer, proposed.dropping, proposed.entering) == (2, 2, (), (4,))
    assert View.from_proto(proposed.to_proto(), 6) == proposed  # (what travels)

    assert views.named_base(proposed) is None  # node 1 holds another epoch-1 view
    found = vetting.doubts(proposed, 4, views.base_of(proposed), rank=1, announced={4}, live=list, exact=False)
    assert not found, found
    assert vetting.doubts(proposed, 4, views.base_of(proposed), rank=1, announced={4},
                          live=list).dropped_live == {3}  # (judged against our own base: the old refusal)
    evicting = View(2, 4, 30, (0, 1, 2, 4), entering=(4,), base_proposer=2, dropping=(3,))
    assert vetting.doubts(evicting, 4, views.base_of(evicting), rank=1, announced={4}, live=list,
                          exact=False).dropped_live == {3}
    # on top of a base node 1 holds, what is missing is judged exactly, named or not
    on_ours = View(2, 4, 30, (0, 1, 2, 4), entering=(4,), base_proposer=3)
    assert views.named_base(on_ours) == views.latest
    assert vetting.doubts(on_ours, 4, views.named_base(on_ours), rank=1, announced={4},
                          live=list).dropped_live == {3}
    # an epoch-1 view's base is the initial view, whatever it names
    assert views.named_base(View(1, 4, 9, (0, 1), base_proposer=5)) == View(0, 0, 0, (0, 1, 2))


@pytest.mark.parametrize("dropping", [[3, 2], [1], [7], list(range(10 ** 6))])
def test_a_view_whose_dropped_members_are_not_sorted_outsiders_is_refused_as_malformed(dropping):
    message = pb.View(epoch=2, proposer=0, switch_step=5, members=[0, 1, 2], dropping=dropping)
    with pytest.raises(ValueError, match="dropping|drops"):
        View.from_proto(message, 6)


def test_a_passed_on_view_of_a_proposer_that_is_gone_needs_another_member_holding_it():
    """Node 0 proposes a view and dies before node 1 heard of it; node 2 passes it on. Node 1 cannot
    ask node 0, so it asks another member: node 3 holds the view, so node 1 adopts it. A view
    "of node 0" that nobody holds is refused."""
    peers = [f"127.0.0.1:{p}" for p in free_ports(4)]
    options = TransportOptions(probe_timeout=1.0, send_timeout=5.0)
    nodes = [Transport(r, 4, peers, listen=peers[r], metrics=NodeMetrics(r), options=options).start()
             for r in range(4)]
    channel = grpc.insecure_channel(peers[1])
    hello = channel.unary_unary(HELLO_METHOD, request_serializer=pb.HelloRequest.SerializeToString,
                                response_deserializer=pb.HelloReply.FromString)
    try:
        view = nodes[0].run_on_loop(nodes[0].membership.views.propose, (0, 1, 2, 3), 40)
        assert nodes[3].run_on_loop(nodes[3].membership.views.adopt, view)
        nodes[0].stop()
        forged = pb.View(epoch=1, proposer=0, switch_step=45, members=[1, 2, 3])
        before = _refused(nodes[1])
        hello(pb.HelloRequest(node_id=2, world_size=4, protocol_version=PROTOCOL_VERSION, view=forged), timeout=10)
        wait_until(lambda: _refused(nodes[1]) > before, 30, "the unheld view's refusal")
        hello(pb.HelloRequest(node_id=2, world_size=4, protocol_version=PROTOCOL_VERSION, view=view.to_proto()),
              timeout=10)
        wait_until(lambda: nodes[1].membership.latest == view, 30, "the view a witness holds")
    finally:
        channel.close()
        for node in nodes[1:]:
            node.stop()


# A restarted process knows the initial view only (chaos diloco-250-8) ------------------------------

def test_a_restarted_node_adopts_a_passed_on_view_its_proposer_and_initial_members_cannot_confirm():
    """chaos diloco-250-8: nodes 0-2 start, 3 and 4 joined; node 0 proposed (1, 3, 4) and left,
    node 2 left too. Node 1 is a restarted process holding the initial view only. Node 3 passes the
    view on: its proposer 0 and the other member of node 1's base (2) are gone, but node 4, a
    member of the view, holds it: node 1 adopts it (it was refused for good when only its base members were asked)."""
    world = 5
    peers = [f"127.0.0.1:{p}" for p in free_ports(world)]
    options = TransportOptions(probe_timeout=1.0, initial_members=3, send_timeout=5.0)
    nodes = {r: Transport(r, world, peers, listen=peers[r], metrics=NodeMetrics(r), options=options).start()
             for r in (1, 3, 4)}
    channel = grpc.insecure_channel(peers[1])
    hello = channel.unary_unary(HELLO_METHOD, request_serializer=pb.HelloRequest.SerializeToString,
                                response_deserializer=pb.HelloReply.FromString)
    try:
        view = View(3, 0, 500, (1, 3, 4))
        for r in (3, 4):
            assert nodes[r].run_on_loop(nodes[r].membership.views.adopt, view)
        before = _refused(nodes[1])
        hello(pb.HelloRequest(node_id=3, world_size=world, protocol_version=PROTOCOL_VERSION, view=view.to_proto()),
              timeout=10)
        wait_until(lambda: nodes[1].membership.latest == view, 30, "the view its member 4 holds")
        assert _refused(nodes[1]) == before
    finally:
        channel.close()
        for node in nodes.values():
            node.stop()


def test_a_restarted_node_whose_initial_members_all_left_finds_the_joiners():
    """chaos diloco-250-8, nodes 3 and 6 (exit 3): the initial members 1, 2 left; joiners 3 and 4
    train on (view (3, 4)). Restarted node 0 surveys its initial view and reaches nobody; as a
    (re)joiner it also greets the ranks of no view it knows, finds the running cluster there, and
    gets a donor."""
    world = 5
    peers = [f"127.0.0.1:{p}" for p in free_ports(world)]
    options = TransportOptions(probe_timeout=1.0, initial_members=3, send_timeout=5.0)
    nodes = {r: Transport(r, world, peers, listen=peers[r], metrics=NodeMetrics(r), options=options).start()
             for r in (0, 3, 4)}
    try:
        view = View(2, 3, 50, (3, 4))
        for r in (3, 4):
            assert nodes[r].run_on_loop(nodes[r].membership.views.adopt, view)
            nodes[r].mark_ready()
            nodes[r].membership.set_step(100)
        membership = nodes[0].membership
        assert membership.survey().reachable == 0           # (all a restarted node 0 asked before)
        found = membership.survey(everyone=True)
        assert found.running and found.furthest == 100
        assert membership.ask_for_state().donor in (3, 4)
    finally:
        for node in nodes.values():
            node.stop()


def test_a_frozen_peer_counts_as_silent_not_gone_so_a_restarted_node_waits_for_it():
    """chaos sgp-1000-9: the only running member was SIGSTOPped (up to 30 s) while three restarted
    nodes surveyed: three empty surveys in a row and each exited 3, "the cluster has finished". A
    peer whose port takes the connection but which does not answer is silent (it may be frozen),
    unlike one whose port is closed (gone): the survey says so and the restart waits on."""
    world = 3
    peers = [f"127.0.0.1:{p}" for p in free_ports(world)]
    options = TransportOptions(probe_timeout=0.5, send_timeout=5.0)
    nodes = {r: Transport(r, world, peers, listen=peers[r], metrics=NodeMetrics(r), options=options).start()
             for r in (0, 1)}
    try:
        nodes[1].mark_ready()
        nodes[1].membership.set_step(100)
        assert nodes[0].membership.survey(timeout=1.0).running
        nodes[1].loop.call_soon(time.sleep, 3.0)  # node 1 freezes (its event loop answers nothing)
        frozen = nodes[0].membership.survey(timeout=1.0, everyone=True)
        assert (frozen.reachable, frozen.silent) == (0, 1)  # node 2 never started: gone, not silent
    finally:
        for node in nodes.values():
            node.stop()


def test_a_joiner_waits_past_the_peer_timeout_while_the_cluster_moves_towards_its_join_step():
    """chaos diloco-250-8, first incarnations of joiners 6, 7, 8 (exit 3 'no live peer to join'):
    started at launch with join_at far ahead, they gave up after peer_timeout although the cluster
    answered and moved on the whole time."""
    steps = iter(range(0, 10_000, 10))

    def survey(timeout=2.0, everyone=False):
        time.sleep(0.05)
        return ClusterSurvey(reachable=1, running=True, furthest=next(steps))

    node = Node.__new__(Node)
    node.config = SimpleNamespace(peer_timeout=0.3, join_at=200, rank=6)
    node.transport = SimpleNamespace(membership=SimpleNamespace(survey=survey))
    node.wait_to_join(running=False)  # (it gave up after 0.3 s, the cluster at step ~60)


def test_a_joiner_waiting_for_its_join_step_asks_only_the_member_furthest_ahead():
    """A joiner started ahead of its join step (launch --join COUNT@STEP) polls the cluster until it
    gets there. It used to ask every peer every time (n Hellos five times a second, for as long as
    the cluster took); now, once the cluster answered, only the member furthest ahead: 3 Hellos for
    the first survey here, then 1 per poll."""
    peers = [f"127.0.0.1:{p}" for p in free_ports(WORLD)]
    options = TransportOptions(probe_timeout=1.0, initial_members=3, send_timeout=5.0)
    transports = [Transport(r, WORLD, peers, listen=peers[r], metrics=NodeMetrics(r), options=options).start()
                  for r in range(WORLD)]
    moving = threading.Event()

    def train() -> None:  # node 0 leads, nodes 1 and 2 a step behind: 20 steps a second
        for step in range(1, 200):
            for transport in transports[:3]:
                transport.membership.set_step(step if transport.rank == 0 else step - 1)
            moving.set()
            time.sleep(0.05)

    for transport in transports[:3]:
        transport.mark_ready()
    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    joiner = Node.__new__(Node)
    joiner.config = SimpleNamespace(peer_timeout=10.0, join_at=40, rank=3)
    joiner.transport = transports[3]
    asked = []
    survey = transports[3].membership.survey
    transports[3].membership.survey = lambda *a, **kw: (asked.append(kw.get("peers")), survey(*a, **kw))[1]
    try:
        moving.wait(10)
        before = transports[3].metrics.rpc_totals.get("Hello", [0])[0]
        joiner.wait_to_join(running=False)
        hellos = transports[3].metrics.rpc_totals.get("Hello", [0])[0] - before
        assert transports[0].membership.step >= 40
        assert len(asked) >= 5 and asked[0] is None and all(p == [0] for p in asked[1:]), asked
        assert hellos == 3 + len(asked) - 1
    finally:
        for transport in transports:
            transport.stop()
