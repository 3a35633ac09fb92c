"""Tests for the local cluster launcher, run against a fake node program.

The fake node honours the run-folder contract of `p2ptrain node` (progress lines, snapshots,
summary, done/error events) with known values, so the report can be checked exactly and
failures, timeouts and interrupts can be staged without the real node.
"""
from __future__ import annotations

import contextlib
import io
import json
import math
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import launcher
from launcher import local, report
from launcher.local import ClusterError, ProgressTail, node_argv, run_local_cluster
from launcher.ports import free_ports
from tests.conftest import ROOT, node_env, read_launch_header

STEPS = 10

FAKE_NODE = textwrap.dedent(r'''
    """Fake p2ptrain node: same argv and run-folder files as the real one, known values."""
    import argparse, faulthandler, json, os, signal, subprocess, sys, time
    from pathlib import Path

    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--peers", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--metrics-port", type=int)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--step-sleep", type=float, default=0.01)
    p.add_argument("--fail-step", type=int)          # exit with --fail-code before this step
    p.add_argument("--fail-code", type=int, default=3)
    p.add_argument("--error-step", type=int)         # write an error event, then hang
    p.add_argument("--hang", action="store_true")    # never finish
    p.add_argument("--ignore-term", action="store_true")
    p.add_argument("--grandchild", action="store_true")  # fork a helper process
    p.add_argument("--snapshots", action="store_true")   # write snapshots (costs a torch import)
    args, _ = p.parse_known_args()
    rank, out = args.rank, Path(args.out)

    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # as `p2ptrain node` does
    if args.grandchild:
        helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        (out / f"node{rank}.grandchild.pid").write_text(str(helper.pid))
    assert len(args.peers.split(",")) == args.world_size
    print(f"fake node {rank}/{args.world_size} peers={args.peers} metrics={args.metrics_port}", flush=True)

    progress = open(out / f"node{rank}.progress.jsonl", "a")
    def emit(record):
        progress.write(json.dumps(record) + "\n")
        progress.flush()

    def loss(step):
        return 2.0 / (1 + step) + 0.1 * rank

    for step in range(1, args.steps + 1):
        time.sleep(args.step_sleep)
        if step == args.fail_step:
            print("simulated crash", file=sys.stderr, flush=True)
            sys.exit(args.fail_code)
        if step == args.error_step:
            emit({"rank": rank, "event": "error", "message": "simulated divergence"})
            while True:
                time.sleep(1)
        emit({"rank": rank, "step": step, "time": time.time(), "loss": loss(step),
              "bytes_sent": 1000 * step * (rank + 1), "bytes_received": 900 * step * (rank + 1),
              "ps_weight": 1.0 - 0.01 * rank, "step_seconds": args.step_sleep})
    while args.hang:
        time.sleep(1)

    if args.snapshots:
        import torch
        snap_steps = list(range(0, args.steps + 1, 5))
        center = torch.tensor([1.0, 2.0, 3.0, 4.0])
        # Model of rank r at the k-th snapshot: center + (r - 1) * 0.5**k * ones (exact in float32).
        params = torch.stack([center + (rank - 1) * 0.5 ** k * torch.ones(4) for k in range(len(snap_steps))])
        torch.save({"steps": snap_steps, "params": params}, out / f"node{rank}.snapshots.pt")
    (out / f"node{rank}.json").write_text(json.dumps({
        "rank": rank, "steps": args.steps, "final_loss": loss(args.steps),
        "test_accuracy": 0.8 + 0.01 * rank, "test_loss": 0.5, "bytes_sent": 1000 * args.steps * (rank + 1),
        "bytes_received": 900 * args.steps * (rank + 1), "mean_step_seconds": args.step_sleep,
        "ps_weight": 1.0 - 0.01 * rank, "wall_seconds": 1.0, "device": "cpu"}))
    emit({"rank": rank, "event": "done"})
''')


@pytest.fixture
def fake_node(tmp_path: Path) -> Path:
    script = tmp_path / "fake_node.py"
    script.write_text(FAKE_NODE)
    return script


def fake_factory(script: Path, per_rank: dict[int, list[str]] | None = None):
    """argv_factory running the fake script with the real node arguments (+ per-rank behaviour)."""
    def factory(rank, world_size, peers, metrics_port, out_dir, extra_args):
        argv = node_argv(rank, world_size, peers, metrics_port, out_dir, extra_args)
        assert argv[:4] == [sys.executable, "-m", "p2ptrain", "node"]
        return [sys.executable, str(script), *argv[4:], *(per_rank or {}).get(rank, [])]
    return factory


