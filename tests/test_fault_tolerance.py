"""Dropped links, late messages, dead peers and slow nodes (issue 5, parts 1, 2 and 4).

In-process clusters (tests/cluster.py: real gRPC between real Transports) check the exact
bookkeeping; launch tests kill and restart real node processes.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

from p2ptrain.algorithms.allreduce import AllReduceSGD
from p2ptrain.algorithms.base import Kind
from p2ptrain.algorithms.dpsgd import DPSGD
from p2ptrain.algorithms.relaysgd import RelaySGD
from p2ptrain.algorithms.sgp import SGP
from p2ptrain.settings import ConfigError, NodeConfig
from p2ptrain.settings.parsers import Slowdown
from p2ptrain.topology import build_topology
from p2ptrain.topology.undirected import UndirectedRing
from p2ptrain.transport import TransportOptions
from p2ptrain.transport.faults import LinkTable
from tests.cluster import mass_in_flight_ledgers, run_cluster
from tests.conftest import ROOT, node_env
from tests.test_transport import PLANES

DIM = 16


def initial(rank: int) -> torch.Tensor:
    return torch.arange(DIM, dtype=torch.float64) * (rank + 1) + 10.0 * rank


def lossy(drop: float, deadline: float, *, latency: str = "2ms", jitter: str = "2ms", seed: int = 0):
    def options_for(rank: int) -> TransportOptions:
        links = LinkTable.parse(f"drop={drop},latency={latency},jitter={jitter}", [], seed=seed + rank)
        return TransportOptions(send_timeout=30.0, links=links, link_deadline=deadline, probe_timeout=1.0)
    return options_for


def metric(comm, name: str) -> float:
    registry = comm.transport.metrics.registry
    return sum(s.value for m in registry.collect() for s in m.samples if s.name == name)


# Part 1: push-sum mass ---------------------------------------------------------------------------

@pytest.mark.parametrize("overlap", [0, 1])
def test_sgp_conserves_push_sum_mass_under_20_percent_drops(overlap):
    """6 nodes, 20% of messages lost on every link (re-sent with the same id), a link deadline
    short enough that some shares come late: Σ w (with in-flight shares) is n at every step,
    exactly n on the nodes at the end, and the nodes still agree on the average."""
    n, steps = 6, 40
    topology = build_topology("exponential", n, peers_per_step=1)

    def body(rank, comm):
        sgp = SGP(comm, topology, overlap=overlap)
        sgp.ledger = []
        z = sgp.setup(initial(rank))
        for step in range(steps):
            z = sgp.after_step(step, z)
        z = sgp.finish()
        return sgp.ledger, z, sgp.w, metric(comm, "p2ptrain_dropped_messages_total")

    results = run_cluster(n, body, options_for=lossy(0.2, deadline=0.004), metrics=True)
    ledgers = [r[0] for r in results]
    assert mass_in_flight_ledgers(ledgers, range(steps)) == pytest.approx([float(n)] * steps, abs=1e-9)
    assert sum(r[2] for r in results) == pytest.approx(n, abs=1e-9)
    assert sum(r[3] for r in results) > 0.1 * n * steps * 0.5, "the links dropped (almost) nothing"
    late = [e for ledger in ledgers for e in ledger if e[0] == "mix" and e[1] - e[4] > overlap]
    assert late, "no share came late: the deadline path is untested"
    mean = torch.stack([initial(r) for r in range(n)]).mean(0)
    for _, z, _, _ in results:
        assert float((z - mean).abs().max()) < 0.5  # from a spread of ~75: converging despite drops


@pytest.mark.parametrize("plane", PLANES)
def test_sgp_reabsorbs_shares_for_a_dead_peer_and_trains_on(plane):
    """Node 3 dies after 5 steps: the others detect it (refused connects + probes), stop sending
    to and waiting for it, re-absorb what they could not deliver, and finish without stalling
    (on the TCP lane too: its refused connects count as the peer's process being gone)."""
    n, steps, settle = 4, 40, 10
    topology = build_topology("exponential", n, peers_per_step=1)

    def body(rank, comm):
        sgp = SGP(comm, topology, overlap=1)
        sgp.ledger = []
        z = sgp.setup(initial(rank))
        trace = []
        for step in range(steps):
            if rank == 3 and step == 5:
                comm.transport.stop()  # a crash: no goodbye
                return None
            z = sgp.after_step(step, z)
            trace.append(z.clone())
        final = sgp.finish()
        return sorted(comm.transport.membership.dead()), sgp.w, sgp.refused_shares, trace, final, sgp.ledger

    options = TransportOptions(send_timeout=20.0, link_deadline=1.0, probe_timeout=1.0, data_plane=plane)
    started = time.monotonic()
    results = run_cluster(n, body, options=options, metrics=True)
    assert time.monotonic() - started < 25, "the survivors stalled on the dead peer"
    live = results[:3]
    assert all(dead == [3] for dead, *_ in live)
    assert sum(r[2] for r in live) >= 1  # someone re-absorbed a share meant for node 3
    # Mass from or for node 3 folded in (a share it sent, one re-absorbed) pulls its node off the
    # average; on a busy machine that can come late, when the survivors race through their last
    # steps. They agree once they have mixed `settle` steps past the last such fold.
    folds = [e[1] for r in live for e in r[5] if e[0] in ("mix", "reabsorb") and e[3] == 3]
    checked = max(k for k in range(steps) if all(k - d >= settle or d > k for d in folds))
    assert checked >= 20, f"mass of node 3 kept being folded in, at steps {sorted(folds)}"
    zs = torch.stack([r[3][checked] for r in live])
    assert float((zs - zs.mean(0)).abs().max()) < 1.0, f"no agreement at step {checked} (folds at {sorted(folds)})"
    assert all(torch.isfinite(r[4]).all() for r in live)


@pytest.mark.parametrize("plane", PLANES)
def test_a_peer_that_finished_is_not_waited_for_and_what_it_sent_arrives_first(plane):
    """Node 0 sends its step-0 message and finishes at once (Membership.finish: once that message is
    acknowledged, it tells its peers its run is over). Node 1, already waiting for node 0's step-1
    message with a 30 s link deadline, stops waiting when it hears so, and still gets step 0."""
    options = TransportOptions(send_timeout=30.0, link_deadline=30.0, data_plane=plane)
    kind = Kind.PUSH_SUM

    def body(rank, comm):
        comm.expect(kind, torch.float32, 4)
        comm.ready()
        if rank == 0:
            time.sleep(1.0)  # (node 1 is waiting by then)
            comm.send(1, torch.full((4,), 7.0), kind=kind, step=0, reliable=True)
            comm.membership.finish()
            return None
        began = time.monotonic()
        late = comm.gather(kind, 1, [0])  # never sent
        waited = time.monotonic() - began
        first = comm.gather(kind, 0, [0])
        return waited, late, first, comm.membership.liveness.finished()

    _, (waited, late, first, finished) = run_cluster(2, body, options=options)
    assert finished == {0} and late == {}
    assert waited < 15, f"node 1 waited {waited:.1f}s for a peer whose run was over"
    assert sorted(first) == [0] and torch.equal(first[0].tensor, torch.full((4,), 7.0))


# Part 1: the other algorithms under dropped links --------------------------------------------------

@pytest.mark.parametrize("algorithm", ["dpsgd", "relaysgd", "allreduce"])
def test_gossip_relay_and_allreduce_degrade_but_never_hang_under_drops(algorithm):  # (on the default plane: auto)
    n, steps = 5, 30

    def build(comm):
        if algorithm == "dpsgd":
            return DPSGD(comm, UndirectedRing(n))
        if algorithm == "relaysgd":
            return RelaySGD(comm, "chain")
        return AllReduceSGD(comm, average="models")

    def body(rank, comm):
        algo = build(comm)
        x = algo.setup(initial(rank).float())
        for step in range(steps):
            x = algo.after_step(step, x.clone())
        algo.finish()
        return x, metric(comm, "p2ptrain_link_timeouts_total"), metric(comm, "p2ptrain_dropped_messages_total")

    started = time.monotonic()
    results = run_cluster(n, body, options_for=lossy(0.2, deadline=0.1, seed=3), metrics=True)
    assert time.monotonic() - started < 60
    xs = torch.stack([r[0] for r in results]).double()
    x0 = torch.stack([initial(r) for r in range(n)])
    assert torch.isfinite(xs).all()
    # every node holds a convex combination of the initial models (nothing double counted) ...
    assert (xs >= x0.min(0).values - 1e-4).all() and (xs <= x0.max(0).values + 1e-4).all()
    # ... and they came much closer together
    spread = lambda t: float((t - t.mean(0)).abs().max())  # noqa: E731
    assert spread(xs) < 0.2 * spread(x0)
    assert sum(r[2] for r in results) > 0, "no message was dropped"
    if algorithm != "allreduce":  # all-reduce retransmits; gossip and relay lose the message
        assert sum(r[1] for r in results) > 0, "no link ever timed out"


# Part 4: heterogeneous nodes ---------------------------------------------------------------------

def test_slowdown_flag_parses_per_rank():
    assert Slowdown.parse("0=4,3=2").factors(4) == {0: 4.0, 3: 2.0}
    assert Slowdown.parse("3").factors(2) == {0: 3.0, 1: 3.0}
    config = NodeConfig.from_sources(flags=dict(world_size=2, rank=1, peers=["a:1", "b:2"], slowdown="0=3"))
    assert config.compute_slowdown == 1.0
    for bad in ("0.5", "9=2", "x", "2,3", "0=inf"):
        with pytest.raises(ConfigError, match="slowdown"):
            NodeConfig.from_sources(flags=dict(world_size=2, rank=0, peers=["a:1", "b:2"], slowdown=bad))


def test_fast_nodes_run_ahead_of_a_slow_node_within_the_overlap_bound():
    """Node 0 is 20x slower; with τ = 2 the others do not wait for it every step: they run ahead,
    but never by more than the bounded delay allows, and Σ w stays n."""
    n, steps, tau = 4, 40, 2
    topology = build_topology("exponential", n, peers_per_step=1)

    def body(rank, comm):
        sgp = SGP(comm, topology, overlap=tau)
        z = sgp.setup(initial(rank))
        trace = []
        for step in range(steps):
            time.sleep(0.03 if rank == 0 else 0.0015)  # compute
            z = sgp.after_step(step, z)
            trace.append((time.monotonic(), step))
        sgp.finish()
        return trace, sgp.w

    results = run_cluster(n, body)
    slow = results[0][0]
    leads = []
    for trace, _ in results[1:]:
        for t, step in trace:
            done = [s for ts, s in slow if ts <= t]
            leads.append(step - (done[-1] if done else -1))
    assert max(leads) >= tau, "the fast nodes never ran ahead: overlap is not used"
    assert max(leads) <= tau * (n - 1) + 1, "a fast node ran further ahead than the delay bound allows"
    assert sum(w for _, w in results) == pytest.approx(n, abs=1e-9)


# Part 2: crash and rejoin, real processes ---------------------------------------------------------

@pytest.mark.slow  # 47 s; a SIGKILLed, restarted real node stays in the default suite in the SGP chaos run
def test_killed_node_rejoins_from_a_live_peer_and_ends_in_consensus(tmp_path):
    """`launch --kill 2@STEPS/3 --restart 2@2STEPS/3`: the others train on while node 2 is down;
    the restarted node gets a new unit of mass at a live peer's z and resumes at its step; the run
    completes and node 2 ends as close to the others as they are to each other."""
    steps = 600  # the last third (~15 s) leaves the restarted process time to start on a busy machine
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "p2ptrain", "launch", "--nodes", "4", "--algorithm", "sgp", "--overlap", "1",
            "--steps", str(steps), "--model", "mlp", "--hidden", "512", "--batch-size", "128", "--slowdown", "6",
            "--out", str(out), "--kill", f"2@{steps // 3}", "--restart", f"2@{2 * steps // 3}",
            "--link-deadline", "2", "--no-live", "--no-metrics", "--timeout", "240"]
    proc = subprocess.run(argv, env=node_env(), capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "fault: kill node 2" in proc.stderr and "fault: restart node 2" in proc.stderr
    summaries = [json.loads((out / f"node{r}.json").read_text()) for r in range(4)]
    assert summaries[2]["rejoined"] and summaries[2]["start_step"] > steps // 3
    assert all(s["rejoined"] is False for i, s in enumerate(summaries) if i != 2)
    finals = [torch.load(out / f"node{r}.snapshots.pt")["params"][-1].double() for r in range(4)]
    others = torch.stack([finals[r] for r in (0, 1, 3)])
    centre = others.mean(0)
    spread = max(float((o - centre).norm()) for o in others)
    assert float((finals[2] - centre).norm()) <= max(2 * spread, 1e-3)
    assert summaries[2]["test_accuracy"] > 0.8
    # the mass: what node 2 held went down with it (its mass record, read at the kill), and its new
    # process was given a new unit at a donor's z, so Σ w = 4 + 1 - lost (- shares it had in flight)
    assert summaries[2]["ps_minted"] == 1.0 and all(s["ps_minted"] == 0.0 for i, s in enumerate(summaries) if i != 2)
    kill = next(f for f in json.loads((out / "report.json").read_text())["faults"] if f["action"] == "kill")
    total_w = sum(s["ps_weight"] for s in summaries)
    assert 0.0 < kill["mass_lost"] < 4.0 and kill["mass_minted"] == 0.0
    high = 4.0 + 1.0 - kill["mass_lost"]
    assert high - kill["mass_uncertain"] - 1e-6 <= total_w <= high + 1e-6, (total_w, kill)


@pytest.mark.slow  # 51 s; the exact ledger under 20% drops stays in the default suite (in-process)
def test_sgp_with_20_percent_drops_trains_as_well_as_without(tmp_path):
    """The issue's figure as a test: 6 real node processes, every link drops 20% of messages (re-sent
    with the same id) and jitters: the push-sum weights still sum to n and the accuracy is within
    1 point of the same run without drops. The deadline (0.2 s) is far above the link latency: on a
    loaded 2-core machine a tighter one makes most shares late, and with the seed's unscaled update
    x -= γ∇F(z) a node whose w keeps shrinking steps z by γ/w (late shares themselves are checked
    exactly by the ledger test above)."""
    def run(name: str, link: str) -> list[dict]:
        out = tmp_path / name
        argv = [sys.executable, "-m", "p2ptrain", "launch", "--nodes", "6", "--algorithm", "sgp", "--overlap", "1",
                "--steps", "300", "--out", str(out), "--link", link, "--link-deadline", "0.2", "--no-live",
                "--no-metrics", "--timeout", "200"]
        proc = subprocess.run(argv, env=node_env(), capture_output=True, text=True, timeout=260, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return [json.loads((out / f"node{r}.json").read_text()) for r in range(6)]

    clean = run("clean", "latency=5ms,jitter=5ms")
    lossy_run = run("drop", "drop=0.2,latency=5ms,jitter=5ms")
    assert sum(s["dropped_messages"] for s in lossy_run) > 200
    assert sum(s["dropped_messages"] for s in clean) == 0
    for summaries in (clean, lossy_run):
        assert sum(s["ps_weight"] for s in summaries) == pytest.approx(6.0, abs=1e-6)
    accuracy = lambda summaries: sum(s["test_accuracy"] for s in summaries) / len(summaries)  # noqa: E731
    assert accuracy(clean) > 0.85
    assert abs(accuracy(lossy_run) - accuracy(clean)) <= 0.01
