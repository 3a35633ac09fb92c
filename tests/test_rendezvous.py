"""Rendezvous (p2ptrain/transport/rendezvous.py): nodes given no peer list meet through a real c10d
TCPStore: torchrun's, one the test starts, one the rank-0 node hosts (the Slurm script), and one in a
network namespace of its own, with the nodes in two others. The store-level rules (a rank claimed
twice, world sizes that disagree, more nodes than the world size, an unreachable store) are checked
in process against a real store; configuration mistakes through the CLI."""
from __future__ import annotations

import datetime
import json
import os
import random
import shutil
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from launcher import netns
from p2ptrain import cli
from p2ptrain.settings import NodeConfig
from p2ptrain.transport import rendezvous
from p2ptrain.transport.rendezvous import RendezvousError
from tests.conftest import ROOT, node_env

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
QUICK = ["--steps", "40", "--log-every", "10", "--model", "mlp", "--hidden", "64", "--num-train", "2000",
         "--num-test", "500"]


def clean_env(**extra: str) -> dict[str, str]:
    """The node environment without any launcher's variables (the test sets the ones it means)."""
    env = {k: v for k, v in node_env().items()
           if k not in LAUNCHER_VARS and not k.startswith(("SLURM_", "TORCHELASTIC_", "P2PTRAIN_"))}
    return {**env, **extra}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def free_port_between(low: int, high: int) -> int:
    for port in random.sample(range(low, high), 200):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    pytest.skip(f"no free port in {low}..{high}")


def start_store(host: str = "127.0.0.1") -> dist.TCPStore:
    return dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=10))


def settings(store_port: int, **kw) -> NodeConfig:
    kw.setdefault("world_size", 2)
    return NodeConfig(rendezvous=f"127.0.0.1:{store_port}", peer_timeout=kw.pop("timeout", 5.0), **kw).validate()


def summaries(out: Path, nodes: int) -> list[dict]:
    return [json.loads((out / f"node{rank}.json").read_text()) for rank in range(nodes)]


def run_nodes(argvs: list[list[str]], env: dict[str, str], timeout: float) -> list[subprocess.CompletedProcess]:
    procs = [subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for argv in argvs]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def assert_ok(results: list[subprocess.CompletedProcess]) -> None:
    for result in results:
        assert result.returncode == 0, f"{result.args}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"


# --- the store's rules, in process ----------------------------------------------------------------

def test_ranks_assigned_in_arrival_order_and_addresses_exchanged():
    store = start_store()
    port = store.port
    first = rendezvous.assign_rank(settings(port, world_size=2, rank_given=False))
    second = rendezvous.assign_rank(settings(port, world_size=2, rank_given=False))
    assert (first.rank, second.rank) == (0, 1) and first.rank_given and second.rank_given
    with pytest.raises(RendezvousError, match="more than 2 nodes asked for a rank"):
        rendezvous.assign_rank(settings(port, world_size=2, rank_given=False))

    results: dict[int, list[str]] = {}

    def exchange(config: NodeConfig, port: int) -> None:
        results[config.rank] = rendezvous.exchange_addresses(config, port)

    threads = [threading.Thread(target=exchange, args=args) for args in ((first, 7001), (second, 7002))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert results[0] == results[1] == ["127.0.0.1:7001", "127.0.0.1:7002"]  # --listen none, store on loopback
    assert store.get("p2ptrain/p2ptrain/address/1") == b"127.0.0.1:7002"  # keys under p2ptrain/<run id>/


def test_reachability_is_published_and_read_back_signed_with_a_token(tmp_path):
    store = start_store()
    token = tmp_path / "token"
    token.write_text("s3cret-token-of-the-run")
    config = settings(store.port, rank=1, auth_token_file=str(token))
    assert rendezvous.read_reachability(config, 1) is None
    rendezvous.publish_reachability(config, "private")
    assert rendezvous.read_reachability(config, 1) == "private"
    assert store.get("p2ptrain/p2ptrain/reachability/1").startswith(b"p2ptrain-signed-v1 ")
    store.set("p2ptrain/p2ptrain/reachability/1", "public")  # a stranger's unsigned entry is not believed
    assert rendezvous.read_reachability(config, 1) is None


def test_rank_claimed_twice_world_size_mismatch_and_missing_nodes_are_clear_errors():
    store = start_store()
    one = settings(store.port, rank=1, run_id="twice", timeout=1.0)
    with pytest.raises(RendezvousError, match=r"no address from rank\(s\) \[0\] of 2"):
        t0 = time.monotonic()
        rendezvous.exchange_addresses(one, 7001)  # rank 0 never comes: a bounded wait
    assert time.monotonic() - t0 < 5
    with pytest.raises(RendezvousError, match=r"rank 1 claimed twice: 127.0.0.1:7001 has it, so this node "
                                              r"\(127.0.0.1:7009\) cannot"):
        rendezvous.exchange_addresses(one, 7009)
    with pytest.raises(RendezvousError, match="world size mismatch: this node says 3, the run's first node said 2"):
        rendezvous.exchange_addresses(settings(store.port, rank=2, world_size=3, run_id="twice"), 7002)
    # another run id on the same store is another run
    other = settings(store.port, rank=1, run_id="second-run", world_size=3, timeout=0.5)
    with pytest.raises(RendezvousError, match=r"no address from rank\(s\) \[0, 2\] of 3"):
        rendezvous.exchange_addresses(other, 7001)


def test_unreachable_store_fails_after_a_bounded_wait():
    port = free_port()  # nothing listens; rank 1 never hosts the store
    start = time.monotonic()
    with pytest.raises(RendezvousError, match=rf"rendezvous store 127.0.0.1:{port} unreachable after 1s"):
        rendezvous.exchange_addresses(settings(port, rank=1, timeout=1.0), 7001)
    assert time.monotonic() - start < 15


def test_rank_zero_hosts_the_store_at_its_own_address():
    port = free_port()
    config = settings(port, rank=0, world_size=1, run_id="hosted")
    assert rendezvous.exchange_addresses(config, 7005) == ["127.0.0.1:7005"]
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=5))
    assert client.get("p2ptrain/hosted/address/0") == b"127.0.0.1:7005"