@pytest.fixture
def spawned_pids(monkeypatch) -> list[int]:
    """Records the pid of every process the launcher starts."""
    pids: list[int] = []
    real_popen = subprocess.Popen

    def recording_popen(*args, **kwargs):
        proc = real_popen(*args, **kwargs)
        pids.append(proc.pid)
        return proc

    monkeypatch.setattr(local.subprocess, "Popen", recording_popen)
    return pids


def alive(pid: int) -> bool:
    """True if the process exists and is not a zombie (reaped or not, a zombie runs nothing)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def grandchild_pids(out: Path) -> list[int]:
    return [int(p.read_text()) for p in out.glob("node*.grandchild.pid")]


def assert_nothing_survives(pids: list[int]) -> None:
    """SIGKILL is delivered asynchronously, so give killed processes a moment to vanish; the
    fake helpers sleep for minutes, so anything not signalled would still be caught."""
    assert pids, "no process was recorded"
    deadline = time.monotonic() + 3.0
    while (survivors := [pid for pid in pids if alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not survivors, f"processes left behind: {survivors}"


def wait_for(predicate, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


# --- successful run ------------------------------------------------------------------------------

def test_cluster_report_matches_fake_nodes(tmp_path, fake_node, spawned_pids):
    out = tmp_path / "run"
    stream = io.StringIO()
    config = {"algorithm": "sgp", "steps": STEPS}
    # rank 0 exits normally but leaves a helper process running: the launcher must reap it too
    result = run_local_cluster(3, out, ["--steps", str(STEPS), "--snapshots"], config=config,
                               argv_factory=fake_factory(fake_node, {0: ["--grandchild"]}), stream=stream, timeout=60)

    assert result["config"] == config
    assert result["warnings"] == []
    assert [n["rank"] for n in result["nodes"]] == [0, 1, 2]
    for rank, node in enumerate(result["nodes"]):
        assert node["final_loss"] == pytest.approx(2.0 / (1 + STEPS) + 0.1 * rank)
        assert node["test_accuracy"] == pytest.approx(0.8 + 0.01 * rank)
        assert node["bytes_sent"] == 1000 * STEPS * (rank + 1)

    cluster = result["cluster"]
    assert cluster["nodes"] == 3
    assert cluster["wall_seconds"] > 0
    assert cluster["mean_test_accuracy"] == pytest.approx(0.81)
    assert cluster["min_test_accuracy"] == pytest.approx(0.80)
    assert cluster["mean_final_loss"] == pytest.approx(2.0 / (1 + STEPS) + 0.1)
    assert cluster["total_bytes_sent"] == 1000 * STEPS * (1 + 2 + 3)
    assert cluster["mean_step_seconds"] == pytest.approx(0.01)

    # By hand: deviations from the mean are -a*1, 0, +a*1 (1 = ones(4), ||1|| = 2) with
    # a = 0.5**k, so the distance is sqrt((a^2*4 + 0 + a^2*4) / 3) = 2a*sqrt(2/3); zbar = (1, 2, 3, 4).
    expected = [2 * 0.5 ** k * math.sqrt(2 / 3) for k in range(3)]
    assert result["history"]["steps"] == [0, 5, 10]
    assert result["history"]["consensus_distance"] == pytest.approx(expected, rel=1e-9)
    assert cluster["consensus_step"] == 10
    assert cluster["consensus_distance"] == pytest.approx(expected[-1], rel=1e-9)
    assert cluster["relative_consensus_distance"] == pytest.approx(expected[-1] / math.sqrt(30), rel=1e-9)
    assert result["history"]["loss"]["2"] == [[s, pytest.approx(2.0 / (1 + s) + 0.2)] for s in range(1, STEPS + 1)]

    on_disk = json.loads((out / "report.json").read_text())
    assert on_disk["cluster"]["consensus_distance"] == pytest.approx(expected[-1])
    png = (out / "plot.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1024
    assert all((out / "logs" / f"node{r}.log").read_text().startswith(f"fake node {r}/3") for r in range(3))

    text = stream.getvalue()
    assert f"report: {out / 'report.json'}" in text and f"plot:   {out / 'plot.png'}" in text
    assert len(grandchild_pids(out)) == 1
    assert_nothing_survives(spawned_pids + grandchild_pids(out))


def test_node_argv_contract(tmp_path):
    argv = node_argv(1, 2, ["127.0.0.1:1", "127.0.0.1:2"], 9100, tmp_path, ["--steps", "5"], python="py")
    assert argv == ["py", "-m", "p2ptrain", "node", "--rank", "1", "--world-size", "2",
                    "--peers", "127.0.0.1:1,127.0.0.1:2", "--out", str(tmp_path),
                    "--metrics-port", "9100", "--steps", "5"]
    assert "--metrics-port" not in node_argv(0, 1, ["h:1"], None, tmp_path, [])


def test_steps_from_args():
    assert local.steps_from_args(["--lr", "0.1", "--steps", "200"]) == 200
    assert local.steps_from_args(["--steps=50"]) == 50
    assert local.steps_from_args(["--steps"]) is None and local.steps_from_args([]) is None


def test_plan_cluster_ports_and_env(tmp_path):
    specs = local.plan_cluster(3, tmp_path, ["--steps", "4"])
    ports = [int(s.argv[s.argv.index("--metrics-port") + 1]) for s in specs]
    peers = specs[0].argv[specs[0].argv.index("--peers") + 1].split(",")
    assert all(s.argv[s.argv.index("--peers") + 1] == ",".join(peers) for s in specs)
    assert len(set(ports) | {int(p.rsplit(":", 1)[1]) for p in peers}) == 6
    assert all(s.env["OMP_NUM_THREADS"] == "1" and s.env["PYTHONUNBUFFERED"] == "1" for s in specs)
    assert all("--metrics-port" not in s.argv for s in local.plan_cluster(2, tmp_path, [], metrics=False))


# --- progress display ----------------------------------------------------------------------------

def test_non_tty_progress_is_compact_lines_and_final_table(tmp_path, fake_node, monkeypatch):
    monkeypatch.setattr(local, "LOG_EVERY_SECONDS", 0.2)
    stream = io.StringIO()
    run_local_cluster(2, tmp_path / "run", ["--steps", str(STEPS), "--step-sleep", "0.1"],
                      argv_factory=fake_factory(fake_node), stream=stream, timeout=60)
    text = stream.getvalue()
    assert "\x1b[" not in text
    ticks = [line for line in text.splitlines() if line.startswith("[")]
    # one aggregated line per tick for the whole cluster (issue 12), never a line per node, never "- MB"
    assert ticks and all("node " not in line and "- MB" not in line for line in ticks), text
    assert any(f"/{STEPS}," in line and "steps/s" in line and "2 running" in line for line in ticks), text
    assert f"{STEPS}/{STEPS}" in text and "done" in text


def test_tty_progress_redraws_in_place(tmp_path, fake_node):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    stream = Terminal()
    run_local_cluster(2, tmp_path / "run", ["--steps", str(STEPS), "--step-sleep", "0.1"],
                      argv_factory=fake_factory(fake_node), stream=stream, timeout=60)
    text = stream.getvalue()
    assert "\x1b[4F" in text  # cursor back over the 4-line table (title, header, 2 nodes)
    assert f"{STEPS}/{STEPS}" in text


def test_progress_tail_tolerates_partial_lines(tmp_path):
    path = tmp_path / "node0.progress.jsonl"
    tail = ProgressTail(path)
    assert tail.poll() == []  # file not there yet
    path.write_text('{"step": 1}\n{"step"')
    assert tail.poll() == [{"step": 1}]
    with open(path, "a") as f:
        f.write(': 2}\nnot json\n{"event": "done"}')
    assert tail.poll() == [{"step": 2}]
    assert tail.poll(final=True) == [{"event": "done"}]


# --- failures ------------------------------------------------------------------------------------

def test_failing_node_stops_cluster(tmp_path, fake_node, spawned_pids):
    out = tmp_path / "run"
    behaviour = {0: ["--hang", "--grandchild"], 1: ["--fail-step", "5", "--fail-code", "3", "--step-sleep", "0.1"],
                 2: ["--hang"]}
    started = time.monotonic()
    with pytest.raises(ClusterError) as info:
        run_local_cluster(3, out, ["--steps", str(STEPS)], argv_factory=fake_factory(fake_node, behaviour),
                          stream=io.StringIO(), timeout=60)
    assert time.monotonic() - started < 15
    err = info.value
    assert (err.rank, err.returncode) == (1, 3)
    assert "node 1 failed: exited with code 3" in str(err)
    assert "simulated crash" in str(err)  # log tail is quoted
    report = json.loads((out / "report.json").read_text())  # written even for a failed run (issue 10)
    assert report["cluster"]["failed"] and [n["rank"] for n in report["cluster"]["failed_nodes"]] == [1]
    assert [n["outcome"] for n in report["nodes"]] == ["stopped", "failed", "stopped"]
    assert len(grandchild_pids(out)) == 1
    assert_nothing_survives(spawned_pids + grandchild_pids(out))


def test_error_event_stops_cluster_even_if_node_keeps_running(tmp_path, fake_node, spawned_pids, monkeypatch):
    monkeypatch.setattr(local, "ERROR_EXIT_GRACE_SECONDS", 0.2)
    with pytest.raises(ClusterError) as info:
        run_local_cluster(2, tmp_path / "run", ["--steps", str(STEPS)],
                          argv_factory=fake_factory(fake_node, {0: ["--hang"], 1: ["--error-step", "3"]}),
                          stream=io.StringIO(), timeout=60)
    assert info.value.rank == 1
    assert "error event: simulated divergence" in str(info.value)
    assert_nothing_survives(spawned_pids)


def test_sigterm_ignoring_node_is_killed_after_dumping_its_stacks(tmp_path, fake_node, spawned_pids, monkeypatch,
                                                                   capsys):
    """A node hung past the SIGTERM grace gets SIGUSR1 first: its thread stacks land in its log
    (where it hangs), then SIGKILL."""
    monkeypatch.setattr(local, "TERM_GRACE_SECONDS", 0.5)
    behaviour = {0: ["--hang", "--ignore-term"], 1: ["--fail-step", "3", "--step-sleep", "0.1"]}
    with pytest.raises(ClusterError, match="node 1 failed"):
        run_local_cluster(2, tmp_path / "run", ["--steps", str(STEPS)],
                          argv_factory=fake_factory(fake_node, behaviour), stream=io.StringIO(), timeout=60)
    assert_nothing_survives(spawned_pids)
    assert "1 node(s) ignored SIGTERM" in capsys.readouterr().err
    log = (tmp_path / "run" / "logs" / "node0.log").read_text()
    assert "(most recent call first)" in log and "fake_node.py" in log


def test_timeout_is_enforced(tmp_path, fake_node, spawned_pids):
    out = tmp_path / "run"
    started = time.monotonic()
    with pytest.raises(ClusterError, match=r"timed out after 1\.5 s; still running: ranks 0, 1") as info:
        run_local_cluster(2, out, ["--steps", str(STEPS)], timeout=1.5, stream=io.StringIO(),
                          argv_factory=fake_factory(fake_node, {0: ["--hang", "--grandchild"], 1: ["--hang"]}))
    assert 1.5 <= time.monotonic() - started < 1.5 + local.TERM_GRACE_SECONDS
    assert info.value.rank is None
    assert_nothing_survives(spawned_pids + grandchild_pids(out))


def test_keyboard_interrupt_cleans_up_and_propagates(tmp_path, fake_node, spawned_pids, signum=signal.SIGINT):
    out = tmp_path / "run"
    factory = fake_factory(fake_node, {0: ["--hang", "--grandchild"], 1: ["--hang"]})
    interrupter = threading.Thread(target=lambda: (
        wait_for(lambda: len(grandchild_pids(out)) == 1), os.kill(os.getpid(), signum)))
    interrupter.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            run_local_cluster(2, out, ["--steps", str(STEPS)], argv_factory=factory, stream=io.StringIO(), timeout=30)
    finally:
        interrupter.join()
    assert_nothing_survives(spawned_pids + grandchild_pids(out))


def test_sigterm_to_the_launcher_stops_every_node_before_it_goes(tmp_path, fake_node, spawned_pids):
    """`timeout`, `kill` or a scheduler stop the launcher with SIGTERM: its nodes (in sessions of
    their own) must not outlive it, and the default disposition is back afterwards."""
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    test_keyboard_interrupt_cleans_up_and_propagates(tmp_path, fake_node, spawned_pids, signum=signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_keyboard_interrupt_cleans_up_when_the_launcher_inherited_sigint_ignored(tmp_path, fake_node, spawned_pids):
    """A non-interactive shell starts `make test &` with SIGINT ignored, and Python keeps that: the
    launch still stops on SIGINT, cleans up and propagates KeyboardInterrupt, and the inherited
    disposition is back afterwards."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        test_keyboard_interrupt_cleans_up_and_propagates(tmp_path, fake_node, spawned_pids)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_sigint_interrupts_only_replaces_an_ignored_sigint_on_the_main_thread():
    from launcher.interrupts import sigint_interrupts

    def own_handler(signum, frame):
        pass

    previous = signal.getsignal(signal.SIGINT)
    try:
        for before, inside in [(signal.SIG_IGN, signal.default_int_handler), (own_handler, own_handler),
                               (signal.default_int_handler, signal.default_int_handler)]:
            signal.signal(signal.SIGINT, before)
            with sigint_interrupts():
                assert signal.getsignal(signal.SIGINT) is inside
            assert signal.getsignal(signal.SIGINT) is before
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        seen = []

        def off_main_thread():
            with sigint_interrupts():  # setting a handler here would raise ValueError
                seen.append(signal.getsignal(signal.SIGINT))

        thread = threading.Thread(target=off_main_thread)
        thread.start()
        thread.join()
        assert seen == [signal.SIG_IGN]
    finally:
        signal.signal(signal.SIGINT, previous)


