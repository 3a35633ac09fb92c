"""Pre-flight errors (issue 12): mistakes a user makes on the command line fail before any node is
spawned, in one `configuration error:` line, quickly (no 40-line traceback after ~15 s)."""
from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, node_env


def p2ptrain(*args: str, env: dict | None = None, timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "p2ptrain", *args], cwd=ROOT, env={**node_env(), **(env or {})},
                          capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - started


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("p2ptrain: configuration error: "), proc.stderr
    return lines[0]


def test_a_taken_port_is_one_line_at_once(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc, seconds = p2ptrain("node", "--rank", "0", "--world-size", "2", "--out", str(tmp_path),
                                 "--peers", f"127.0.0.1:{port},127.0.0.1:1")
    line = one_error_line(proc)
    assert f"127.0.0.1:{port}" in line and "in use" in line
    assert seconds < 10  # before torch is imported or data is loaded (0.2 s here when idle)


def test_a_restarted_node_whose_metrics_port_was_taken_serves_them_on_a_free_port(capsys):
    """A first start with a taken metrics port is a configuration error; a restart (P2PTRAIN_REJOIN,
    as the launcher restarts a killed node) gets a warning and a free port: seen in a chaos run,
    where another process took the killed node's port as an ephemeral one before its restart."""
    from launcher.ports import free_ports
    from p2ptrain.cli.node import check_ports
    from p2ptrain.settings import ConfigError, NodeConfig

    peers = [f"127.0.0.1:{p}" for p in free_ports(2)]
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        first = NodeConfig(rank=0, world_size=2, peers=peers, metrics_port=port)
        with pytest.raises(ConfigError, match=f"cannot serve metrics on 0.0.0.0:{port}"):
            check_ports(first)
        restarted = check_ports(first.replace(rejoin=True))
    assert restarted.metrics_port == 0 and restarted.rank == 0
    assert f"cannot serve metrics on 0.0.0.0:{port}" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--dataset", "mnist", "--data-dir", "/nonexistent/mnist"], "data_dir '/nonexistent/mnist' is not a folder"),
    (["--dataset", "mnist"], "--dataset mnist needs --data-dir"),
])
def test_launch_stops_before_spawning(tmp_path, args, message):
    out = tmp_path / "run"
    proc, _ = p2ptrain("launch", "--nodes", "3", "--out", str(out), "--no-live", *args)
    assert message in one_error_line(proc)
    assert not out.exists()  # no node was started, no folder made


def test_world_sizes_from_toml_environment_and_flags_must_agree(tmp_path):
    toml = tmp_path / "node.toml"
    toml.write_text("[node]\nworld_size = 4\n")
    proc, _ = p2ptrain("launch", "--config", str(toml), "--nodes", "3", "--out", str(tmp_path / "run"))
    assert f"conflicting world sizes: world_size = 4 in {toml} vs --nodes 3" in one_error_line(proc)
    proc, _ = p2ptrain("launch", "--nodes", "3", "--out", str(tmp_path / "run"), env={"WORLD_SIZE": "8"})
    assert "conflicting world sizes: WORLD_SIZE=8 in the environment vs --nodes 3" in one_error_line(proc)


def test_an_unknown_toml_key_suggests_the_closest_name(tmp_path):
    toml = tmp_path / "node.toml"
    toml.write_text("[node]\nbatchsize = 64\noverlapp = 1\n")
    proc, _ = p2ptrain("launch", "--config", str(toml), "--nodes", "2", "--out", str(tmp_path / "run"))
    line = one_error_line(proc)
    assert "'batchsize' -> 'batch_size'" in line and "'overlapp' -> 'overlap'" in line
