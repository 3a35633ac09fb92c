"""Topology schedules: the seed's exponential graph and FAIR's k-peer version of it, consistency of
in/out peers, mixing weights."""
from __future__ import annotations

import math

import numpy as np
import pytest

from p2ptrain.settings import ConfigError, NodeConfig
from p2ptrain.topology import (
    Complete,
    ExponentialGraph,
    RandomGraph,
    Ring,
    build_topology,
    exponential_offsets,
    max_peers_per_step,
    member_topology,
)


def test_exponential_offsets_match_seed():
    # i + 2^0, i + 2^1, ..., i + 2^floor(log2(n-1))
    assert exponential_offsets(1) == []
    assert exponential_offsets(2) == [1]
    assert exponential_offsets(5) == [1, 2, 4]
    assert exponential_offsets(8) == [1, 2, 4]
    assert exponential_offsets(9) == [1, 2, 4, 8]


def test_one_peer_exponential_cycles_through_offsets():
    g = ExponentialGraph(8)
    assert [g.out_peers(0, k) for k in range(4)] == [[1], [2], [4], [1]]
    assert [g.out_peers(6, k) for k in range(3)] == [[7], [0], [2]]
    assert g.in_peers(0, 0) == [7] and g.in_peers(0, 1) == [6] and g.in_peers(0, 2) == [4]


def test_k_peers_per_step():
    g = ExponentialGraph(8, peers_per_step=2)  # book j 3^i: 1, 2, 3, 6
    assert exponential_offsets(8, 2) == [1, 2, 3, 6]
    assert [g.out_peers(0, t) for t in range(3)] == [[1, 2], [3, 6], [1, 2]]
    assert [g.in_peers(0, t) for t in range(2)] == [[6, 7], [2, 5]] and g.period() == 2
    g = ExponentialGraph(6, peers_per_step=2)  # book 1, 2, 3, 0: the last slot is the node's own
    assert exponential_offsets(6, 2) == [1, 2, 3, 0]
    assert [g.out_peers(4, t) for t in range(3)] == [[0, 5], [1], [0, 5]]
    assert g.mixing_weight(4, 1) == 0.5  # the share of the own slot stays: p = 1/(1 + 1)


def test_peers_per_step_up_to_every_other_node():
    assert [max_peers_per_step(n) for n in (1, 2, 3, 8)] == [1, 1, 2, 7]
    g = ExponentialGraph(8, peers_per_step=7)  # k = n - 1: the complete graph at every step
    assert all(g.out_peers(r, t) == [j for j in range(8) if j != r] for r in range(8) for t in range(3))
    assert g.period() == 1
    with pytest.raises(ValueError, match=r"^peers_per_step=8 exceeds the 7 other nodes of a 8-node exponential graph$"):
        ExponentialGraph(8, peers_per_step=8)
    with pytest.raises(ValueError, match=r"^peers_per_step must be >= 1, got 0$"):
        ExponentialGraph(8, peers_per_step=0)
    assert ExponentialGraph(1, peers_per_step=3).out_peers(0, 5) == []  # a lone node has nobody to send to


def test_config_refuses_more_peers_per_step_than_other_nodes():
    flags = {"rank": 0, "world_size": 4, "peers": ["a:1", "a:2", "a:3", "a:4"], "algorithm": "sgp"}
    assert NodeConfig.from_sources(env={}, flags={**flags, "peers_per_step": 3}).algorithm_options.peers_per_step == 3
    with pytest.raises(ConfigError, match=r"^--peers-per-step 4 exceeds the 3 other nodes of a 4-node exponential"):
        NodeConfig.from_sources(env={}, flags={**flags, "peers_per_step": 4})
    NodeConfig.from_sources(env={}, flags={**flags, "peers_per_step": 4, "topology": "random"})  # max out-degree


def test_fewer_members_clamp_peers_per_step():
    graph = member_topology("exponential", 8, lambda step: (0, 2, 5) if step else tuple(range(8)), peers_per_step=5)
    assert len(graph.out_peers(0, 0)) == 5
    assert [graph.out_peers(r, 1) for r in (0, 2, 5)] == [[2, 5], [0, 5], [0, 2]]  # 3 members: 2 others each


def fair_schedule(n: int, k: int, steps: int):
    """FAIR's NPeerDynamicDirectedExponentialGraph (facebookresearch/stochastic_gradient_push,
    gossip/graph_manager.py) restated in its own form: a phone book per rank, filled for i in
    range(int(log(n - 1, k + 1)) + 1) (floating point, as FAIR has it) and j in 1..k with
    (rank + j (k+1)^i) % n unless already in it; k group indices starting at 0..k-1, each moved on
    by k modulo the book's length after every gossip step. Out-peers are the book's entries at the
    group indices (the rank itself where the book holds it); in-peers of a rank are the other ranks
    whose book holds it at one of the group indices. Yields (out, in) per step, per rank."""
    book = [[] for _ in range(n)]
    for rank in range(n):
        for i in range(int(math.log(n - 1, k + 1)) + 1):
            for j in range(1, k + 1):
                peer = (rank + j * (k + 1) ** i) % n
                if peer not in book[rank]:
                    book[rank].append(peer)
    group = list(range(k))
    for _ in range(steps):
        out = [[book[rank][g] for g in group] for rank in range(n)]
        into = [[] for _ in range(n)]
        for g in group:
            for rank in range(n):
                if book[rank][g] != rank:
                    into[book[rank][g]].append(rank)
        yield out, into
        group = [(g + k) % len(book[0]) for g in group]


