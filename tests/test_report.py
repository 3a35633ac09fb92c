"""`p2ptrain report`: the report of a run rebuilt from its folder, and merged from one folder per
host, is the report `p2ptrain launch` wrote (a real 3-node run, its files split over two folders)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from launcher import report as run_report
from p2ptrain import cli
from tests.conftest import ROOT, node_env


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("report") / "run"
    proc = subprocess.run([sys.executable, "-m", "p2ptrain", "launch", "--nodes", "3", "--steps", "30", "--log-every",
                           "10", "--hidden", "32", "--num-train", "1500", "--num-test", "300", "--out", str(out),
                           "--no-live", "--no-metrics"], cwd=ROOT, env=node_env(), capture_output=True, text=True,
                          timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def copy_nodes(run: Path, dest: Path, ranks) -> Path:
    dest.mkdir(parents=True)
    for rank in ranks:
        for path in run.glob(f"node{rank}.*"):
            shutil.copy(path, dest / path.name)
    return dest


def report_of(folder: Path) -> dict:
    return json.loads((folder / run_report.REPORT_NAME).read_text())


def test_two_host_folders_give_the_report_of_one_folder(run, tmp_path, capsys):
    host_a = copy_nodes(run, tmp_path / "hostA", [0, 2])
    host_b = copy_nodes(run, tmp_path / "hostB", [1])
    shared = copy_nodes(run, tmp_path / "shared", [0, 1, 2])
    assert cli.main(["report", str(host_a), str(host_b), "--out", str(tmp_path / "merged")]) == 0
    assert cli.main(["report", str(shared)]) == 0
    assert "3 nodes, mean test accuracy" in capsys.readouterr().out
    merged, single = report_of(tmp_path / "merged"), report_of(shared)
    assert merged == single
    assert (tmp_path / "merged" / run_report.PLOT_NAME).stat().st_size > 10_000
    launched = report_of(run)  # what the launcher wrote: the same numbers (it knew the config, outcomes, wall)
    assert [{k: v for k, v in n.items() if not k.startswith("outcome")} for n in launched["nodes"]] == merged["nodes"]
    for key in ("consensus_distance", "mean_test_accuracy", "total_bytes_sent", "mean_step_seconds"):
        assert merged["cluster"][key] == launched["cluster"][key], key
    assert merged["history"] == launched["history"] and merged["warnings"] == [] and merged["config"] == {}


def test_the_cluster_step_times_are_those_of_the_node_summaries(run):
    """report.json's cluster gives what users pay: the mean step after warm-up, p50, p95, the
    slowest step and wall seconds per step, each from the nodes' summaries (which hold them per node)."""
    nodes, cluster = report_of(run)["nodes"], report_of(run)["cluster"]

    def mean(key):
        return sum(n[key] for n in nodes) / len(nodes)

    assert cluster["steady_step_seconds"] == pytest.approx(mean("steady_step_seconds"))
    assert cluster["p50_step_seconds"] == pytest.approx(mean("median_step_seconds"))
    assert cluster["p95_step_seconds"] == pytest.approx(mean("p95_step_seconds"))
    assert cluster["max_step_seconds"] == max(n["max_step_seconds"] for n in nodes)
    assert cluster["wall_seconds_per_step"] == max(n["mean_step_seconds"] for n in nodes)
    for node in nodes:
        assert 0 < node["median_step_seconds"] <= node["p95_step_seconds"] <= node["max_step_seconds"]
        assert node["steady_step_seconds"] <= node["max_step_seconds"]


def test_step_times_of_no_summaries_are_none():
    assert set(run_report.step_times([{}, None]).values()) == {None}


def test_redrawing_a_launch_folder_keeps_what_only_the_launcher_knew(run, tmp_path):
    folder = tmp_path / "again"
    shutil.copytree(run, folder)
    (folder / run_report.PLOT_NAME).unlink()
    before = report_of(folder)
    assert cli.main(["report", str(folder)]) == 0
    assert report_of(folder) == before and (folder / run_report.PLOT_NAME).exists()
    assert before["config"]["world_size"] == 3 and before["nodes"][0]["outcome"] == "done"


def test_a_node_in_two_folders_is_an_error_and_a_missing_one_a_warning(run, tmp_path, capsys):
    host_a = copy_nodes(run, tmp_path / "a", [0, 1])
    host_b = copy_nodes(run, tmp_path / "b", [1, 2])
    assert cli.main(["report", str(host_a), str(host_b), "--out", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert f"p2ptrain report: node 1 found twice: {host_a}/node1." in err and str(host_b) in err
    assert not (tmp_path / "m").exists()

    partial = copy_nodes(run, tmp_path / "partial", [0, 2])
    assert cli.main(["report", str(partial), "--nodes", "4"]) == 0
    warnings = report_of(partial)["warnings"]
    assert warnings[0] == f"no files of node(s) [1, 3] in {partial}"
    assert "node 1: node1.json missing" in warnings and report_of(partial)["cluster"]["nodes"] == 4
    assert "warning: no files of node(s) [1, 3]" in capsys.readouterr().err

    only_2 = copy_nodes(run, tmp_path / "c", [2])
    assert cli.main(["report", str(host_a), str(only_2)]) == 2  # several folders need --out
    assert "give --out OUT" in capsys.readouterr().err
