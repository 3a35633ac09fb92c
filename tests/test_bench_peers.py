"""`p2ptrain bench peers`: torch DDP (gloo), p2ptrain's algorithms and hivemind trained as real
clusters on the same model, data and batch, with ratios to DDP from the same run (tiny sizes here;
the real figures come from the full command, see README)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import pytest

from p2ptrain.bench import peers
from p2ptrain.bench.ddp import interface_of
from p2ptrain.bench.hivemind_node import tree_cpu_seconds
from p2ptrain.bench.peers import BASELINE, PeersResult, accuracy_curve, check_targets, summarize, time_to_accuracy
from p2ptrain.train.progress import RunRecorder, StepClock
from tests.conftest import ROOT, node_env


def run(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "p2ptrain", *args], cwd=ROOT, env=node_env(),
                          capture_output=True, text=True, timeout=timeout)


def numeric(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


@pytest.mark.timeout(300)
def test_bench_peers_runs_ddp_and_every_variant_with_ratios(tmp_path):
    proc = run("bench", "peers", "--nodes", "2", "--steps", "20", "--width", "32", "--no-hivemind", "--json",
               "--algorithms", "local,allreduce,allreduce-ring,allreduce-models,sgp-tau1", "--eval-every", "5",
               "--out", str(tmp_path),
               "--extra", "--num-train 1200 --num-test 300")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    names = [v["name"] for v in result["variants"]]
    assert names == [BASELINE, peers.FLOOR, "allreduce", "allreduce-ring", "allreduce-models", "sgp-tau1"]
    for variant in result["variants"]:
        assert variant["error"] is None, variant
        for key in ("step_seconds", "cpu_seconds_per_step", "bytes_per_step", "test_accuracy", "wall_seconds",
                    "step_p50", "step_p95", "step_max", "wall_per_step"):
            if key == "bytes_per_step" and variant["name"] == peers.FLOOR:
                assert variant[key] == 0  # every node alone: nothing sent
                continue
            assert numeric(variant[key]) and variant[key] > 0, (variant["name"], key, variant[key])
        assert variant["step_p50"] <= variant["step_p95"] <= variant["step_max"], variant
        assert variant["step_seconds"] <= variant["step_max"], variant
        assert [point[0] for point in variant["accuracy_curve"]] == [5, 10, 15, 20]  # every --eval-every steps
        assert all(0 <= seconds and 0 <= accuracy <= 1 for _, seconds, accuracy in variant["accuracy_curve"])
        for ratio in ("step", "cpu", "bytes"):
            assert numeric(result["ratios"][variant["name"]][ratio])
    by_name = {v["name"]: v for v in result["variants"]}
    # the target defaults to DDP's final accuracy (less a rounding slack): DDP reaches it by its last evaluation
    assert result["target_accuracy"] == pytest.approx(by_name[BASELINE]["test_accuracy"] - peers.TARGET_SLACK)
    assert by_name[BASELINE]["time_to_target"] is not None
    ddp_ratios = dict(result["ratios"][BASELINE])
    tail = ddp_ratios.pop("tail")  # (DDP's own mean step over its median)
    assert ddp_ratios == {"step": 1.0, "time_to_target": 1.0, "cpu": 1.0, "bytes": 1.0}
    assert tail == pytest.approx(by_name[BASELINE]["step_seconds"] / by_name[BASELINE]["step_p50"])
    # the same ring payload: DDP's gloo ring and p2ptrain's send 2 (n - 1) / n of the gradient bytes;
    # on one host the default sums in shared memory (host_allreduce.py): no gradient bytes on any link
    assert by_name["allreduce-ring"]["bytes_per_step"] == pytest.approx(by_name[BASELINE]["bytes_per_step"],
                                                                        rel=0.02)
    assert by_name["allreduce"]["bytes_per_step"] < 0.01 * by_name[BASELINE]["bytes_per_step"]
    assert by_name["sgp-tau1"]["bytes_per_step"] == pytest.approx(by_name[BASELINE]["bytes_per_step"], rel=0.02)
    # AllReduce of gradients is DDP's math on the same shards, batches and initial model
    assert by_name["allreduce"]["test_accuracy"] == pytest.approx(by_name[BASELINE]["test_accuracy"], abs=0.02)
    # the floor row is DDP's loop alone: it reaches an accuracy of its own (each shard trained apart)
    assert 0 < by_name[peers.FLOOR]["test_accuracy"] <= 1
    assert "the least a step costs on this host" in proc.stderr
    checks = {t["check"] for t in result["targets"]}
    assert "SGP tau=1 step vs DDP" in checks and "AllReduce-SGD (gradients) step vs DDP" in checks
    assert "x DDP" in proc.stderr and ("PASS" in proc.stderr or "MISS" in proc.stderr)


def test_bench_peers_rejects_unknown_variant_and_bandwidth_without_netns(tmp_path):
    proc = run("bench", "peers", "--algorithms", "allreduce,warp", "--out", str(tmp_path))
    assert proc.returncode == 2 and "warp" in proc.stderr and "Traceback" not in proc.stderr
    proc = run("bench", "peers", "--bandwidth", "200mbit", "--out", str(tmp_path))
    assert proc.returncode == 2 and "--netns" in proc.stderr and "Traceback" not in proc.stderr


def test_accuracy_curve_takes_the_slowest_node_and_leaves_evaluations_out():
    progress = [
        [{"step": 10, "time": 100.0, "loss": 1.0},
         {"step": 10, "time": 102.0, "test_accuracy": 0.5, "eval_seconds": 1.0},
         {"step": 20, "time": 105.0, "test_accuracy": 0.7, "eval_seconds": 1.0}],
        [{"step": 10, "time": 103.0, "test_accuracy": 0.7, "eval_seconds": 0.5},
         {"step": 20, "time": 104.0, "test_accuracy": 0.9, "eval_seconds": 0.5}],
    ]
    curve = accuracy_curve(progress, [100.0, 100.0])
    assert curve == [[10, pytest.approx(2.5), pytest.approx(0.6)], [20, pytest.approx(3.0), pytest.approx(0.8)]]
    assert time_to_accuracy(curve, 0.8) == pytest.approx(3.0)
    assert time_to_accuracy(curve, 0.81) is None and time_to_accuracy(curve, None) is None


def test_step_statistics_are_per_node_after_warm_up_and_ratios_use_the_mean(tmp_path):
    def node(rank, tail):
        recorder = RunRecorder(None, f"node{rank}", log_every=100)
        for step, seconds in enumerate([5.0, 5.0] + [0.01] * 17 + [tail], start=1):  # the first 10% is warm-up
            recorder.step_done(step, seconds, None)
        return recorder.summary()

    summaries = [node(0, 0.5), node(1, 0.01)]
    assert summaries[0]["median_step_seconds"] == pytest.approx(0.01)
    assert summaries[0]["steady_step_seconds"] == pytest.approx((17 * 0.01 + 0.5) / 18)
    assert summaries[0]["p95_step_seconds"] == pytest.approx(0.01 + 0.15 * 0.49)  # between the 17th and 18th of 18
    assert summaries[0]["max_step_seconds"] == pytest.approx(0.5)
    result = summarize("allreduce", 2, 20, tmp_path, {"nodes": summaries, "cluster": {"wall_seconds": 9.0}})
    assert result.step_seconds == pytest.approx(((17 * 0.01 + 0.5) / 18 + 0.01) / 2)  # mean over nodes of means
    assert result.step_p50 == pytest.approx(0.01)
    assert result.step_p95 == pytest.approx((0.01 + 0.15 * 0.49 + 0.01) / 2)
    assert result.step_max == pytest.approx(0.5)  # the slowest step of any node
    assert math.isnan(result.wall_per_step)  # no progress files: no training seconds to the last step
    ddp = PeersResult(BASELINE, 2, 20, step_seconds=0.01, step_p50=0.01)
    checks = {c[0]: c for c in check_targets([ddp, result], "loopback")}
    # the median step is DDP's, but one slow step makes the mean (and the run) 2.36x slower: a MISS
    assert checks["AllReduce-SGD (gradients) step vs DDP"][1:] == (pytest.approx(result.step_seconds / 0.01), 1.0,
                                                                   False)


def test_targets_are_ratios_to_ddp_of_the_same_run():
    def result(name, seconds, time_to_target):
        return PeersResult(name, 4, 200, step_seconds=seconds, time_to_target=time_to_target)

    results = [result("ddp", 0.040, 8.0), result("allreduce", 0.036, 7.0), result("sgp-tau1", 0.030, None)]
    results[1].step_p50, results[2].step_p50 = 0.035, 0.024
    checks = {c[0]: c for c in check_targets(results, "loopback")}
    assert checks["AllReduce-SGD (gradients) step vs DDP"][1:] == (pytest.approx(0.9), 1.0, True)
    assert checks["SGP tau=1 step vs DDP"][1:] == (pytest.approx(0.75), 0.6, False)
    # issue 29's tail: the mean step within 15% of the variant's own median
    assert checks["AllReduce-SGD (gradients) mean step over its median"][1:] == (pytest.approx(36 / 35), 1.15, True)
    assert checks["SGP tau=1 mean step over its median"][1:] == (pytest.approx(1.25), 1.15, False)
    assert checks["SGP tau=1 time to target accuracy vs DDP"][1] == math.inf  # never reached it
    assert [c[0] for c in check_targets(results, "netns, cap 200mbit")] == ["SGP tau=1 step vs DDP"]


def test_above_floor_is_the_share_of_ddps_cost_of_communicating():
    """(variant - local) / (DDP - local), on the mean steps: 0 = communicates for free, 1 = as DDP."""
    def result(name, seconds):
        return PeersResult(name, 4, 200, step_seconds=seconds)

    results = [result(BASELINE, 0.040), result(peers.FLOOR, 0.020), result("allreduce", 0.030),
               result("sgp-tau1", 0.045), result("dpsgd", math.nan)]
    assert peers.above_floor(results) == {"allreduce": pytest.approx(0.5), "sgp-tau1": pytest.approx(1.25),
                                          "dpsgd": None}
    assert peers.above_floor(results[:1] + results[2:]) == {}  # no local row
    assert peers.above_floor([result(BASELINE, 0.020), result(peers.FLOOR, 0.021)]) == {}  # DDP no slower


def test_rounds_combine_into_means_with_each_rounds_ratio_to_its_own_ddp_run():
    """--rounds: per variant the means of the rounds (the slowest step: the max), time to target
    only where every round reached it, a failed round in `error`; the ratios round by round."""
    def result(name, seconds, p50, worst, reached, error=None):
        return PeersResult(name, 4, 200, step_seconds=seconds, step_p50=p50, step_p95=2 * p50, step_max=worst,
                           wall_per_step=seconds, cpu_seconds_per_step=seconds / 2, bytes_per_step=1e6,
                           test_accuracy=0.9, time_to_target=reached, wall_seconds=10.0, error=error)

    rounds = [[result(BASELINE, 0.020, 0.019, 0.05, 4.0), result("sgp-tau1", 0.012, 0.011, 0.04, 3.0)],
              [result(BASELINE, 0.030, 0.028, 0.09, 6.0), result("sgp-tau1", 0.021, 0.019, 0.03, None)]]
    ddp, sgp = peers.combine_rounds(rounds)
    assert (ddp.step_seconds, ddp.step_p50, ddp.step_max, ddp.time_to_target) == \
        (pytest.approx(0.025), pytest.approx(0.0235), 0.09, pytest.approx(5.0))
    assert (sgp.step_seconds, sgp.step_max, sgp.time_to_target, sgp.wall_seconds) == \
        (pytest.approx(0.0165), 0.04, None, 20.0)  # one round never reached the target
    assert peers.ratios([ddp, sgp])["sgp-tau1"]["step"] == pytest.approx(0.66)
    assert peers.round_ratios(rounds) == {BASELINE: [1.0, 1.0], "sgp-tau1": [pytest.approx(0.6), pytest.approx(0.7)]}
    rounds[1][1] = result("sgp-tau1", math.nan, math.nan, math.nan, None, error="node 2 exited with 1")
    sgp = peers.combine_rounds(rounds)[1]
    assert sgp.step_seconds == pytest.approx(0.012) and sgp.error == "1 of 2 rounds failed: node 2 exited with 1"
    assert peers.round_ratios(rounds)["sgp-tau1"] == [pytest.approx(0.6), None]
    assert peers.combine_rounds(rounds[:1]) is rounds[0]


def test_step_clock_leaves_work_off_the_clock_out():
    clock = StepClock()
    time.sleep(0.05)
    with clock.off_the_clock() as spent:
        # burn 0.05 s of this thread's CPU off the clock (the process's CPU clock also counts other
        # threads left by earlier tests, and then runs ahead of the wall clock: 0.04995 s seen)
        end = time.thread_time() + 0.05
        while time.thread_time() < end:
            pass
    seconds, cpu = clock.lap()
    tick = 1.0 / os.sysconf("SC_CLK_TCK")  # os.times() counts user and system time in clock ticks
    assert spent["seconds"] >= 0.05 and spent["cpu_seconds"] >= 0.05 - 2 * tick - 1e-9
    assert 0.045 <= seconds < 0.09 and cpu < 0.03


def test_gloo_interface_and_process_tree_cpu():
    assert interface_of("127.0.0.1") == "lo"
    with pytest.raises(ValueError):
        interface_of("192.0.2.77")  # TEST-NET-1: on no interface here
    child = subprocess.Popen([sys.executable, "-c", "import time\nend = time.process_time() + 0.3\n"
                                                    "while time.process_time() < end: pass\ntime.sleep(5)"])
    try:
        before = tree_cpu_seconds()
        time.sleep(1.0)
        assert tree_cpu_seconds() - before >= 0.2  # the child's CPU counts while it runs
    finally:
        child.kill()
        child.wait()


@pytest.mark.slow
@pytest.mark.skipif(not peers.hivemind_available(), reason="hivemind (the optional `hivemind` extra) is not installed")
@pytest.mark.timeout(300)
def test_bench_peers_adds_a_hivemind_row_when_installed(tmp_path):
    proc = run("bench", "peers", "--nodes", "2", "--steps", "6", "--width", "32", "--json", "--algorithms",
               "sgp-tau1", "--eval-every", "3", "--out", str(tmp_path), "--extra", "--num-train 600 --num-test 200")
    assert proc.returncode == 0, proc.stderr[-3000:]
    by_name = {v["name"]: v for v in json.loads(proc.stdout)["variants"]}
    assert list(by_name) == [BASELINE, "sgp-tau1", "hivemind"]
    hivemind = by_name["hivemind"]
    assert hivemind["error"] is None and hivemind["step_seconds"] > 0 and hivemind["bytes_per_step"] > 0
