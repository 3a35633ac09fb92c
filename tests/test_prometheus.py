"""A real Prometheus scrapes a real 3-node cluster through the scrape config `p2ptrain launch`
writes (OUT/prometheus.yml): every node's traffic, step, loss and step-time series arrive with
sane values, every target is up, and every Grafana dashboard query evaluates on that data.

Needs the `prometheus` binary (Debian package `prometheus`, installed by .ci/run); skips without it.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from launcher.ports import free_ports

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "launcher" / "grafana" / "dashboards" / "p2ptrain.json"
NODES = 3
STEPS = 100_000      # far more than the test waits for: the cluster is stopped once the checks pass
DEADLINE = 45.0      # seconds for the cluster to start and Prometheus to see every series

PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason="the prometheus binary is not installed (Debian: "
                                                            "apt-get install prometheus; .ci/run does)")


def query(base: str, expr: str) -> list[dict]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as response:
        body = json.load(response)
    assert body["status"] == "success", f"{expr}: {body}"
    return body["data"]["result"]


def by_node(results: list[dict]) -> dict[str, float]:
    """{node label: value}, summing series that share a node (one per peer for the byte counters)."""
    out: dict[str, float] = {}
    for r in results:
        out[r["metric"].get("node")] = out.get(r["metric"].get("node"), 0.0) + float(r["value"][1])
    return out


def _stop(proc: subprocess.Popen | None, sig: int, grace: float) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _kill_leftover_nodes(out: Path) -> None:
    """Nodes run in their own sessions; should the launcher itself have been killed, end the node
    processes this test started (their command line names its unique run folder)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(out).encode() in cmdline and b"node" in cmdline:
            try:
                os.kill(int(entry.name), signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_real_prometheus_scrapes_a_local_cluster(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    launch_log = open(tmp_path / "launch.log", "wb")
    prom_log = open(tmp_path / "prometheus.log", "wb")
    cluster = prom = None
    start = time.monotonic()
    try:
        cluster = subprocess.Popen(
            [sys.executable, "-m", "p2ptrain", "launch", "--nodes", str(NODES), "--steps", str(STEPS),
             "--hidden", "32", "--log-every", "50", "--no-live", "--timeout", "90", "--out", str(out)],
            env=env, stdin=subprocess.DEVNULL, stdout=launch_log, stderr=subprocess.STDOUT)
        config_path = out / "prometheus.yml"
        while not config_path.exists():
            log = (tmp_path / "launch.log").read_text
            assert cluster.poll() is None, f"launch exited {cluster.returncode}: {log()}"
            assert time.monotonic() - start < 20, "launch wrote no prometheus.yml"
            time.sleep(0.1)
        time.sleep(0.2)  # written in one call right after the ports are known; let it land
        config = yaml.safe_load(config_path.read_text())
        assert config["global"]["scrape_interval"] == "1s"
        targets = {s["labels"]["service"]: s["targets"][0] for s in config["scrape_configs"][0]["static_configs"]}
        assert sorted(targets) == [f"node{i}" for i in range(NODES)]
        assert all(t.startswith("127.0.0.1:") for t in targets.values())

        # the nodes may not have bound their /metrics ports yet: Prometheus must not take one
        (port,) = free_ports(1, exclude=[int(t.rsplit(":", 1)[1]) for t in targets.values()])
        base = f"http://127.0.0.1:{port}"
        prom = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config_path}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1h"],
            stdin=subprocess.DEVNULL, stdout=prom_log, stderr=subprocess.STDOUT)

        def snapshot() -> dict[str, dict[str, float]]:
            return {name: by_node(query(base, expr)) for name, expr in {
                "up": 'up{job="p2ptrain"}',
                "sent": "p2ptrain_sent_bytes_total", "received": "p2ptrain_received_bytes_total",
                "step": "p2ptrain_step", "loss": "p2ptrain_loss", "steps_timed": "p2ptrain_step_seconds_count",
            }.items()}

        nodes = {str(i) for i in range(NODES)}
        seen: dict[str, dict[str, float]] = {}
        while True:
            assert cluster.poll() is None, f"cluster stopped early: {(tmp_path / 'launch.log').read_text()[-3000:]}"
            assert prom.poll() is None, f"prometheus exited: {(tmp_path / 'prometheus.log').read_text()[-3000:]}"
            try:
                seen = snapshot()
            except (urllib.error.URLError, ConnectionError):
                seen = {}  # Prometheus still starting
            if seen and all(set(series) == nodes for series in seen.values()) and \
                    all(v >= 1 for v in seen["step"].values()) and all(v == 1 for v in seen["up"].values()):
                break
            assert time.monotonic() - start < DEADLINE, f"series missing after {DEADLINE} s: {seen}"
            time.sleep(0.5)

        for node in nodes:
            assert seen["sent"][node] > 0 and seen["received"][node] > 0, seen
            assert 1 <= seen["step"][node] <= STEPS, seen
            assert math.isfinite(seen["loss"][node]) and 0 < seen["loss"][node] < 10, seen
            assert seen["steps_timed"][node] >= 1, seen
        # every target carries its node label and was scraped as that node
        up = query(base, 'up{job="p2ptrain"}')
        targets = {(r["metric"]["service"], r["metric"]["node"]) for r in up}
        assert targets == {(f"node{i}", str(i)) for i in range(NODES)}
        # what a node sends is what its peers receive (counters of one instant, so within a few steps)
        total_sent, total_received = sum(seen["sent"].values()), sum(seen["received"].values())
        assert total_received <= total_sent * 1.5 and total_sent <= total_received * 1.5

        # every dashboard query is valid PromQL here; the traffic and training ones return all nodes
        time.sleep(2.5)  # rate() over a 5 s window needs two samples in it
        dashboard = json.loads(DASHBOARD.read_text())
        exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
        results = {expr: query(base, expr.replace("$__rate_interval", "5s")) for expr in exprs}
        for expr in ("sum by (node, peer) (rate(p2ptrain_sent_bytes_total[$__rate_interval]))",
                     "sum by (node) (rate(p2ptrain_step_seconds_count[$__rate_interval]))", "p2ptrain_loss"):
            assert {r["metric"]["node"] for r in results[expr]} == nodes, (expr, results[expr])
            assert all(float(r["value"][1]) > 0 for r in results[expr]), (expr, results[expr])
        links = {(r["metric"]["node"], r["metric"]["peer"])
                 for r in results["sum by (node, peer) (rate(p2ptrain_sent_bytes_total[$__rate_interval]))"]}
        assert all(a != b for a, b in links) and len(links) >= NODES
    finally:
        _stop(prom, signal.SIGTERM, 10)
        _stop(cluster, signal.SIGINT, 20)   # the launcher stops its nodes on Ctrl-C
        _kill_leftover_nodes(out)
        launch_log.close()
        prom_log.close()