def test_launch_started_with_sigint_ignored_stops_on_sigint(tmp_path):
    """`p2ptrain launch` as a background job of a non-interactive shell (SIGINT ignored from birth):
    SIGINT stops it with 130 and no node process is left."""
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "p2ptrain", "launch", "--nodes", "2", "--steps", "100000",
                             "--model", "mlp", "--no-live", "--no-metrics", "--out", str(out)],
                            cwd=Path(__file__).resolve().parent.parent, env=local.node_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    nodes: list[int] = []
    try:
        read_launch_header(proc, 2)
        wait_for(lambda: len(list(out.glob("node*.progress.jsonl"))) == 2, seconds=60)
        nodes += [int(pid) for pid in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                                      text=True).stdout.split()]
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:  # the launcher ignored SIGINT: take it and its nodes down
            proc.kill()
            proc.wait()
            for pid in nodes:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 130
    assert_nothing_survives(nodes)


# --- ports ---------------------------------------------------------------------------------------

def test_free_ports_are_distinct_and_bindable():
    ports = free_ports(32)
    assert len(ports) == len(set(ports)) == 32
    assert all(0 < p < 65536 for p in ports)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[0]))
    assert free_ports(0) == []


def test_free_ports_stay_out_of_the_kernels_ephemeral_range_and_skip_excluded_and_taken_ports():
    """Outgoing connections and binds to port 0 draw from the ephemeral range: a port picked there
    could be taken by any of them before the node binds it (a real CI failure: Prometheus, started
    on such a port, took a node's /metrics port)."""
    from launcher.ports import LOWEST_PORT, ephemeral_range
    low, high = ephemeral_range()
    assert 0 < low <= high < 65536
    ports = free_ports(64)
    assert all(LOWEST_PORT <= p < low for p in ports), (ports, low)
    with socket.socket() as held:
        held.bind(("127.0.0.1", ports[0]))
        again = free_ports(200, exclude=ports[1:10])
        assert ports[0] not in again and not set(ports[1:10]) & set(again)


