"""Topology schedules: the seed's exponential graph, consistency of in/out peers, mixing weights."""
from __future__ import annotations

import pytest

from p2ptrain.topology import Complete, ExponentialGraph, RandomGraph, Ring, build_topology, exponential_offsets


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
    g = ExponentialGraph(8, peers_per_step=2)
    assert g.out_peers(0, 0) == [1, 2]
    assert g.out_peers(0, 1) == [1, 4]  # offsets 4 and then 1 again (cycle of length 3)
    with pytest.raises(ValueError, match="exceeds"):
        ExponentialGraph(8, peers_per_step=4)


ALL = [lambda n: ExponentialGraph(n), lambda n: ExponentialGraph(n, min(2, len(exponential_offsets(n)) or 1)),
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
