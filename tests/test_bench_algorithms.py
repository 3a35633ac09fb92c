"""`p2ptrain bench algorithms` and `p2ptrain reproduce relaysgd` run real clusters end to end
(tiny sizes here; the real figures come from the full commands)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from p2ptrain.bench.algorithms import VARIANTS, check_targets
from p2ptrain.bench.clusters import VariantResult
from tests.conftest import ROOT, node_env


def result(name, seconds):
    return VariantResult(name, [], 8, 10, seconds, 1.0, 0.5, 0.5, 0.0, 1.0)


def test_targets_are_ratios_of_steady_step_times():
    checks = {c[0]: c for c in check_targets([result("allreduce", 1.0), result("sgp-tau0", 0.5),
                                              result("sgp-tau1", 0.4), result("pipesgd-int8", 0.6)])}
    assert checks["SGP tau=1 vs SGP tau=0"][1] == pytest.approx(0.8) and not checks["SGP tau=1 vs SGP tau=0"][3]
    assert checks["1-peer SGP tau=0 vs ring all-reduce"][3]
    assert not checks["Pipe-SGD int8 vs synchronous all-reduce"][3]


def test_every_variant_and_target_names_flags_a_node_accepts():
    """The variants are flag lists checked only when a bench starts its nodes: parse each one here
    (a renamed codec, such as fp16 -> trunc16, must not leave a variant or a target behind)."""
    from p2ptrain.bench import peers
    from p2ptrain.bench.algorithms import DEFAULT_VARIANTS, TARGETS
    from p2ptrain.cli import build_parser, config_from_args

    parser = build_parser()
    for name, flags in peers.VARIANTS.items():
        args = parser.parse_args(["node", "--rank", "0", "--world-size", "4", "--peers", "a:1,a:2,a:3,a:4", *flags])
        assert config_from_args(args).algorithm == flags[flags.index("--algorithm") + 1], name
    assert set(DEFAULT_VARIANTS) <= set(VARIANTS) and set(VARIANTS) <= set(peers.VARIANTS)
    assert {t[1] for t in TARGETS} | {t[2] for t in TARGETS} <= set(VARIANTS)
    assert {t[1] for t in peers.TARGETS} <= set(peers.VARIANTS)
    assert "trunc16" in VARIANTS["pipesgd-trunc16"] and "trunc16" in VARIANTS["sgp-tau1-trunc16"]


def run(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "p2ptrain", *args], cwd=ROOT, env=node_env(),
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(300)
def test_bench_algorithms_runs_variants_over_emulated_links(tmp_path):
    proc = run("bench", "algorithms", "--nodes", "2", "--steps", "6", "--hidden", "16",
               "--variants", "allreduce,sgp-tau1,pipesgd-int8", "--bandwidth", "50mbit", "--latency", "2ms",
               "--out", str(tmp_path), "--json", "--extra", "--num-train 600 --num-test 200")
    assert proc.returncode == 0, proc.stderr[-3000:]
    table, _, payload = proc.stdout.partition("\n[")
    rows = json.loads("[" + payload)
    assert [r["name"] for r in rows] == ["allreduce", "sgp-tau1", "pipesgd-int8"]
    for row in rows:
        assert row["error"] is None and row["step_seconds"] > 0.002  # 2 ms latency per hop at least
        assert row["step_p50"] <= row["step_p95"] <= row["step_max"] and row["wall_per_step"] > 0.002
        assert "--link" in row["args"]
    by_name = {r["name"]: r for r in rows}
    # int8 ring hops carry a quarter of the float32 bytes of plain all-reduce
    assert by_name["pipesgd-int8"]["bytes_per_step"] < 0.3 * by_name["allreduce"]["bytes_per_step"]
    assert "x AR" in table and "1.00" in table and "mean step ms" in table and "wall/step" in table


def test_bench_algorithms_rejects_unknown_variant(tmp_path):
    proc = run("bench", "algorithms", "--variants", "allreduce,warp", "--out", str(tmp_path))
    assert proc.returncode == 2 and "warp" in proc.stderr and "Traceback" not in proc.stderr
    assert set(VARIANTS) >= {"allreduce", "dpsgd", "sgp-tau0", "sgp-tau1", "relaysgd", "pipesgd-int8"}


@pytest.mark.slow  # 22 s; test_bench_algorithms_runs_variants_over_emulated_links stays in the default suite
@pytest.mark.timeout(300)
def test_reproduce_relaysgd_prints_the_alpha_table(tmp_path):
    proc = run("reproduce", "relaysgd", "--nodes", "3", "--steps", "5", "--alphas", "0.1",
               "--out", str(tmp_path), "--num-train", "600", "--extra", "--num-test 200 --hidden 16")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:2] == ["algorithm", "alpha=0.1"]
    assert [line.split()[0] for line in lines[2:6]] == ["allreduce", "dpsgd", "relaysgd", "relaysgd-world-size"]
    assert "alpha=0.1: relaysgd is" in proc.stdout and "alpha=0.1: relaysgd-world-size is" in proc.stdout
