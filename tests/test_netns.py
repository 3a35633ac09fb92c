"""The network-namespace cluster: real namespaces, veths, a bridge and tc tbf caps.

Tests that build namespaces need root (or CAP_NET_ADMIN + CAP_SYS_ADMIN) and a kernel that lets
this process add one; elsewhere they skip and say why. 50mbit (6.25 MB/s) is far below what an
unshaped veth carries here (hundreds of MB/s), so a measurement under the cap shows tbf binding.
"""
from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from launcher import netns
from launcher.local import NETNS_NODE_PORT, plan_cluster
from p2ptrain import cli
from p2ptrain.bench.netns_link import measure_throughput
from p2ptrain.transport.faults import parse_bandwidth
from tests.conftest import ROOT, node_env, read_launch_header

CAP = "50mbit"
CAP_BYTES = parse_bandwidth(CAP)  # 6.25e6 B/s

_unavailable = netns.probe()
needs_netns = pytest.mark.skipif(_unavailable is not None,
                                 reason=f"network namespaces unavailable: {_unavailable}")


def leftovers(run_id: str) -> list[str]:
    """Namespaces and links of a run still present (from `ip`, not from our own bookkeeping)."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    names += re.findall(r"^\d+: ([^:@]+)", subprocess.run(["ip", "-o", "link"], capture_output=True,
                                                          text=True).stdout, re.M)
    return [n for n in names if n.startswith(f"p2pbr{run_id}") or n.startswith(f"p2p{run_id}")]


def launch_argv(out: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "p2ptrain", "launch", "--netns", "--out", str(out), "--no-live", *args]


def send_rate(progress: Path, key: str) -> float:
    """Bytes/s between the first and last progress record: the training phase, start-up excluded."""
    records = [json.loads(line) for line in progress.read_text().splitlines()]
    records = [r for r in records if key in r]
    assert len(records) >= 3, records
    first, last = records[0], records[-1]
    return (last[key] - first[key]) / (last["time"] - first["time"])


# --- no privileges needed ----------------------------------------------------------------------

def test_plan_cluster_uses_only_namespace_addresses(tmp_path):
    hosts = ["10.9.8.1", "10.9.8.2", "10.9.8.3"]
    prefixes = [["ip", "netns", "exec", f"p2pabcdn{r}"] for r in range(3)]
    specs = plan_cluster(3, tmp_path, ["--steps", "5"], hosts=hosts, argv_prefixes=prefixes)
    peers = ",".join(f"{h}:{NETNS_NODE_PORT}" for h in hosts)
    for spec, host, prefix in zip(specs, hosts, prefixes):
        assert spec.argv[:4] == prefix and spec.host == host
        assert spec.argv[spec.argv.index("--peers") + 1] == peers
        assert spec.argv[spec.argv.index("--listen") + 1] == f"{host}:{NETNS_NODE_PORT}"
        assert not any("127.0.0.1" in arg or "localhost" in arg for arg in spec.argv)
    with pytest.raises(ValueError, match="one entry per node"):
        plan_cluster(3, tmp_path, [], hosts=hosts[:2])


def test_tbf_parameters():
    args = netns.tbf_args(CAP_BYTES)
    assert args[:3] == ["tbf", "rate", "50000000bit"]
    assert int(args[4]) >= CAP_BYTES / netns.TBF_HZ and int(args[4]) >= 1514  # a tick of traffic, >= 1 frame
    assert netns.tbf_args(1000)[4] == str(netns.TBF_MIN_BURST_BYTES)


def test_subnet_validation():
    assert str(netns.parse_subnet("10.77.3.9/24", 3)) == "10.77.3.0/24"
    with pytest.raises(ValueError, match="room for 1 nodes"):
        netns.parse_subnet("10.77.3.0/30", 3)
    with pytest.raises(ValueError, match="not a private"):
        netns.parse_subnet("8.8.8.0/24", 3)
    with pytest.raises(ValueError, match="not an IPv4 network"):
        netns.parse_subnet("10.77.3/99", 3)


@pytest.mark.parametrize("args, message", [
    (["--bandwidth", "50mbit"], "need --netns"),
    (["--netns", "--bandwidth", "50mbps"], "unknown bandwidth unit"),
])
def test_launch_rejects_bad_netns_flags(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exited:
        cli.main(["launch", "--nodes", "2", "--out", str(tmp_path / "x"), *args])
    assert exited.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux) to drop capabilities")
def test_launch_without_privileges_says_so(tmp_path):
    """Root without CAP_NET_ADMIN / CAP_SYS_ADMIN (as in a default container): a one-line error
    naming them, no traceback, nothing created."""
    drop = ["setpriv", "--bounding-set", "-net_admin,-sys_admin", "--inh-caps", "-net_admin,-sys_admin"]
    proc = subprocess.run([*drop, *launch_argv(tmp_path / "run", "--nodes", "2", "--bandwidth", CAP)], cwd=ROOT,
                          env=node_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "p2ptrain launch: --netns needs root or CAP_NET_ADMIN (" in proc.stderr
    assert "without CAP_NET_ADMIN and CAP_SYS_ADMIN)" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


# --- real namespaces ---------------------------------------------------------------------------

@needs_netns
@pytest.mark.timeout(120)
def test_tbf_cap_binds_between_namespaces():
    """p2ptrain's own Transport pushing 4 MB tensors from one namespace to another gets the cap
    (minus header overhead), not the veth's unshaped speed; the host reaches nodes via the bridge."""
    with netns.NetnsCluster(2, bandwidth=CAP_BYTES) as cluster:
        run_id = cluster.run_id
        assert sorted(leftovers(run_id)) == sorted([cluster.bridge, *(n.namespace for n in cluster.nodes),
                                                    *(n.host_ifname for n in cluster.nodes)])
        qdiscs = subprocess.run([*cluster.exec_prefix(0), "tc", "qdisc", "show", "dev", netns.NS_IFNAME],
                                capture_output=True, text=True, check=True).stdout
        assert "tbf" in qdiscs and "rate 50Mbit" in qdiscs, qdiscs

        result = measure_throughput(cluster, 0, 1, size_bytes=4_000_000, reps=3)
        mb_per_s, cap = result["mb_per_s"], CAP_BYTES / 1e6
        print(f"{CAP} tbf between namespaces: {mb_per_s:.2f} MB/s ({mb_per_s / cap:.0%} of {cap:.2f} MB/s)")
        assert 0.5 * cap <= mb_per_s <= 1.05 * cap, result

        server = subprocess.Popen([*cluster.exec_prefix(1), sys.executable, "-m", "http.server", "--bind",
                                   cluster.nodes[1].address, "8765"], cwd=ROOT, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 15
            while True:
                try:
                    with urllib.request.urlopen(f"http://{cluster.nodes[1].address}:8765/", timeout=2) as reply:
                        assert reply.status == 200
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
        finally:
            server.kill()
            server.wait()
    assert leftovers(run_id) == []
    assert not (netns.STATE_DIR / run_id).exists()


@needs_netns
@pytest.mark.timeout(200)
def test_launch_netns_trains_within_the_cap(tmp_path):
    """3 nodes, each in its own namespace with 50mbit up and down: they train, and every node's
    measured send and receive rates stay under the cap (they would be ~10x above it unshaped)."""
    out = tmp_path / "run"
    proc = subprocess.run(launch_argv(out, "--nodes", "3", "--bandwidth", CAP, "--steps", "60", "--model", "mlp",
                                      "--log-every", "10", "--timeout", "150"),
                          cwd=ROOT, env=node_env(), capture_output=True, text=True, timeout=190)
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    line = re.search(r"netns: 3 namespaces .* on bridge p2pbr([0-9a-f]{4}) \(([\d.]+)\), subnet (\S+),", proc.stderr)
    assert line, proc.stderr
    run_id = line.group(1)
    report = json.loads((out / "report.json").read_text())
    assert report["cluster"]["min_test_accuracy"] > 0.4, report["cluster"]  # chance is 0.1
    for rank in range(3):
        progress = out / f"node{rank}.progress.jsonl"
        for key in ("bytes_sent", "bytes_received"):
            rate = send_rate(progress, key)
            print(f"node {rank} {key}: {rate / 1e6:.2f} MB/s (cap {CAP_BYTES / 1e6:.2f})")
            assert 0 < rate <= 1.05 * CAP_BYTES, (rank, key, rate)
    assert leftovers(run_id) == []


@needs_netns
@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)],
                         ids=["sigint", "sigterm"])
