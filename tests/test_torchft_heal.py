"""The torchft healing baseline of issue 27 (p2ptrain.bench.torchft_heal): its figures from synthetic
progress files, and (slow, with torchft installed) a real SIGKILL and restart of a torchft replica."""
from __future__ import annotations

import json
import math
import sys

import pytest

from p2ptrain.bench.torchft_heal import heal_figures, progress_path, read_progress, run_torchft_heal


def write_records(path, records, partial: str = "") -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + partial)


def survivor_records(replica: int, steps: int, digest: str) -> list[dict]:
    """Steps of 50 ms each from t=100, but step 12 stalls 5 s (the kill)."""
    records = [{"event": "start", "replica": replica, "pid": 1, "process_start": 90.0, "t": 91.0},
               {"event": "quorum_request", "t": 100.0}]
    for step in range(1, steps + 1):
        seconds = 5.05 if step == 12 else 0.05
        t = 100 + 0.05 * step + (5.0 if step >= 12 else 0.0)
        records.append({"event": "step", "iter": step, "step": step, "committed": True, "t": t, "seconds": seconds,
                        "loss": 1.0, "participants": 3, **({"error": "AssertionError"} if step == 12 else {})})
    records.append({"event": "done", "t": 110.0, "step": steps, "accuracy": 0.9, "params_sha256": digest,
                    "optimizer_sha256": "o" + digest})
    return records


def restarted_records(digest: str) -> list[dict]:
    return [{"event": "start", "replica": 1, "pid": 2, "process_start": 103.0, "t": 104.0},
            {"event": "manager", "manager_start": 104.5, "t": 104.6},
            {"event": "quorum_request", "t": 105.0},
            {"event": "step", "iter": 1, "step": 14, "committed": False, "t": 105.5, "seconds": 0.5, "loss": 1.0,
             "participants": 3},
            *({"event": "step", "iter": i, "step": 13 + i, "committed": True, "t": 105.5 + 0.5 * (i - 1),
               "seconds": 0.05, "loss": 1.0, "participants": 4} for i in range(2, 8)),
            {"event": "done", "t": 110.0, "step": 20, "accuracy": 0.8, "params_sha256": digest,
             "optimizer_sha256": "o" + digest}]


def load(tmp_path, keys) -> dict:
    return {key: read_progress(progress_path(tmp_path, *key)) for key in keys}


def test_figures_from_progress_files(tmp_path):
    keys = [(0, 0), (1, 0), (2, 0), (3, 0), (1, 1)]
    for replica in (0, 2, 3):
        # a line still being written when read is left out
        write_records(progress_path(tmp_path, replica), survivor_records(replica, 20, "d"), partial='{"event": "st')
    write_records(progress_path(tmp_path, 1), survivor_records(1, 8, "killed")[:-1])  # SIGKILLed: no "done"
    write_records(progress_path(tmp_path, 1, 1), restarted_records("d"))
    records = load(tmp_path, keys)
    assert [r["event"] for r in records[(0, 0)]][-1] == "done"
    figures = heal_figures(records, steps=20, killed=1)
    # from the end of step 10 (t=100.5) to step 20 (t=106.0): 5.5 s over 10 steps, the stall included
    assert figures["mean_step_ms"] == pytest.approx(550.0)
    assert figures["p50_step_ms"] == pytest.approx(50.0)
    assert figures["survivor_longest_step_s"] == pytest.approx(5.05)
    assert figures["survivor_longest_steps_s"] == {"0": pytest.approx(5.05), "2": pytest.approx(5.05),
                                                   "3": pytest.approx(5.05)}
    assert figures["restart_startup_s"] == pytest.approx(2.0)  # process start 103 -> quorum request 105
    assert figures["rejoin_s"] == pytest.approx(1.0)  # quorum request 105 -> first committed step 106
    assert figures["rejoined_at_step"] == 15 and figures["restarted_steps_trained"] == 6
    assert figures["survivors_finished"] and figures["bit_identical"] and figures["optimizer_identical"]
    assert figures["accuracy"] == {"0": 0.9, "1": 0.8, "2": 0.9, "3": 0.9}
    assert figures["survivor_step_errors"] == 3 and figures["first_step_error"] == "AssertionError"

    write_records(progress_path(tmp_path, 1, 1), restarted_records("other"))
    diverged = heal_figures(load(tmp_path, keys), steps=20, killed=1)
    assert not diverged["bit_identical"] and not diverged["optimizer_identical"]
    progress_path(tmp_path, 1, 1).write_text("")  # the restarted process never got going
    missing = heal_figures(load(tmp_path, keys), steps=20, killed=1)
    assert missing["restart_startup_s"] is None and missing["rejoin_s"] is None
    assert not missing["bit_identical"] and missing["accuracy"]["1"] is None


def test_fault_free_figures_count_every_replica(tmp_path):
    records = {(r, 0): survivor_records(r, 20, "d") for r in range(4)}
    figures = heal_figures(records, steps=20, killed=None)
    assert figures["survivor_longest_steps_s"].keys() == {"0", "1", "2", "3"}
    assert figures["bit_identical"] and "rejoin_s" not in figures


def test_without_torchft_the_driver_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchft", None)  # import torchft raises ImportError
    with pytest.raises(ModuleNotFoundError, match=r"pip install torchft==0\.2\.0"):
        run_torchft_heal(tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_torchft_survives_a_sigkill_and_the_restarted_replica_trains(tmp_path):
    pytest.importorskip("torchft")
    # 10 s timeouts keep the stall short; the restart at 70 leaves the restarted process ~230 steps to rejoin
    figures = run_torchft_heal(tmp_path, steps=300, kill_at=40, restart_at=70, ft_timeout=10, timeout=300)
    assert figures["error"] is None, figures
    assert figures["survivors_finished"]
    assert math.isfinite(figures["mean_step_ms"]) and figures["mean_step_ms"] > 0
    assert figures["survivor_longest_step_s"] < 60
    assert figures["restart_startup_s"] > 0 and figures["rejoin_s"] >= 0
    assert figures["restarted_steps_trained"] > 0 and figures["rejoined_at_step"] > 70
    assert figures["bit_identical"] and figures["optimizer_identical"]
    assert all(0 <= a <= 1 for a in figures["accuracy"].values())
