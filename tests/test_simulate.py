"""`p2ptrain simulate` (issue 28): 64 logical nodes in 2 processes through the real transport,
membership and SGP. Σ w is exact, the consensus distance follows push-sum's exact theory, every
node starts, and one node leaving has a measured cost. No timing asserts: the machine may be busy."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
import torch

from p2ptrain.bench.consensus import consensus_distance, push_sum_trace
from p2ptrain.bench.simulate import HOST_GRACE_SECONDS, PLOT_NAME, RESULT_NAME, fit_exponent
from p2ptrain.cli import main
from p2ptrain.topology import build_topology
from tests.conftest import ROOT, node_env

NODES, STEPS = 64, 8
# steps of the baseline window and of the leave's: its switch lies a margin (8) plus the proposer's
# survey round trip at its pace ahead, which on a loaded machine exceeded 12 steps and left the leave
# unfinished at the end (final members 64); the CLI's default
WINDOW = 24

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("simulate")
    assert main(["simulate", "--nodes", str(NODES), "--processes", "2", "--steps", str(STEPS), "--dim", "16",
                 "--window", str(WINDOW), "--out", str(out), "--timeout", "200"]) == 0
    result = json.loads((out / RESULT_NAME).read_text())
    assert len(result["runs"]) == 1
    return result["runs"][0]


def test_every_node_starts_and_the_result_has_its_keys(run):
    assert run["nodes"] == NODES and run["started"] == NODES and run["processes"] == 2
    for key in ("start_seconds", "threads_per_process", "startup", "steady", "connections", "consensus", "change"):
        assert key in run, key
    assert run["start_seconds"] > 0
    # each node greets only its exponential-graph neighbours (±1, ±2, ..., ±32: 11 peers), each about once
    near = len(build_topology("exponential", NODES).neighbourhood(0))
    assert near == 11
    assert near / 2 <= run["startup"]["calls_per_node"]["Hello"] <= 2 * near
    # (a node that finds a peer slow on a busy machine may probe it, or confirm a view, beyond them)
    assert 0 < run["connections"]["channels_per_node"] <= 1.5 * near
    assert run["connections"]["channels_max"] <= 2 * near < NODES - 1
    assert run["steady"]["data_messages_per_node_step"] > 0


def test_meeting_everyone_costs_a_hello_per_peer_and_meeting_neighbours_log_n(tmp_path):
    calls = {}
    for meet in ("everyone", "neighbours"):
        assert main(["simulate", "--nodes", "32", "--processes", "2", "--steps", "2", "--dim", "4", "--window", "10",
                     "--meet", meet, "--out", str(tmp_path / meet), "--timeout", "200"]) == 0
        run = json.loads((tmp_path / meet / RESULT_NAME).read_text())["runs"][0]
        assert run["meet"] == meet and run["started"] == 32
        assert run["consensus"]["sum_w"] == pytest.approx(32, abs=1e-9)
        calls[meet] = run["startup"]["calls_per_node"]["Hello"], run["connections"]["channels_max"]
    assert calls["everyone"][0] >= 31 / 2 and calls["everyone"][1] == 31
    assert calls["neighbours"][0] <= 2 * 9 and calls["neighbours"][1] <= 2 * 9 < 31  # (9: ±1, ±2, ±4, ±8, 16)


def test_push_sum_conserves_mass_and_follows_the_exact_theory(run):
    consensus = run["consensus"]
    assert consensus["sum_w"] == pytest.approx(NODES, abs=1e-9)
    distance = consensus["distance"]
    assert len(distance) == STEPS + 1 and all(b < a for a, b in zip(distance[:4], distance[1:5]))
    assert consensus["mixing_steps"] == consensus["theory_mixing_steps"] == 6  # 64 = 2^6: exact after 6 steps
    assert consensus["max_error_vs_theory"] < 1e-9


def test_a_leave_has_a_measured_cost_and_every_node_agrees(run):
    change = run["change"]
    assert change["node"] == NODES - 1 and change["adopted_by"] == NODES
    assert change["control_messages_per_node"] > 0 and change["control_bytes_per_node"] > 0
    assert change["agreement_seconds"] is not None and change["agreement_seconds"] >= 0
    assert change["final_members"] == NODES - 1
    assert change["final_sum_w"] == pytest.approx(NODES - 1, abs=1e-9)


def test_the_exponential_graph_averages_exactly_in_log2_n_steps():
    start = torch.randn(8, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    trace = push_sum_trace(build_topology("exponential", 8), start, 4)
    average = start.mean(dim=0)
    assert consensus_distance(trace[1], average) > 1e-3
    assert consensus_distance(trace[2], average) < 1e-12


def test_the_fitted_exponent_is_the_log_log_slope():
    assert fit_exponent([16, 32, 64], [3 * 16 ** 1.5, 3 * 32 ** 1.5, 3 * 64 ** 1.5]) == pytest.approx(1.5)
    assert fit_exponent([16], [1.0]) is None


@pytest.mark.slow
def test_a_sweep_fits_the_exponents_and_plots_them(tmp_path):
    assert main(["simulate", "--sweep", "8,16", "--processes", "2", "--steps", "4", "--dim", "8", "--window", "12",
                 "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / RESULT_NAME).read_text())
    assert [run["nodes"] for run in result["runs"]] == [8, 16]
    assert result["fit"]["change_calls"] > 0 and result["fit"]["channels"] > 0
    assert (tmp_path / PLOT_NAME).stat().st_size > 0


def test_launched_nodes_meeting_neighbours_greet_only_their_exponential_graph_neighbours(tmp_path):
    """`p2ptrain launch --meet neighbours`: 8 real SGP processes train; node r meets only
    r ± 1, r ± 2 and r + 4 (5 of its 7 peers: every node opens fewer channels than peers), and Σ w
    stays 8."""
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "p2ptrain", "launch", "--nodes", "8", "--algorithm", "sgp", "--meet", "neighbours",
            "--steps", "30", "--model", "mlp", "--hidden", "32", "--batch-size", "16", "--out", str(out),
            "--no-live", "--no-metrics", "--timeout", "200"]
    proc = subprocess.run(argv, env=node_env(), capture_output=True, text=True, timeout=260, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summaries = [json.loads((out / f"node{r}.json").read_text()) for r in range(8)]
    near = len(build_topology("exponential", 8).neighbourhood(0))
    assert near == 5
    assert all(s["steps"] == 30 for s in summaries)
    channels = [s["channels"] for s in summaries]  # (a node that found a peer slow may have probed beyond them)
    assert all(c > 0 for c in channels) and sum(c <= near for c in channels) >= 6, channels
    assert sum(s["ps_weight"] for s in summaries) + sum(s["ps_in_flight"] for s in summaries) == pytest.approx(8.0)


@pytest.mark.slow  # (open, issue 28: under a CPU hog about 1 run in 15 hangs: a joiner left far behind; docs/scale.md)
def test_churn_joins_and_leaves_keep_one_unit_of_mass_per_member_and_views_agree_fast(tmp_path):
    """`--churn 3`: three members leave as three new nodes join (each takes a member's state and a
    new unit of mass, and is admitted by a view), besides the change window's leaver. Σ w is then
    the final member count exactly, and every view reached every node within a few steps."""
    assert main(["simulate", "--nodes", "16", "--processes", "2", "--steps", "4", "--dim", "8", "--window", "12",
                 "--churn", "3", "--churn-steps", "36", "--out", str(tmp_path), "--timeout", "200"]) == 0
    churn = json.loads((tmp_path / RESULT_NAME).read_text())["runs"][0]["churn"]
    assert churn["events"] == churn["joined"] == 3 and churn["left"] == 4
    assert churn["final_members"] == 16 - 4 + 3
    assert churn["units"] == pytest.approx(15.0, abs=1e-9)
    assert churn["sum_w_error"] < 1e-6
    # the last holder's step less the first's: the view's spread plus the two nodes' own skew, which
    # a CPU hog makes a few steps (10 once seen): within twice DEFAULT_VIEW_MARGIN (8)
    assert churn["views"] >= 4 and churn["agreement_steps_max"] <= 16
    assert churn["control_messages_per_node_per_event"] > 0
    # finish() tells every peer a final member met that its run is over: that is no event's cost
    assert churn["control_messages_per_node_at_finish"] >= 1


def test_a_run_past_its_timeout_ends_with_a_one_line_error(tmp_path, capsys):
    """A run that cannot finish in --timeout (far more steps than it has seconds for) ends with exit 1
    and says so, its processes killed, instead of waiting on its nodes."""
    timeout = 6
    started = time.monotonic()
    assert main(["simulate", "--nodes", "4", "--processes", "2", "--steps", "2", "--dim", "4", "--window", "1000000",
                 "--out", str(tmp_path), "--timeout", str(timeout)]) == 1
    assert time.monotonic() - started < timeout + HOST_GRACE_SECONDS
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("p2ptrain simulate: ") and "unfinished" in error and "--timeout 6" in error
    assert not (tmp_path / RESULT_NAME).exists()


def test_sigint_ends_a_simulation_started_with_sigint_ignored(tmp_path):
    """`p2ptrain simulate` as a background job of a non-interactive shell (SIGINT ignored from
    birth): SIGINT ends it with 130, and no process of its session is left."""
    proc = subprocess.Popen([sys.executable, "-m", "p2ptrain", "simulate", "--nodes", "4", "--processes", "2",
                             "--steps", "2", "--dim", "4", "--window", "1000000", "--out", str(tmp_path),
                             "--timeout", "600"], cwd=ROOT, env=node_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        seen = ""
        while "node 0 ready" not in seen:
            line = proc.stderr.readline()
            assert line, f"simulate ended early: {seen}"
            seen += line
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:  # it ignored SIGINT: take its session down
            subprocess.run(["pkill", "-KILL", "-s", str(proc.pid)], check=False)
            proc.wait()
    assert proc.returncode == 130, err
    assert "interrupted" in err
    deadline = time.monotonic() + 5  # (multiprocessing's resource tracker ends once it reads its pipe's end)
    while (left := subprocess.run(["pgrep", "-a", "-s", str(proc.pid)], capture_output=True,
                                  text=True).stdout.splitlines()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"processes left behind: {left}"
