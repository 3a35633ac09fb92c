"""AllReduce-SGD with overlap=1 (one-step-delayed model averaging) over real gRPC on loopback: the
exact recursion x_i^{t+1} = x_i^{t+1/2} + (a^{t-1} - s_i^{t-1}) against a plain-tensor reference,
consensus within one step's local updates (and bit-identical after finish), the options' checks,
and a short training on the synthetic task that learns as well as the synchronous average."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.nn.functional as F

import p2ptrain
from p2ptrain.algorithms import registry
from p2ptrain.algorithms.allreduce import AllReduceSGD
from p2ptrain.cli.flags import add_node_arguments, flags_from_args
from p2ptrain.settings import NodeConfig
from p2ptrain.train.data import make_synthetic, node_shard
from p2ptrain.train.evaluate import evaluate
from p2ptrain.train.models import build_model
from p2ptrain.transport import TransportOptions
from tests.cluster import run_cluster
from tests.conftest import ROOT, node_env
from tests.test_allreduce import local_step, vector

OPTIONS = TransportOptions(send_timeout=30.0, link_deadline=5.0)


def overlapped_run(n: int, numel: int, steps: int):
    """Each node: the local steps of tests/test_allreduce.py, after_step with overlap=1, finish();
    returns per node ([x^{t+1/2}], [x^{t+1}], finish()'s model, stats)."""
    def body(rank, comm):
        algo = AllReduceSGD(comm, average="models", overlap=1)
        x = algo.setup(vector(0, numel, salt=99).clone())  # identical start
        halves, models = [], []
        for step in range(steps):
            x = local_step(rank, step, x)
            halves.append(x.clone())
            x = algo.after_step(step, x)
            models.append(x.clone())
        final = algo.finish()
        return halves, models, final.clone(), algo.stats()

    return run_cluster(n, body, options=OPTIONS)


def reference(n: int, numel: int, steps: int):
    """The same math with plain tensors: [x_i^{t+1}] per step, and the final mean a^{T-1}."""
    xs = [vector(0, numel, salt=99).clone() for _ in range(n)]
    snapshots = None
    history = []
    for step in range(steps):
        xs = [local_step(r, step, xs[r]) for r in range(n)]
        if snapshots is not None:
            mean = sum(snapshots) / n
            xs = [xs[r] + (mean - snapshots[r]) for r in range(n)]
        snapshots = [x.clone() for x in xs]
        history.append([x.clone() for x in xs])
    return history, sum(snapshots) / n


@pytest.mark.parametrize("n", [3, 4])
def test_overlap_follows_the_one_step_delayed_recursion(n):
    numel, steps = 33, 6
    results = overlapped_run(n, numel, steps)
    history, final = reference(n, numel, steps)
    for rank, (_, models, got_final, stats) in enumerate(results):
        for step in range(steps):
            torch.testing.assert_close(models[step], history[step][rank], atol=1e-6, rtol=0,
                                       msg=f"node {rank}, step {step}")
        torch.testing.assert_close(got_final, final, atol=1e-6, rtol=0)
        # steps - 1 means folded in by after_step, the last one by finish()
        assert stats["overlapped_averages"] == steps and stats["ring_resyncs"] == 0
    # it is not the synchronous average: step 0 keeps every node's own local update
    assert not torch.allclose(results[0][1][0], results[1][1][0], atol=1e-3)


def test_members_differ_by_one_steps_local_update_and_end_bit_identical():
    n, numel, steps = 4, 40, 8
    results = overlapped_run(n, numel, steps)
    for step in range(1, steps):
        models = [r[1][step] for r in results]
        updates = [r[0][step] - r[1][step - 1] for r in results]  # Δ_i = x_i^{t+1/2} - x_i^t
        # x_i^{t+1} = a^{t-1} + Δ_i: the same base on every node ...
        bases = [m - u for m, u in zip(models, updates)]
        for base in bases[1:]:
            torch.testing.assert_close(base, bases[0], atol=1e-6, rtol=0)
        # ... so the models are apart by the spread of one step's local updates, no more
        spread = max(float((a - b).abs().max()) for a in models for b in models)
        update_spread = max(float((a - b).abs().max()) for a in updates for b in updates)
        assert 0 < spread <= update_spread + 1e-6
    finals = [r[2] for r in results]
    assert all(torch.equal(f, finals[0]) for f in finals)  # a^{T-1}: the all-gather's identical bytes
    last = torch.stack([r[1][-1] for r in results]).mean(0)
    torch.testing.assert_close(finals[0], last, atol=1e-6, rtol=0)  # the mean of the last models


def test_a_node_alone_keeps_its_local_model():
    """No ring to run (one member): every correction is zero, finish() returns the local model."""
    numel, steps = 10, 4

    def body(rank, comm):
        algo = AllReduceSGD(comm, average="models", overlap=1)
        x = algo.setup(vector(0, numel).clone())
        for step in range(steps):
            x = algo.after_step(step, local_step(rank, step, x))
        return x.clone(), algo.finish()

    (x, final), = run_cluster(1, body, options=OPTIONS)
    expected = vector(0, numel).clone()
    for step in range(steps):
        expected = local_step(0, step, expected)
    torch.testing.assert_close(x, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(final, expected, atol=1e-6, rtol=0)


def test_a_node_stopping_with_a_mean_in_flight_does_not_wait_forever():
    """A node fails mid-run (the engine stops its transport without finish()) while its ring waits
    for a peer's segment: the wait ends with an error instead of outliving the process (the comm
    thread is not a daemon: the interpreter joins it at exit)."""
    peer_may_go = threading.Event()

    def body(rank, comm):
        algo = AllReduceSGD(comm, average="models", overlap=1)
        x = algo.setup(torch.zeros(16))
        if rank == 1:  # never takes step 0: node 0's ring waits for it
            peer_may_go.wait(60)
            return None
        algo.after_step(0, x + 1)
        time.sleep(0.2)  # the ring waits in the transport's gather (link deadline 60 s)
        comm.transport.stop()
        began = time.monotonic()
        try:
            with pytest.raises(RuntimeError, match="transport stopped"):
                algo.finish()
        finally:
            peer_may_go.set()
        return time.monotonic() - began

    waited, _ = run_cluster(2, body, options=TransportOptions(send_timeout=30.0, link_deadline=60.0))
    assert waited < 5


# Options ---------------------------------------------------------------------------------------------

def test_overlap_options_are_checked_with_clear_errors():
    with pytest.raises(ValueError, match="--average models.*--algorithm pipesgd"):
        AllReduceSGD(None, average="gradients", overlap=1)
    for bad in (2, -1):
        with pytest.raises(ValueError, match=rf"overlap must be 0 \(synchronous\) or 1 .*got {bad}"):
            AllReduceSGD(None, average="models", overlap=bad)
    spec = registry.get("allreduce")
    with pytest.raises(ValueError, match="pipesgd"):
        spec.parse_options({"overlap": 1})
    with pytest.raises(ValueError, match="got 2"):
        spec.parse_options({"overlap": 2, "average": "models"})
    options = spec.parse_options({"overlap": 1, "average": "models"})
    assert options.overlap == 1 and options.bounded_delay() == 1
    assert spec.parse_options({}).overlap == 0  # off by default


def test_overlap_is_a_flag_of_allreduce():
    parser = argparse.ArgumentParser()
    add_node_arguments(parser)
    text = " ".join(parser.format_help().split()).replace("- ", "-")  # (argparse may wrap after a hyphen)
    assert "--overlap" in text
    assert "allreduce: with --average models: 1 = the ring all-reduce of step t's model runs while step t+1" in text
    assert "sgp: bounded delay τ" in text  # SGP's meaning of the shared flag stays
    assert registry.all_options()["overlap"][1] == ("allreduce", "sgp")
    args = parser.parse_args(["--algorithm", "allreduce", "--average", "models", "--overlap", "1"])
    config = NodeConfig.from_sources(flags=flags_from_args(args), env={})
    assert config.algorithm == "allreduce"
    assert (config.algorithm_options.average, config.algorithm_options.overlap) == ("models", 1)


# Training --------------------------------------------------------------------------------------------

_INIT = threading.Lock()


def train_synthetic(overlap: int, *, n: int = 3, steps: int = 120) -> list[float]:
    """n nodes train the MLP on their shards of the synthetic task (SGD, momentum 0.9, batch 32, model
    averaging); returns each node's test accuracy after finish()."""
    data = make_synthetic(num_train=3000, num_test=600, seed=1)

    def body(rank, comm):
        with _INIT:  # the nodes are threads sharing torch's global RNG
            torch.manual_seed(1)
            model = build_model("mlp", data.input_shape, data.num_classes, hidden=64)
            loader = torch.utils.data.DataLoader(node_shard(data.train, rank, n, seed=1), batch_size=32,
                                                 shuffle=True, generator=torch.Generator().manual_seed(rank))
        opt = p2ptrain.DecentralizedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                              model=model, comm=comm,
                                              algorithm=AllReduceSGD(comm, average="models", overlap=overlap))
        step = 0
        while step < steps:
            for inputs, targets in loader:
                model.train()
                F.cross_entropy(model(inputs), targets).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                step += 1
                if step == steps:
                    break
        opt.finish()
        test = torch.utils.data.DataLoader(data.test, batch_size=200)
        return evaluate(model, test, loss_fn=F.cross_entropy)[1]

    return run_cluster(n, body, options=OPTIONS)


@pytest.mark.timeout(120)
def test_overlapped_training_learns_like_the_synchronous_average():
    synchronous, overlapped = train_synthetic(0), train_synthetic(1)
    assert len(set(overlapped)) == 1 and len(set(synchronous)) == 1  # one model on every node
    assert overlapped[0] > 0.6, overlapped
    assert overlapped[0] >= synchronous[0] - 0.03, (synchronous, overlapped)


@pytest.mark.timeout(200)
def test_launch_with_overlap_ends_with_one_model(tmp_path):
    """`p2ptrain launch --algorithm allreduce --average models --overlap 1`: 3 processes, 60 steps; the
    flag reaches every node, which learn, and finish() leaves them with the same bits."""
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "p2ptrain", "launch", "--nodes", "3", "--algorithm", "allreduce", "--average",
            "models", "--overlap", "1", "--steps", "60", "--num-train", "3000", "--num-test", "500", "--out",
            str(out), "--no-live", "--no-metrics", "--timeout", "120"]
    proc = subprocess.run(argv, env=node_env(), capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert (report["config"]["overlap"], report["config"]["average"]) == (1, "models")
    cluster = report["cluster"]
    assert cluster["consensus_distance"] == 0.0, cluster
    assert cluster["min_test_accuracy"] > 0.5, cluster  # 0.68 measured (0.67 with --overlap 0)