def test_advertised_address():
    config = settings(free_port(), rank=0)
    assert rendezvous.advertised_address(config, 5000) == "127.0.0.1:5000"      # the route to a loopback store
    listen = config.replace(listen="127.0.0.7:0")
    assert rendezvous.advertised_address(listen, 5000) == "127.0.0.7:5000"      # a specific --listen host
    assert rendezvous.advertised_address(config.replace(advertise="node7.example"), 5000) == \
        "node7.example:5000"
    assert rendezvous.advertised_address(config.replace(advertise="10.1.2.3:9999"), 5000) == \
        "10.1.2.3:9999"                                                          # NAT / port forward
    assert rendezvous.advertised_address(config.replace(advertise="::1"), 5000) == "[::1]:5000"


def test_a_store_named_by_a_host_name_that_is_loopback_here_is_not_advertised_as_loopback():
    """e.g. /etc/hosts mapping this machine's name to 127.0.x.1: the other hosts reach the store by
    that name at a real address, so this node must publish a real address too."""
    name = socket.gethostname()
    try:
        resolved = socket.getaddrinfo(name, 0, socket.AF_INET)[0][4][0]
    except OSError:
        pytest.skip(f"host name {name!r} does not resolve")
    others = rendezvous.non_loopback_addresses()
    if not resolved.startswith("127.") or not others:
        pytest.skip(f"{name} resolves to {resolved}; non-loopback addresses {others}")
    assert rendezvous.default_advertise_host(name, 29500) == others[0]
    assert rendezvous.default_advertise_host("localhost", 29500) == "127.0.0.1"


# --- configuration mistakes, through the CLI ----------------------------------------------------

@pytest.mark.parametrize("env, argv, message", [
    ({}, ["--world-size", "2"], "no --peers and no rendezvous: set --rendezvous HOST:PORT or run under torchrun"),
    ({"WORLD_SIZE": "3", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}, ["--world-size", "4"],
     "conflicting world sizes: WORLD_SIZE=3 in the environment vs --world-size 4"),
    ({"SLURM_NTASKS": "2", "SLURM_PROCID": "1", "MASTER_ADDR": "h0", "MASTER_PORT": "29511"}, ["--world-size", "3"],
     "conflicting world sizes: SLURM_NTASKS=2 in the environment vs --world-size 3"),
    ({}, ["--rendezvous", "127.0.0.1:29511"], "a rendezvous needs the number of nodes"),
    ({}, ["--rendezvous", "127.0.0.1", "--world-size", "2"], "rendezvous '127.0.0.1' is not HOST:PORT"),
    ({}, ["--rendezvous", "h:1", "--world-size", "2", "--peers", "a:1,b:2"], "give --peers or --rendezvous, not both"),
    ({}, ["--rendezvous", "h:1", "--world-size", "2", "--advertise", "0.0.0.0"], "is a wildcard"),
    ({}, ["--rendezvous", "h:1", "--world-size", "2", "--run-id", "a b"], "must be non-empty, without spaces"),
])
def test_configuration_errors(monkeypatch, capsys, env, argv, message):
    for key in [k for k in os.environ if k in LAUNCHER_VARS or k.startswith(("SLURM_", "TORCHELASTIC_"))]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as exited:
        cli.main(["node", *argv])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "p2ptrain: configuration error: " in err and message in err, err


