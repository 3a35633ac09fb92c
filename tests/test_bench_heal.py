"""`p2ptrain bench heal` (issue 27): its figures from a run's report, its flags, and one real
kill/restart run end to end (slow)."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from p2ptrain.bench import heal


def _node(rank, **extra):
    return {"rank": rank, "steady_step_seconds": 0.02 + rank / 1000, "median_step_seconds": 0.018,
            "max_step_seconds": 0.1 * (rank + 1), "test_accuracy": 0.9 + rank / 100, **extra}


def test_summary_takes_survivors_step_times_and_the_restarts_timeline(tmp_path):
    """The survivors' step times (not the restarted node's), start-up from the launcher's restart
    time to the node's state request, rejoin from that request to its first step as a member."""
    (tmp_path / "faults.jsonl").write_text("\n".join(json.dumps(e) for e in [
        {"action": "kill", "rank": 1, "time": 90.0, "skipped": False},
        {"action": "restart", "rank": 1, "time": 100.0, "skipped": False}]) + "\n")
    timeline = {"asked": 104.5, "state": 104.6, "trained": 104.75, "state_bytes": 3.6e6}
    report = {"nodes": [_node(0), _node(1, max_step_seconds=9.0, join_timeline=timeline), _node(2), None],
              "verdicts": [{"name": "identical", "ok": True, "detail": "model and optimizer state bit-identical"}]}
    result = heal.summarize(heal.HealResult("allreduce", True), report, tmp_path)
    assert result.survivor_longest_s == pytest.approx(0.3)  # node 1's 9 s is not a survivor's
    assert result.mean_step_ms == pytest.approx(1000 * (0.020 + 0.022) / 2)
    assert result.startup_s == pytest.approx(4.5) and result.rejoin_s == pytest.approx(0.25)
    assert result.state_mb == pytest.approx(3.6) and result.identical.startswith("model and optimizer")
    assert result.accuracy == pytest.approx((0.90 + 0.91 + 0.92) / 3)
    report["verdicts"][0].update(ok=False, detail="model differs")
    clean = heal.summarize(heal.HealResult("allreduce", False), report, tmp_path)
    assert math.isnan(clean.startup_s) and clean.survivor_longest_s == pytest.approx(9.0)
    assert heal.summarize(heal.HealResult("x", True), report, tmp_path).identical == "NO: model differs"


def test_torchft_figures_become_a_row():
    row = heal.torchft_result({"mean_step_ms": 33.4, "survivor_longest_step_s": 10.04, "restart_startup_s": 4.4,
                               "rejoin_s": 0.2, "bit_identical": True, "optimizer_identical": True,
                               "accuracy": {"0": 0.93, "1": 0.95}}, True)
    assert (row.mean_step_ms, row.survivor_longest_s, row.startup_s) == (33.4, 10.04, 4.4)
    assert row.accuracy == pytest.approx(0.94) and "bit-identical" in row.identical
    assert math.isnan(heal.torchft_result({"restart_startup_s": 4.0}, False).startup_s)


def test_bench_heal_refuses_bad_steps_and_unknown_algorithms(tmp_path):
    for flags in (["--algorithms", "sgp"], ["--kill-at", "200", "--restart-at", "150"], ["--nodes", "2"]):
        run = subprocess.run([sys.executable, "-m", "p2ptrain", "bench", "heal", "--out", str(tmp_path), *flags],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 2 and "p2ptrain bench heal:" in run.stderr, (flags, run.stderr)


@pytest.mark.slow  # ~40 s: two real 4-node clusters
@pytest.mark.timeout(600)
def test_bench_heal_kills_and_restarts_a_node_and_the_members_end_bit_identical(tmp_path):
    run = subprocess.run([sys.executable, "-m", "p2ptrain", "bench", "heal", "--algorithms", "allreduce",
                          "--no-torchft", "--out", str(tmp_path), "--json"], capture_output=True, text=True,
                         timeout=580)
    assert run.returncode == 0, run.stderr[-3000:]
    runs = json.loads(run.stdout)["runs"]
    healed = next(r for r in runs if r["faults"])
    assert healed["identical"].startswith("model and optimizer state bit-identical on 4"), healed
    assert healed["rejoin_s"] > 0 and healed["startup_s"] > 0 and healed["state_mb"] == pytest.approx(3.6762)
    assert "survivors' longest step <= 1 s" in run.stderr
