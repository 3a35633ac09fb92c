"""SGP with a real learning rate equals the seed's exact recursion on every graph it accepts.

Per node i and step k (seed 000 Alg. 1 with overlap τ), in float64:
    x_i ← x_i − γ ∇f_i(z_i)                       (no scaling: nothing is missing)
    keep p_i x_i, p_i w_i; send (p_i x_i, p_i w_i) to each out-neighbour of step k
    add the shares sent at step k − τ;   z_i = x_i / w_i
with non-IID gradients ∇f_i(z) = a_i (z − c_i) and graphs whose in- and out-degrees differ (some
nodes push to nobody at some steps). The fault-free weight recursion ψ (fault_free_weights.py) must
make SGP's step guard exactly 1 here: a guard that is not (a w_steady from a node's own out-degree)
moves Σ x by γ Σ s_i ∇f_i with unequal s_i and SGP then optimizes a weighted objective.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from p2ptrain.algorithms.fault_free_weights import FaultFreeWeights
from p2ptrain.algorithms.registry import get as get_spec
from p2ptrain.algorithms.sgp import SGP
from p2ptrain.topology import Topology, build_topology
from tests.cluster import run_cluster

DIM, STEPS, GAMMA = 8, 30, 0.05


class IrregularGraph(Topology):
    """A seeded time-varying directed graph with out-degrees 0..3 drawn per node and step, so
    in-degrees differ from out-degrees and some nodes push to nobody."""

    name = "irregular"

    def __init__(self, world_size: int, seed: int = 3):
        super().__init__(world_size)
        self.seed = seed

    def out_peers(self, rank: int, step: int) -> list[int]:
        rng = np.random.default_rng([self.seed, step, rank])
        degree = int(rng.integers(0, min(3, self.world_size - 1) + 1))
        others = [j for j in range(self.world_size) if j != rank]
        return sorted(int(j) for j in rng.choice(others, size=degree, replace=False))


def initial(rank: int) -> torch.Tensor:
    return torch.randn(DIM, generator=torch.Generator().manual_seed(100 + rank), dtype=torch.float64)


def gradient(rank: int, z: torch.Tensor) -> torch.Tensor:
    """∇f_i(z) = a_i (z − c_i): every node pulls towards its own c_i, with its own curvature."""
    centre = torch.randn(DIM, generator=torch.Generator().manual_seed(500 + rank), dtype=torch.float64)
    return (0.5 + 0.4 * rank) * (z - centre)


def reference(topology: Topology, n: int, steps: int, tau: int):
    """The exact recursion: per step (w, z) of every node."""
    x = torch.stack([initial(r) for r in range(n)])
    w = torch.ones(n, dtype=torch.float64)
    in_flight, ws, zs = [], [], []
    for k in range(steps):
        z = x / w[:, None]
        x = x - GAMMA * torch.stack([gradient(r, z[r]) for r in range(n)])
        P = torch.tensor(topology.mixing_matrix(k), dtype=torch.float64)
        diag = torch.diag(torch.diag(P))
        in_flight.append((P - diag, x.clone(), w.clone()))
        x, w = diag @ x, diag @ w
        if k >= tau:
            off, x_sent, w_sent = in_flight.pop(0)
            x, w = x + off @ x_sent, w + off @ w_sent
        ws.append(w.clone())
        zs.append(x / w[:, None])
    return torch.stack(ws), torch.stack(zs)


def run_sgp(topology: Topology, n: int, tau: int, steps: int = STEPS):
    """SGP on n nodes over real gRPC; per step (w, z) of every node."""
    def body(rank, comm):
        sgp = SGP(comm, topology, overlap=tau)
        z = sgp.setup(initial(rank))
        ws, zs = [], []
        for step in range(steps):
            z = sgp.after_step(step, z - GAMMA * gradient(rank, z))
            ws.append(sgp.w)
            zs.append(z.clone())
        sgp.finish()
        assert sgp.stats()["voided_shares"] == 0  # (no view comes late without faults: no notice)
        return ws, torch.stack(zs)

    results = run_cluster(n, body)
    return (torch.tensor([r[0] for r in results], dtype=torch.float64).T,  # [steps, n]
            torch.stack([r[1] for r in results], dim=1))                    # [steps, n, dim]


def assert_matches(topology: Topology, n: int, tau: int) -> None:
    ref_w, ref_z = reference(topology, n, STEPS, tau)
    got_w, got_z = run_sgp(topology, n, tau)
    label = f"{topology.name} τ={tau}"
    torch.testing.assert_close(got_w, ref_w, rtol=0, atol=1e-9, msg=f"{label}: ps-weights")
    torch.testing.assert_close(got_z, ref_z, rtol=0, atol=1e-7, msg=f"{label}: de-biased z")


@pytest.mark.parametrize("tau", [0, 1, 2])
def test_sgp_with_a_learning_rate_is_the_exact_recursion_on_an_irregular_time_varying_graph(tau):
    graph = IrregularGraph(6)
    degrees = [[len(graph.out_peers(r, k)) for r in range(6)] for k in range(STEPS)]
    assert min(map(min, degrees)) == 0 and max(map(max, degrees)) == 3  # the graph is what it claims
    assert any(len(graph.in_peers(r, k)) != len(graph.out_peers(r, k)) for r in range(6) for k in range(STEPS))
    assert_matches(graph, 6, tau)


# (exponential 6 with k = 2: FAIR's phone book holds the node itself, so out-degrees alternate 2, 1)
SGP_GRAPHS = [("exponential", 7, 1), ("exponential", 7, 2), ("exponential", 6, 2), ("ring", 5, 1), ("complete", 4, 1),
              ("random", 6, 3), ("chain", 5, 1), ("binary-tree", 6, 1)]


def test_the_sweep_covers_every_topology_sgp_and_gossip_diloco_accept():
    assert {name for name, _, _ in SGP_GRAPHS} == set(get_spec("sgp").topologies)
    assert set(get_spec("gossip-diloco").topologies) <= {name for name, _, _ in SGP_GRAPHS}


@pytest.mark.parametrize("tau", [0, 1])
@pytest.mark.parametrize("name,n,peers_per_step", SGP_GRAPHS)
def test_sgp_with_a_learning_rate_is_the_exact_recursion_on_every_topology(name, n, peers_per_step, tau):
    assert_matches(build_topology(name, n, peers_per_step=peers_per_step, seed=5), n, tau)


@pytest.mark.parametrize("name,n,peers_per_step", [g for g in SGP_GRAPHS if g[0] in ("exponential", "random")]
                         + [("irregular", 6, 0)])
def test_gossip_diloco_is_the_exact_push_sum_recursion_on_every_topology(name, n, peers_per_step):
    """gossip-DiLoCo's outer step is one push-sum round per outer step, with no step guard: only the
    recursion itself is checked (tests/test_diloco.py)."""
    from tests.test_diloco import assert_gossip_diloco_is_the_push_sum_recursion

    graph = IrregularGraph(n) if name == "irregular" else build_topology(name, n, peers_per_step=peers_per_step,
                                                                            seed=5)
    assert_gossip_diloco_is_the_push_sum_recursion(graph, n, 3, 15)


# -- the fault-free weights themselves -------------------------------------------------------------------
@pytest.mark.parametrize("tau", [0, 1, 2, 3])
@pytest.mark.parametrize("name", ["irregular", "random", "chain", "binary-tree", "exponential"])
def test_fault_free_weights_are_the_push_sum_recursion_of_the_weights(name, tau):
    n = 7
    graph = IrregularGraph(n) if name == "irregular" else build_topology(name, n, peers_per_step=2, seed=1)
    ref_w, _ = reference(graph, n, 40, tau)
    psi = FaultFreeWeights(graph, tau)
    for k in range(1, 40):  # ψ at the update of step k is w after step k - 1
        assert [psi.at_update(r, k) for r in range(n)] == pytest.approx(ref_w[k - 1].tolist(), abs=1e-12)
    assert float(psi.psi.sum()) + sum(float(s.sum()) for _, _, s in psi.in_flight) == pytest.approx(n, abs=1e-12)


def test_the_guard_scales_by_the_mass_missing_and_is_exactly_one_without():
    """With τ = 1 and one out-peer, a node's w at update time tends to 2/3 (a third of its mass is the
    share in flight) from 1/2, 3/4, 5/8, ... (a constant 2/3 scaled the first steps down too): no
    scaling there; half of it (a frozen peer holds the rest) halves the update."""
    psi = FaultFreeWeights(build_topology("ring", 4), 1)
    assert [psi.at_update(0, k) for k in range(5)] == [1.0, 0.5, 0.75, 0.625, 0.6875]
    steady = psi.at_update(0, 60)
    assert steady == pytest.approx(2 / 3, abs=1e-12)
    assert psi.scale(steady, 0, 60) == 1.0
    assert psi.scale(steady * (1 - 1e-12), 0, 60) == 1.0  # float rounding is not missing mass
    assert psi.scale(steady / 2, 0, 60) == pytest.approx(0.5)
    assert psi.scale(5.0, 0, 60) == 1.0                   # never scaled up


def test_a_flush_and_a_resume_deliver_everything_in_flight_like_the_node_does():
    """SGP flushes at a checkpoint (every share of the last τ steps folded in) and resumes with
    nothing in flight: ψ does the same, and the next τ steps mix nothing."""
    graph = IrregularGraph(5)
    psi = FaultFreeWeights(graph, 2)
    psi.flush(9)
    assert not psi.in_flight and float(psi.psi.sum()) == pytest.approx(5.0, abs=1e-12)
    resumed = FaultFreeWeights(graph, 2)
    resumed.resume(10)
    assert resumed.psi.tolist() == pytest.approx(psi.psi.tolist(), abs=1e-15)
    before = resumed.at_update(0, 11)  # step 10 pushed, nothing mixed (its shares arrive at step 12)
    assert before == pytest.approx(psi.psi[0] / (len(graph.out_peers(0, 10)) + 1), abs=1e-15)


def test_at_a_view_switch_a_joiner_starts_with_one_unit_and_the_members_sum_to_their_count():
    from p2ptrain.topology import member_topology

    def members_at(step):
        return (0, 1, 2, 3) if step < 10 else (0, 1, 2, 3, 4) if step < 20 else (0, 2, 3, 4)

    graph = member_topology("exponential", 5, members_at)
    psi = FaultFreeWeights(graph, 1)
    assert psi.at_update(4, 9) == 0.0            # not a member yet
    # training outside the schedule (its view came late): its own unit is the reference, so a
    # drained w scales the update down instead of multiplying the learning rate by 1 / w
    assert psi.scale(1 / 96, 4, 9) == pytest.approx(1 / 96) and psi.scale(1.0, 4, 9) == 1.0
    assert psi.at_update(4, 11) == pytest.approx(0.5)  # its unit, half of it pushed at step 10
    for step in (15, 25, 40):
        psi.advance(step)
        members = members_at(step - 1)
        total = float(psi.psi.sum()) + sum(float(s.sum()) for _, _, s in psi.in_flight)
        assert total == pytest.approx(len(members), abs=1e-12)
        assert psi.psi[1] == (0.0 if step > 20 else psi.psi[1])
    # on a regular graph every member tends to the steady 2/3 again (a transient after each switch)
    assert [psi.at_update(r, 100) for r in (0, 2, 3, 4)] == pytest.approx([2 / 3] * 4, abs=1e-9)
