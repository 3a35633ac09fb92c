"""Placement (issue 25): rings and graphs lay private peers behind different NATs apart, so their
hops need no relay. The order is a pure function of what the proposer saw and travels in the view,
so every node lays the members out the same way; a later view keeps it for the members that stay."""
from __future__ import annotations

import pytest

from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.algorithms.collectives import ring_order
from p2ptrain.topology import ExponentialGraph, member_topology
from p2ptrain.transport.membership.placement import neighbours_apart, place
from p2ptrain.transport.membership.views import View, Views

NAT = {3: "198.51.100.1", 4: "198.51.100.1", 5: "203.0.113.9"}  # 3 and 4 behind one router, 5 behind another


def relayed_arcs(order, graph, steps):
    """Arcs of `graph` over `steps` between private nodes behind different NATs, laid out by `order`."""
    return sum(1 for step in range(steps) for i, j in graph.arcs(step)
               if order[i] in NAT and order[j] in NAT and NAT[order[i]] != NAT[order[j]])


def test_groups_are_laid_out_together_and_kept_apart_by_public_nodes():
    order = place(range(6), NAT)
    assert sorted(order) == list(range(6))
    assert neighbours_apart(order, NAT) == 0 and neighbours_apart(tuple(range(6)), NAT) == 1
    assert abs(order.index(3) - order.index(4)) == 1  # one LAN, side by side
    # SGP's exponential graph (offsets 1, 2, 4) relays fewer arcs over its period too
    graph = ExponentialGraph(6)
    assert relayed_arcs(order, graph, 3) < relayed_arcs(tuple(range(6)), graph, 3)
    # three groups, two public nodes: the public ones split the groups as far as they go
    nat = {1: "a", 2: "b", 3: "c"}
    three = place(range(5), nat)
    assert neighbours_apart(three, nat) == 1 and sorted(three) == list(range(5))


@pytest.mark.parametrize("nat", [{}, {5: "x"}, {4: "x", 5: "x"}])
def test_nothing_to_keep_apart_keeps_rank_order(nat):
    assert place(range(6), nat) == tuple(range(6))


def test_the_order_travels_in_the_view_and_stays_for_the_members_that_stay():
    views = Views(0, tuple(range(6)), 8)
    view = views.propose(range(6), 10, placement=place(range(6), NAT))
    again = View.from_proto(pb.View.FromString(view.to_proto().SerializeToString()), 8)
    assert again == view and again.placed == view.placement != tuple(range(6))
    assert views.placed_at(9) == tuple(range(6)) and views.placed_at(10) == view.placement
    later = views.propose([0, 1, 3, 4, 5, 6], 20)  # node 2 left, node 6 joined: the order stays, 6 after it
    assert later.placed == tuple(m for m in view.placement if m != 2) + (6,)
    assert views.propose(range(6), 30, placement=tuple(range(6))).placement == ()  # rank order: said by none


@pytest.mark.parametrize("placement", [[0, 1, 2], [0, 1, 2, 3, 3], [0, 1, 2, 9], [3, 2, 1, 0, 5]])
def test_a_view_whose_placement_is_not_an_order_of_its_members_is_refused(placement):
    message = pb.View(epoch=1, proposer=0, switch_step=5, members=[0, 1, 2, 3], placement=placement)
    with pytest.raises(ValueError, match="placement"):
        View.from_proto(message, 16)


def test_rings_and_graphs_follow_the_placement():
    placed = (3, 4, 0, 5, 1, 2)
    assert ring_order([0, 1, 2, 3, 4, 5], placed) == placed
    assert ring_order([0, 2, 4, 5, 7], placed) == (4, 0, 5, 2, 7)  # (7: not placed, after them)
    graph = member_topology("exponential", 6, lambda step: placed)
    assert graph.out_peers(3, 0) == [4] and graph.out_peers(2, 0) == [3] and graph.in_peers(0, 0) == [4]
