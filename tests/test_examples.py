"""The examples as a user runs them: `p2ptrain launch ... -- python examples/X.py` (issue 12), with
SGP and with AllReduce, at small sizes. Real processes on loopback, real data that ships with the
installed packages (scikit-learn's digits, the standard library's sources)."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from tests.conftest import ROOT, node_env

pytest.importorskip("sklearn", reason="the examples extra (pip install p2ptrain[examples]) is not installed")


def launch_script(tmp_path, launch_args: list[str], script: list[str], timeout: float = 300) -> tuple[dict, str]:
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "p2ptrain", "launch", "--out", str(out), "--no-live", "--no-metrics", *launch_args,
           "--", sys.executable, *script]
    proc = subprocess.run(cmd, cwd=ROOT, env=node_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"launch failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert (out / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    logs = "".join((out / "logs" / f"node{rank}.log").read_text() for rank in range(len(list(out.glob("node*.json")))))
    return json.loads((out / "report.json").read_text()), logs


SGP = (["--algorithm", "sgp", "--overlap", "1"], "sgp")
ALLREDUCE = (["--algorithm", "allreduce"], "allreduce")
# The default suite runs each example once (one with each algorithm); `-m slow` runs the other pairing.
DIGITS_RUNS = [pytest.param(*SGP, id="sgp"), pytest.param(*ALLREDUCE, id="allreduce", marks=pytest.mark.slow)]
CHAR_LM_RUNS = [pytest.param(*SGP, id="sgp", marks=pytest.mark.slow), pytest.param(*ALLREDUCE, id="allreduce")]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("algorithm_args,name", DIGITS_RUNS)
def test_digits_cnn_example_learns_real_digits(tmp_path, algorithm_args, name):
    report, logs = launch_script(tmp_path, ["--nodes", "3", "--steps", "60", "--batch-size", "32", *algorithm_args],
                                 ["examples/digits_cnn.py"])
    cluster = report["cluster"]
    assert not cluster["failed"], cluster
    assert report["config"]["algorithm"] == name
    # 60 steps of 3 x 32 scans: far above chance (0.1) on 360 held-out digits, on every node
    assert cluster["min_test_accuracy"] > 0.7, cluster
    accuracies = [n["test_accuracy"] for n in report["nodes"]]
    assert logs.count("test accuracy") == 3 and f"{accuracies[0]:.4f}" in logs
    assert set(report["history"]["reported"]["test_accuracy"]) == {"0", "1", "2"}
    if name == "allreduce":  # weights and BatchNorm statistics identical on every node
        assert cluster["consensus_distance"] == 0.0
        assert len(set(accuracies)) == 1
    else:
        assert cluster["relative_consensus_distance"] < 0.05, cluster
        assert sum(n["ps_weight"] for n in report["nodes"]) == pytest.approx(3.0, abs=1e-9)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("algorithm_args,name", CHAR_LM_RUNS)
def test_char_lm_example_lowers_validation_perplexity(tmp_path, algorithm_args, name):
    report, logs = launch_script(tmp_path, ["--nodes", "2", "--steps", "60", "--batch-size", "16", *algorithm_args],
                                 ["examples/char_lm.py", "--width", "32", "--context", "32", "--val-windows", "64",
                                  "--eval-every", "30"])
    cluster = report["cluster"]
    assert not cluster["failed"], cluster
    for node in report["nodes"]:
        # uniform over 256 bytes is ln 256 = 5.55 nats; 60 small steps already learn byte statistics
        assert node["val_loss"] < 3.6, node
        assert node["perplexity"] == pytest.approx(math.exp(node["val_loss"]), rel=1e-9)
    series = report["history"]["reported"]["perplexity"]["0"]
    assert [step for step, _ in series] == [30, 60] and series[1][1] < series[0][1]
    assert logs.count("perplexity") == 2
    if name == "allreduce":
        assert cluster["consensus_distance"] == 0.0


def test_char_lm_single_process_reference_runs(tmp_path):
    """The comparison run of the closing note: one process, the same total batch."""
    proc = subprocess.run([sys.executable, "examples/char_lm.py", "--single", "--nodes", "2", "--steps", "20",
                           "--batch-size", "8", "--width", "32", "--context", "32", "--val-windows", "32",
                           "--eval-every", "10"], cwd=ROOT, env=node_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "single process, batch 16: validation loss" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_killed_script_node_restarted_by_the_launcher_rejoins_mid_run(tmp_path):
    """`launch --kill 1@50 --restart 1@100 -- python examples/custom_model.py`: the restarted
    script's DecentralizedOptimizer takes a live peer's model and step, and its loop starts at
    opt.local_step, so it finishes with the others, in consensus."""
    report, logs = launch_script(tmp_path, ["--nodes", "3", "--algorithm", "sgp", "--overlap", "1", "--steps", "6000",
                                            "--kill", "1@50", "--restart", "1@100"], ["examples/custom_model.py"])
    assert not report["cluster"]["failed"]
    node = report["nodes"][1]
    assert node["steps"] == 6000 and node.get("outcome") != "not rejoined", node
    assert "--- restarted by the launcher ---" in logs
    assert report["cluster"]["relative_consensus_distance"] < 0.01
