"""`p2ptrain bench transport` runs all four methods between real processes and reports ratios;
its p2ptrain push measurement also runs as two prefixed commands (how launcher.netns places them)."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, node_env


@pytest.mark.timeout(240)
def test_bench_transport_json_reports_every_method_and_ratios():
    proc = subprocess.run([sys.executable, "-m", "p2ptrain", "bench", "transport", "--size-mb", "1", "--reps", "2",
                           "--rounds", "1", "--json"], cwd=ROOT, env=node_env(), capture_output=True, text=True,
                          timeout=230)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert set(report["methods"]) == {"grpc", "lane", "shm", "gloo", "tcp"}
    for result in report["methods"].values():
        assert result["mb_per_s"] > 0 and result["min_mb_per_s"] <= result["mb_per_s"] <= result["max_mb_per_s"]
        # CPU is measured (os.times has 10 ms resolution, so tiny runs may read 0)
        assert result["sender_cpu_s_per_gb"] >= 0 and result["receiver_cpu_s_per_gb"] >= 0
        assert result["cpu_s_per_gb"] == pytest.approx(result["sender_cpu_s_per_gb"] + result["receiver_cpu_s_per_gb"])
    methods = report["methods"]
    for plane in ("grpc", "lane", "shm"):
        for base in ("gloo", "tcp"):
            expected = methods[plane]["mb_per_s"] / methods[base]["mb_per_s"]
            assert report["ratios"][f"{plane}/{base}"] == pytest.approx(expected)
    assert report["size_bytes"] == 1_000_000


def test_bench_transport_table_shows_both_planes():
    proc = subprocess.run([sys.executable, "-m", "p2ptrain", "bench", "transport", "--size-mb", "1", "--reps", "2",
                           "--rounds", "1", "--methods", "p2ptrain,lane"], cwd=ROOT, env=node_env(),
                          capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert "cpu-s/GB" in lines[1]
    assert [line.split()[0] for line in lines[2:4]] == ["grpc", "lane"]  # p2ptrain: the gRPC plane's old name
    assert not any(line.startswith("ratio") for line in lines)  # no baseline was run


def test_bench_transport_rejects_unknown_method():
    proc = subprocess.run([sys.executable, "-m", "p2ptrain", "bench", "transport", "--methods", "nccl"], cwd=ROOT,
                          env=node_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "unknown method" in proc.stderr and "Traceback" not in proc.stderr


# -- the p2ptrain push measurement, as launcher.netns runs it (two commands behind argv prefixes) ------

@pytest.mark.timeout(120)
def test_push_pair_runs_behind_argv_prefixes():
    from launcher.ports import free_ports
    from p2ptrain.bench.push import bench_p2ptrain_between

    peers = [f"127.0.0.1:{port}" for port in free_ports(2)]
    result = bench_p2ptrain_between(peers, 1_000_000, 2, timeout=60.0, argv_prefixes=(["env"], ["env", "A=1"]),
                                    data_plane="tcp")
    assert (result.name, result.size_bytes, result.reps) == ("lane", 1_000_000, 2)
    assert result.seconds > 0 and result.mb_per_s > 0
    assert result.sender_cpu_s >= 0 and result.receiver_cpu_s >= 0


@pytest.mark.timeout(60)
def test_push_pair_reports_a_failed_end_and_stops_the_other():
    from p2ptrain.bench.push import bench_p2ptrain_between

    refuse = [sys.executable, "-c", "import sys; sys.exit('sender cannot start here')"]  # ignores the argv after it
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"p2ptrain push sender failed \(exit 1\): sender cannot start here"):
        bench_p2ptrain_between(["127.0.0.1:1", "127.0.0.1:2"], 4, 1, timeout=50.0, argv_prefixes=(refuse, []))
    assert time.monotonic() - started < 30  # the receiver was killed, not waited for


def test_push_pair_rejects_bad_arguments():
    from p2ptrain.bench.push import bench_p2ptrain_between, push_endpoint

    with pytest.raises(ValueError, match="multiple of 4"):
        bench_p2ptrain_between(["a:1", "b:2"], 6, 1)
    with pytest.raises(ValueError, match="2 peers"):
        bench_p2ptrain_between(["a:1"], 8, 1)
    with pytest.raises(ValueError, match="rank 0"):
        push_endpoint(2, ["a:1", "b:2"], 8, 1, 1.0)