@pytest.mark.parametrize("n", range(3, 41))
def test_exponential_graph_is_fairs_n_peer_schedule(n):
    """Every k FAIR's graph takes (its book must hold k entries, and no rank twice: k <= n - 1), for
    at least two periods: the same edges at every step (FAIR's own slot sends nothing here), the
    same in-peers, and period() is the first step at which the schedule starts over."""
    for k in range(1, n):
        g = ExponentialGraph(n, k)
        period = g.period()
        steps = 2 * period + 1
        outs = []
        for step, (fair_out, fair_in) in enumerate(fair_schedule(n, k, steps)):
            outs.append([tuple(g.out_peers(rank, step)) for rank in range(n)])
            for rank in range(n):
                assert len(set(fair_out[rank])) == k
                assert list(outs[step][rank]) == sorted(set(fair_out[rank]) - {rank}), (n, k, step, rank)
                assert g.in_peers(rank, step) == sorted(fair_in[rank]), (n, k, step, rank)
        first_repeat = next(p for p in range(1, steps) if all(outs[t] == outs[t + p] for t in range(steps - p)))
        assert period == first_repeat, (n, k)
        if k == 1:  # the seed's graph, as this code had it before: offset 2^(t mod L) at step t
            hops = [2 ** i for i in range(n.bit_length()) if 2 ** i <= n - 1]
            assert outs == [[((r + hops[t % len(hops)]) % n,) for r in range(n)] for t in range(steps)]


def test_exact_levels_where_fairs_floating_point_log_falls_one_short():
    """FAIR's int(log(n - 1, k + 1)) is 4 for n = 244, k = 2 (log_3 243 = 4.999...), so its book
    never reaches 3^5 = 243; here the levels are counted in integers."""
    assert int(math.log(243, 3)) == 4
    assert exponential_offsets(244, 2)[-2:] == [243, 2 * 243 % 244]
    for n in range(3, 244):  # ... and agree below
        for k in range(1, n):
            levels, hop = 0, k + 1
            while hop <= n - 1:
                levels, hop = levels + 1, hop * (k + 1)
            assert int(math.log(n - 1, k + 1)) == levels, (n, k)


ALL = [lambda n: ExponentialGraph(n), lambda n: ExponentialGraph(n, min(2, max_peers_per_step(n))),
       lambda n: ExponentialGraph(n, min(3, max_peers_per_step(n))),
       Ring, Complete, lambda n: RandomGraph(n, max_out_degree=3, seed=5)]


@pytest.mark.parametrize("make", ALL)
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13])
def test_in_peers_are_the_inverse_of_out_peers(make, n):
    g = make(n)
    for step in range(12):
        edges_out = {(i, j) for i in range(n) for j in g.out_peers(i, step)}
        edges_in = {(i, j) for j in range(n) for i in g.in_peers(j, step)}
        assert edges_out == edges_in
        for i in range(n):
            out = g.out_peers(i, step)
            assert i not in out and len(set(out)) == len(out) and all(0 <= j < n for j in out)
        # column stochastic mixing with uniform weights 1/(out-degree+1)
        P = g.mixing_matrix(step)
        for i in range(n):
            column = [P[j][i] for j in range(n)]
            assert sum(column) == pytest.approx(1.0)
            assert P[i][i] == pytest.approx(1 / (len(g.out_peers(i, step)) + 1))


def test_random_graph_is_irregular_seeded_and_deterministic():
    a, b, c = RandomGraph(8, 3, seed=1), RandomGraph(8, 3, seed=1), RandomGraph(8, 3, seed=2)
    schedule = lambda g: [[g.out_peers(i, k) for i in range(8)] for k in range(20)]  # noqa: E731
    assert schedule(a) == schedule(b) and schedule(a) != schedule(c)
    out_degrees = {len(a.out_peers(i, k)) for i in range(8) for k in range(20)}
    in_degrees = {len(a.in_peers(i, k)) for i in range(8) for k in range(20)}
    assert len(out_degrees) > 1 and len(in_degrees) > 2  # nodes choose their own out-degree


def test_ring_and_complete():
    assert Ring(4).out_peers(3, 7) == [0] and Ring(4).in_peers(0, 7) == [3]
    assert Complete(4).out_peers(2, 0) == [0, 1, 3]


def test_build_topology_validates():
    assert isinstance(build_topology("exponential", 4), ExponentialGraph)
    with pytest.raises(ValueError, match="unknown topology"):
        build_topology("torus", 4)
    with pytest.raises(ValueError, match="rank"):
        Ring(3).out_peers(3, 0)
    with pytest.raises(ValueError):
        ExponentialGraph(0)


@pytest.mark.parametrize("name", ["exponential", "ring", "complete", "random"])
def test_arc_arrays_are_the_arcs_on_fixed_and_member_graphs(name):
    """What push-sum's fault-free weights read every step (arc_arrays) is arcs(), as arrays that
    nobody can write: on the run's graph and on graphs over changing members (a leave at step 5,
    a join at step 9), one cycle after another."""
    fixed = build_topology(name, 9, peers_per_step=2, seed=3)
    views = {0: tuple(range(9)), 5: (0, 1, 2, 4, 5, 6, 7, 8), 9: (0, 1, 2, 4, 5, 6, 7, 8, 11)}
    members = member_topology(name, 12, lambda step: views[max(k for k in views if k <= step)],
                              peers_per_step=2, seed=3)
    for graph in (fixed, members):
        for step in range(16):
            senders, receivers = graph.arc_arrays(step)
            assert list(zip(senders.tolist(), receivers.tolist())) == list(graph.arcs(step))
            assert senders.dtype == receivers.dtype == np.int64
            with pytest.raises(ValueError):
                senders[:1] = 0  # (a cached array: read-only)