def test_interrupted_launch_removes_its_namespaces(tmp_path, sig):
    proc = subprocess.Popen(launch_argv(tmp_path / "run", "--nodes", "2", "--steps", "100000", "--model", "mlp"),
                            cwd=ROOT, env=node_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        header = read_launch_header(proc, 2)
        run_id = re.search(r"bridge p2pbr([0-9a-f]{4})", header).group(1)
        assert len(leftovers(run_id)) == 5  # bridge, 2 namespaces, 2 host veths
        time.sleep(1.0)  # nodes are starting inside
        proc.send_signal(sig)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert leftovers(run_id) == []


@needs_netns
@pytest.mark.timeout(60)
def test_sweep_removes_runs_of_a_killed_launcher():
    """A SIGKILLed launcher cannot clean up; the next start (sweep_stale) does, a live run is kept."""
    code = ("import os, signal, sys; from launcher.netns import NetnsCluster\n"
            "c = NetnsCluster(2).__enter__(); print(c.run_id, flush=True); os.kill(os.getpid(), signal.SIGKILL)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=node_env(), capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == -signal.SIGKILL
    stale = proc.stdout.strip()
    assert len(leftovers(stale)) == 5 and not netns.run_is_live(stale)
    with netns.NetnsCluster(1) as live:  # entering sweeps
        assert leftovers(stale) == []
        assert netns.run_is_live(live.run_id)
        assert netns.sweep_stale() == [] and len(leftovers(live.run_id)) == 3
        clashing = netns.NetnsCluster(1, subnet=str(live.subnet))  # routed now, through live's bridge
        with pytest.raises(netns.NetnsError, match="overlaps"):
            clashing.__enter__()
        assert clashing.run_id and leftovers(clashing.run_id) == []  # a failed start removes what it made
    assert leftovers(live.run_id) == []


@needs_netns
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_unshaped_namespaces_are_far_faster_than_the_cap():
    with netns.NetnsCluster(2) as cluster:
        result = measure_throughput(cluster, 0, 1, size_bytes=16_000_000, reps=4)
    print(f"unshaped veth between namespaces: {result['mb_per_s']:.0f} MB/s")
    assert result["mb_per_s"] > 5 * CAP_BYTES / 1e6, result