# --- report --------------------------------------------------------------------------------------

def test_consensus_distance():
    assert report.consensus_distance(torch.ones(4, 3)) == 0.0
    # mean (1, 0); both rows are 1 away -> sqrt((1 + 1) / 2) = 1
    assert report.consensus_distance(torch.tensor([[0.0, 0.0], [2.0, 0.0]])) == pytest.approx(1.0)
    z = torch.randn(5, 7, generator=torch.Generator().manual_seed(0))
    by_hand = math.sqrt(sum(float(((z[i] - z.mean(0)) ** 2).sum()) for i in range(5)) / 5)
    assert report.consensus_distance(z) == pytest.approx(by_hand, rel=1e-6)
    with pytest.raises(ValueError):
        report.consensus_distance(torch.ones(3))


def test_report_without_snapshots_warns_instead_of_crashing(tmp_path):
    (tmp_path / "node0.json").write_text(json.dumps({"rank": 0, "final_loss": 1.0, "test_accuracy": 0.5}))
    (tmp_path / "node0.progress.jsonl").write_text(
        '{"rank": 0, "step": 1, "loss": 1.0}\n{"rank": 0, "event": "done"}\n')
    result = report.build_report(tmp_path, 2, None, 3.0)
    assert result["cluster"]["consensus_distance"] is None
    assert result["cluster"]["relative_consensus_distance"] is None
    assert result["history"]["steps"] == [] and result["history"]["consensus_distance"] == []
    assert result["cluster"]["mean_test_accuracy"] == 0.5
    assert any("node0.snapshots.pt missing" in w for w in result["warnings"])
    assert any("node1.json missing" in w for w in result["warnings"])
    assert any("node 1: no 'done' event" in w for w in result["warnings"])
    report.write_report(result, tmp_path)
    assert report.plot(result, tmp_path).read_bytes()[:4] == b"\x89PNG"