def test_launcher_environment_becomes_settings():
    torchrun = {"RANK": "2", "WORLD_SIZE": "4", "MASTER_ADDR": "host0", "MASTER_PORT": "29400",
                "TORCHELASTIC_RUN_ID": "job7", "TORCHELASTIC_RESTART_COUNT": "1"}
    config = NodeConfig.from_sources(env=torchrun)
    assert (config.rank, config.world_size, config.rendezvous, config.run_id) == (2, 4, "host0:29400", "job7-restart1")
    assert config.uses_rendezvous and config.rank_given
    slurm = NodeConfig.from_sources(env={"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                                         "MASTER_ADDR": "n01", "MASTER_PORT": "20042"})
    assert (slurm.rank, slurm.world_size, slurm.rendezvous, slurm.run_id) == (3, 8, "n01:20042", "p2ptrain")
    groups = NodeConfig.from_sources(env={"GROUP_RANK": "1", "LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "2",
                                          "WORLD_SIZE": "8", "MASTER_ADDR": "::1", "MASTER_PORT": "1"})
    assert (groups.rank, groups.rendezvous) == (6, "[::1]:1")
    store_ranks = NodeConfig.from_sources(env={}, flags={"rendezvous": "h:1", "world_size": 3})
    assert not store_ranks.rank_given and store_ranks.rank == 0
    static = NodeConfig.from_sources(env=torchrun, flags={"peers": "a:1,b:1,c:1,d:1"})  # a peer list wins
    assert static.rendezvous is None and not static.uses_rendezvous and static.peers[2] == "c:1"
    assert "rank_given" not in config.to_dict() and config.to_dict()["rendezvous"] == "host0:29400"


# --- real node processes --------------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_nodes_meet_through_an_explicit_store_that_assigns_ranks(tmp_path):
    store = start_store()
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "p2ptrain", "node", "--rendezvous", f"127.0.0.1:{store.port}", "--world-size", "3",
            "--run-id", "explicit", "--out", str(out), "--peer-timeout", "60", *QUICK]
    assert_ok(run_nodes([argv] * 3, clean_env(), timeout=100))
    nodes = summaries(out, 3)
    assert [n["rank"] for n in nodes] == [0, 1, 2]
    addresses = [store.get(f"p2ptrain/explicit/address/{r}").decode() for r in range(3)]
    assert len(set(addresses)) == 3 and all(a.startswith("127.0.0.1:") for a in addresses), addresses
    assert store.add("p2ptrain/explicit/next_rank", 0) == 3
    # each asked a peer to dial it back at that address, and said so in the store
    assert [store.get(f"p2ptrain/explicit/reachability/{r}") for r in range(3)] == [b"public"] * 3
    assert min(n["test_accuracy"] for n in nodes) > 0.2, nodes  # chance is 0.1


@pytest.mark.timeout(120)
def test_unranked_nodes_host_the_store_themselves(tmp_path):
    """No store runs at the address, which is this machine's: the first node to bind it hosts it."""
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "p2ptrain", "node", "--rendezvous", f"127.0.0.1:{free_port()}", "--world-size",
            "2", "--out", str(out), "--peer-timeout", "60", *QUICK]
    results = run_nodes([argv] * 2, clean_env(), timeout=100)
    assert_ok(results)
    assert sum("this node: hosting the rendezvous store" in r.stderr for r in results) == 1
    assert [n["rank"] for n in summaries(out, 2)] == [0, 1]


@pytest.mark.timeout(120)
def test_unreachable_store_is_one_line_and_exit_1(tmp_path):
    port = free_port()
    start = time.monotonic()
    [result] = run_nodes([[sys.executable, "-m", "p2ptrain", "node", "--rendezvous", f"127.0.0.1:{port}",
                           "--rank", "1", "--world-size", "2", "--peer-timeout", "2", "--out", str(tmp_path)]],
                         clean_env(), timeout=60)
    assert result.returncode == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"p2ptrain node: rendezvous store 127.0.0.1:{port} unreachable after 2s"), result.stderr
    assert "Traceback" not in result.stderr and time.monotonic() - start < 40


def torchrun() -> list[str]:
    beside = Path(sys.executable).with_name("torchrun")
    return [str(beside)] if beside.exists() else [sys.executable, "-m", "torch.distributed.run"]


