"""`p2ptrain bench transport` runs all three methods between real processes and reports ratios."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT, node_env


@pytest.mark.timeout(240)
def test_bench_transport_json_reports_every_method_and_ratios():
    proc = subprocess.run([sys.executable, "-m", "p2ptrain", "bench", "transport", "--size-mb", "4", "--reps", "3",
                           "--rounds", "1", "--json"], cwd=ROOT, env=node_env(), capture_output=True, text=True,
                          timeout=230)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert set(report["methods"]) == {"p2ptrain", "gloo", "tcp"}
    for result in report["methods"].values():
        assert result["mb_per_s"] > 0 and result["min_mb_per_s"] <= result["mb_per_s"] <= result["max_mb_per_s"]
        # CPU is measured (os.times has 10 ms resolution, so tiny runs may read 0)
        assert result["sender_cpu_s_per_gb"] >= 0 and result["receiver_cpu_s_per_gb"] >= 0
    methods = report["methods"]
    assert report["ratios"]["p2ptrain/gloo"] == pytest.approx(methods["p2ptrain"]["mb_per_s"] / methods["gloo"]["mb_per_s"])
    assert report["size_bytes"] == 4_000_000


def test_bench_transport_rejects_unknown_method():
    proc = subprocess.run([sys.executable, "-m", "p2ptrain", "bench", "transport", "--methods", "nccl"], cwd=ROOT,
                          env=node_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "unknown method" in proc.stderr and "Traceback" not in proc.stderr