def test_consensus_uses_shared_snapshot_steps_and_survives_corrupt_files(tmp_path):
    torch.save({"steps": [0, 5, 10], "params": torch.tensor([[0.0], [1.0], [2.0]])}, tmp_path / "node0.snapshots.pt")
    torch.save({"steps": [5, 10], "params": torch.tensor([[3.0], [2.0]])}, tmp_path / "node1.snapshots.pt")
    result = report.build_report(tmp_path, 2, None, 1.0)
    assert result["history"]["steps"] == [5, 10]
    assert result["history"]["consensus_distance"] == [1.0, 0.0]  # rows (1, 3) then (2, 2)
    assert result["cluster"]["relative_consensus_distance"] == 0.0

    (tmp_path / "node1.snapshots.pt").write_bytes(b"not a torch file")
    result = report.build_report(tmp_path, 2, None, 1.0)
    assert result["cluster"]["consensus_distance"] is None
    assert any("cannot read node1.snapshots.pt" in w for w in result["warnings"])


def test_write_report_turns_non_finite_numbers_into_null(tmp_path):
    data = {"cluster": {"mean_final_loss": float("nan"), "x": float("inf")},
            "history": {"loss": {"0": [[1, float("nan")], [2, 0.5]]}}, "ok": torch.tensor(1.5)}
    path = report.write_report(data, tmp_path)

    def reject(token):
        raise AssertionError(f"non-standard JSON token {token}")
    on_disk = json.loads(path.read_text(), parse_constant=reject)
    assert on_disk["cluster"] == {"mean_final_loss": None, "x": None}
    assert on_disk["history"]["loss"]["0"] == [[1, None], [2, 0.5]]
    assert on_disk["ok"] == 1.5
    assert "cluster.mean_final_loss" in on_disk["notes"][0] and "history.loss.0[0][1]" in on_disk["notes"][0]
    assert math.isnan(data["cluster"]["mean_final_loss"])  # the caller's dict is not modified


