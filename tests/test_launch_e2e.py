"""End to end: `p2ptrain launch` runs a real 4-process SGP cluster and writes a sound report."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT, node_env


def launch(tmp_path, *args: str, timeout: float = 400) -> dict:
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "p2ptrain", "launch", "--out", str(out), "--no-live", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=node_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"launch failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert (out / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return json.loads((out / "report.json").read_text())


@pytest.mark.timeout(450)
def test_four_node_sgp_overlap_cluster_trains(tmp_path):
    report = launch(tmp_path, "--nodes", "4", "--algorithm", "sgp", "--topology", "exponential",
                    "--peers-per-step", "1", "--overlap", "1", "--steps", "200", "--model", "mlp",
                    "--dataset", "synthetic", "--num-train", "6000", "--log-every", "20")
    cluster = report["cluster"]
    assert report["config"]["overlap"] == 1 and report["config"]["world_size"] == 4
    assert len(report["nodes"]) == 4
    # well above chance (10 classes) on held-out data, on every node
    assert cluster["min_test_accuracy"] > 0.5, cluster
    # the de-biased models agree: small consensus distance relative to the model norm
    assert cluster["relative_consensus_distance"] < 0.1, cluster
    for node in report["nodes"]:
        assert node["bytes_sent"] > 0 and node["bytes_received"] > 0
        assert node["mean_step_seconds"] > 0
        # exponential graph is regular: every ps-weight returns to 1 once all shares are in
        assert node["ps_weight"] == pytest.approx(1.0, abs=1e-9)
    assert sum(n["bytes_sent"] for n in report["nodes"]) == sum(n["bytes_received"] for n in report["nodes"])
    steps = report["history"]["steps"]
    assert steps[0] == 0 and steps[-1] == 200
    # the models start identical and training moves them apart only boundedly
    assert report["history"]["consensus_distance"][0] == 0.0


def test_launch_rejects_bad_config_before_spawning(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "p2ptrain", "launch", "--nodes", "2", "--overlap", "-1",
                           "--out", str(tmp_path / "x")], cwd=ROOT, env=node_env(), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    assert "overlap" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_cnn_on_irregular_random_graph_trains(tmp_path):
    """The GEM paper's CNN on a random directed graph: ps-weights leave 1 during training, the
    de-biased models still agree and learn."""
    report = launch(tmp_path, "--nodes", "4", "--topology", "random", "--peers-per-step", "2",
                    "--overlap", "0", "--steps", "300", "--model", "cnn", "--num-train", "6000",
                    "--log-every", "25", timeout=850)
    cluster = report["cluster"]
    assert cluster["min_test_accuracy"] > 0.6, cluster
    assert cluster["relative_consensus_distance"] < 0.1, cluster
    weights = [line["ps_weight"] for rank in range(4)
               for line in _progress(tmp_path / "run", rank) if "ps_weight" in line]
    assert max(abs(w - 1) for w in weights) > 0.05  # irregular in-degrees move the weights


def _progress(out, rank):
    return [json.loads(line) for line in (out / f"node{rank}.progress.jsonl").read_text().splitlines() if line]


@pytest.mark.timeout(450)
def test_non_iid_dirichlet_shards_through_launch(tmp_path):
    """--dirichlet-alpha reaches every node: small clusters still learn on skewed shards."""
    report = launch(tmp_path, "--nodes", "3", "--overlap", "0", "--steps", "120", "--num-train", "3000",
                    "--dirichlet-alpha", "0.5", "--log-every", "20")
    assert report["config"]["dirichlet_alpha"] == 0.5
    assert report["cluster"]["min_test_accuracy"] > 0.3, report["cluster"]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("algorithm,extra", [
    ("allreduce", []),
    pytest.param("dpsgd", [], marks=pytest.mark.slow),  # (CI time: gossip runs in the SGP cluster test)
    pytest.param("relaysgd", [], marks=pytest.mark.slow),
    ("pipesgd", ["--compression", "int8", "--warmup-steps", "5"]),
])
def test_every_algorithm_trains_the_demo_task(tmp_path, algorithm, extra):
    report = launch(tmp_path, "--nodes", "4", "--algorithm", algorithm, *extra, "--steps", "120",
                    "--num-train", "4000", "--log-every", "20", "--no-metrics")
    cluster = report["cluster"]
    assert report["config"]["algorithm"] == algorithm
    assert cluster["min_test_accuracy"] > 0.5, cluster
    assert sum(n["bytes_sent"] for n in report["nodes"]) == sum(n["bytes_received"] for n in report["nodes"])
    if algorithm in ("allreduce", "pipesgd"):  # exact averaging keeps the models identical
        assert cluster["consensus_distance"] == 0.0, cluster
    else:
        assert 0 < cluster["relative_consensus_distance"] < 0.2, cluster


@pytest.mark.timeout(400)
def test_parameter_server_with_eight_gem_workers_trains(tmp_path):
    report = launch(tmp_path, "--nodes", "8", "--algorithm", "gem", "--ps-policy", "gem", "--steps", "60",
                    "--num-train", "4000", "--batch-size", "64", "--log-every", "10", "--no-metrics")
    ps = report["ps"]
    assert ps["complete"] and ps["workers_done"] == 8
    assert ps["commits"] == 8 * 60  # every worker step committed exactly once
    assert ps["test_accuracy"] > 0.5, ps
    assert report["history"]["staleness"] and report["history"]["pi_median"]
    assert all(n["test_accuracy"] > 0.4 for n in report["nodes"]), report["nodes"]