@pytest.mark.timeout(150)
def test_torchrun_standalone_without_a_peer_list(tmp_path):
    out = tmp_path / "run"
    [result] = run_nodes([[*torchrun(), "--standalone", "--nproc-per-node", "3", "-m", "p2ptrain", "node",
                           "--out", str(out), *QUICK]], clean_env(), timeout=140)
    assert_ok([result])
    nodes = summaries(out, 3)
    accuracy = [n["test_accuracy"] for n in nodes]
    print(f"torchrun --standalone, 3 nodes, 40 steps: test accuracy {accuracy}")
    assert min(accuracy) > 0.3, accuracy  # chance is 0.1
    assert "hosting the rendezvous store" not in result.stderr  # torchrun's agent store is the store


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_torchrun_c10d_endpoint(tmp_path):
    out = tmp_path / "run"
    [result] = run_nodes([[*torchrun(), "--nnodes=1", "--nproc-per-node=3", "--rdzv-backend=c10d",
                           f"--rdzv-endpoint=127.0.0.1:{free_port()}", "-m", "p2ptrain", "node", "--out", str(out),
                           *QUICK]], clean_env(), timeout=140)
    assert_ok([result])
    assert min(n["test_accuracy"] for n in summaries(out, 3)) > 0.3


@pytest.mark.timeout(150)
def test_slurm_script_with_the_slurm_environment(tmp_path):
    """examples/slurm/train.sbatch under stand-ins for scontrol and srun (srun starts one process
    per task with SLURM_PROCID / SLURM_LOCALID set, as Slurm does): task 0 hosts the store at the
    'first host' and the nodes train."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\n[ \"$1 $2\" = 'show hostnames' ] && printf 'localhost\\nnode2\\n'\n")
    (bin_dir / "srun").write_text("""#!/usr/bin/env bash
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((i = 0; i < SLURM_NTASKS; i++)); do SLURM_PROCID=$i SLURM_LOCALID=$i "$@" & pids+=($!); done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
""")
    for tool in bin_dir.iterdir():
        tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    port = free_port_between(20000, 40000)  # the script's MASTER_PORT: 20000 + job id % 20000
    out = tmp_path / "run"
    env = clean_env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", SLURM_JOB_ID=str(port - 20000),
                    SLURM_JOB_NODELIST="localhost,node2", SLURM_NTASKS="2", SLURM_CPUS_PER_TASK="1",
                    P2PTRAIN=f"{sys.executable} -m p2ptrain", OUT=str(out))
    [result] = run_nodes([["bash", str(ROOT / "examples" / "slurm" / "train.sbatch"), *QUICK]], env, timeout=140)
    assert_ok([result])
    assert f"rendezvous at localhost:{port}" in result.stderr
    assert "node 0: hosting the rendezvous store" in result.stderr and "run 'slurm-" in result.stderr
    assert [n["rank"] for n in summaries(out, 2)] == [0, 1]


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed (apt-get install shellcheck)")
def test_slurm_script_passes_shellcheck():
    result = subprocess.run(["shellcheck", str(ROOT / "examples" / "slurm" / "train.sbatch")], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout


# --- two hosts and a store, each in its own network namespace -------------------------------------

_unavailable = netns.probe()


@pytest.mark.skipif(_unavailable is not None, reason=f"network namespaces unavailable: {_unavailable}")
@pytest.mark.timeout(150)
def test_nodes_in_two_namespaces_meet_through_a_store_in_a_third(tmp_path):
    """The nodes publish their namespace addresses (the interface towards the store), never
    loopback; ranks come from the store."""
    out = tmp_path / "run"
    with netns.NetnsCluster(3) as cluster:
        store_host = cluster.nodes[2].address
        port = 29533
        store_proc = subprocess.Popen(
            [*cluster.exec_prefix(2), sys.executable, "-c",
             "import datetime, sys, time, torch.distributed as dist\n"
             f"s = dist.TCPStore({store_host!r}, {port}, is_master=True, wait_for_workers=False)\n"
             "print('up', flush=True); time.sleep(120)"], cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE, text=True)
        try:
            assert store_proc.stdout.readline().strip() == "up"
            argv = ["-m", "p2ptrain", "node", "--rendezvous", f"{store_host}:{port}", "--world-size", "2",
                    "--run-id", "netns", "--out", str(out), "--peer-timeout", "60", *QUICK]
            assert_ok(run_nodes([[*cluster.exec_prefix(r), sys.executable, *argv] for r in (0, 1)], clean_env(),
                                timeout=120))
            client = dist.TCPStore(store_host, port, is_master=False, timeout=datetime.timedelta(seconds=10))
            published = sorted(client.get(f"p2ptrain/netns/address/{r}").decode().rpartition(":")[0] for r in (0, 1))
        finally:
            store_proc.kill()
            store_proc.wait()
        assert published == sorted(n.address for n in cluster.nodes[:2]), published
        assert [n["rank"] for n in summaries(out, 2)] == [0, 1]