def test_package_exports():
    assert launcher.run_local_cluster is run_local_cluster


def test_a_real_node_writes_its_thread_stacks_on_sigusr1_and_keeps_going(tmp_path):
    """`kill -USR1` on a `p2ptrain node` (here waiting for a peer that never comes) writes every
    thread's stack to its stderr, the node's log, and does not stop it."""
    port, absent = free_ports(2)
    node = subprocess.Popen([sys.executable, "-m", "p2ptrain", "node", "--rank", "0", "--world-size", "2",
                             "--peers", f"127.0.0.1:{port},127.0.0.1:{absent}", "--listen", f"127.0.0.1:{port}",
                             "--out", str(tmp_path), "--steps", "5", "--model", "mlp", "--dataset", "synthetic",
                             "--peer-timeout", "60"],
                            cwd=ROOT, env=node_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        time.sleep(8)  # (torch imported, waiting for node 1)
        assert node.poll() is None
        node.send_signal(signal.SIGUSR1)
        time.sleep(1)
        assert node.poll() is None, "SIGUSR1 stopped the node"
    finally:
        node.kill()
        _, err = node.communicate(timeout=30)
    assert "(most recent call first)" in err and "p2ptrain" in err


def test_the_live_table_shows_reach_only_where_a_node_is_private_or_reached_otherwise():
    """Progress lines carry `reach` (Node.reach); the table gets a reach column once a node is not
    plain public, and keeps it out of an all-public, all-direct run."""
    states = [local.NodeState(rank) for rank in range(3)]
    for state, reach in zip(states, ("public", "public", "public")):
        state.apply({"step": 10, "time": 1.0, "loss": 0.5, "reach": reach})
    out = io.StringIO()
    local.ProgressView(out, live=False, total_steps=20).finish(states, 1.0)
    assert "reach" not in out.getvalue() and "status" in out.getvalue()
    states[0].apply({"step": 20, "time": 2.0, "reach": "public 1r"})
    states[2].apply({"step": 20, "time": 2.0, "reach": "private 1v"})
    out = io.StringIO()
    local.ProgressView(out, live=False, total_steps=20).finish(states, 2.0)
    header, *rows = out.getvalue().splitlines()[1:]
    assert header.split()[-2:] == ["reach", "status"]
    assert "public 1r" in rows[0] and rows[1].split()[-2] == "public" and "private 1v" in rows[2]
