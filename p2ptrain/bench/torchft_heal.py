"""torchft 0.2.0 healing on p2ptrain's task: the baseline of issue 27 (needs `pip install torchft==0.2.0`).

Why: p2ptrain's heal (a SIGKILLed node restarts and takes a live peer's state) is compared with
Meta's torchft on the same run: 4 replicas, each training the built-in MLP on its rank's shard
(p2ptrain.train.setup), torchft's Manager + ProcessGroupGloo + DDP averaging gradients, the
lighthouse in the driver; replica 1 is SIGKILLed at a step and restarted later. Each worker writes
JSON lines (its steps' wall times, quorum and rejoin times, final accuracy and state digests);
heal_figures turns them into the figures. A crash of torchft on the kill is recorded, not hidden.
Benchmark code only: `python -m p2ptrain.bench.torchft_heal run --out DIR`.
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODEL, HIDDEN, BATCH_SIZE, LR = "mlp", 640, 32, 0.05  # the task of issue 27 (SGD with p2ptrain's momentum)
WARMUP_STEPS = 10  # mean step time: from the end of this step on
FT_TIMEOUT_S = 60.0  # torchft's default for the Manager's operations (collectives, should_commit, checkpoints)
POLL_S = 0.02


def quorum_timeout_s(ft_timeout: float) -> float:
    """The Manager's quorum timeout: torchft's default (60 s), at least twice the operations' timeout."""
    return max(60.0, 2 * ft_timeout)


def progress_path(out: Path, replica: int, incarnation: int = 0) -> Path:
    return out / f"replica{replica}-{incarnation}.jsonl"


def process_start_time() -> float:
    """Wall time this process started (from /proc, so interpreter start-up counts), else now."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, StopIteration, IndexError, ValueError):
        return time.time()


def one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:300]}" if text else type(exc).__name__


def read_progress(path: Path) -> list[dict]:
    """A worker's records so far (a last line still being written is left out)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    records = []
    for line in text.splitlines(keepends=True):
        if not line.endswith("\n"):
            break
        records.append(json.loads(line))
    return records


def last_step(records: list[dict]) -> int:
    """The worker's committed step count (torchft's manager step) after its latest step."""
    return max((r["step"] for r in records if r["event"] == "step"), default=0)


# -- the worker --------------------------------------------------------------------------------------
def task_config(replica: int, nodes: int, steps: int, seed: int = 0):
    """The NodeConfig p2ptrain's own node would train with (the groups the task uses are checked)."""
    from p2ptrain.settings import NodeConfig

    config = NodeConfig(rank=replica, world_size=nodes, steps=steps, model=MODEL, hidden=HIDDEN,
                        batch_size=BATCH_SIZE, lr=LR, seed=seed, threads=1, device="cpu")
    config.training.validate()
    config.data.validate()
    return config


def tensor_digest(tensors) -> str:
    """sha256 of the tensors' values as flat fp32 bytes, in order."""
    import torch

    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor.detach().to(torch.float32).contiguous().reshape(-1).numpy().tobytes())
    return digest.hexdigest()


def optimizer_digest(optimizer) -> str:
    """sha256 of the optimizer's per-parameter state (tensors as fp32 bytes, other values by repr)."""
    import torch

    digest = hashlib.sha256()
    for index, state in sorted(optimizer.state_dict()["state"].items()):
        for key, value in sorted(state.items()):
            digest.update(f"{index}:{key}:".encode())
            if isinstance(value, torch.Tensor):
                digest.update(value.detach().to(torch.float32).contiguous().reshape(-1).numpy().tobytes())
            else:
                digest.update(repr(value).encode())
    return digest.hexdigest()


class ProgressLog:
    def __init__(self, path: Path):
        self.file = open(path, "a", buffering=1)

    def write(self, event: str, **fields) -> None:
        self.file.write(json.dumps({"event": event, **fields}) + "\n")
        self.file.flush()


def worker(args: argparse.Namespace) -> int:
    process_start = process_start_time()
    from datetime import timedelta

    import torch
    import torch.nn.functional as F
    from torch.distributed import TCPStore
    from torchft import DistributedDataParallel, Manager, ProcessGroupGloo

    from p2ptrain.train import cycle
    from p2ptrain.train.evaluate import evaluate
    from p2ptrain.train.setup import build_optimizer, training_setup

    torch.set_num_threads(1)
    log = ProgressLog(Path(args.progress))
    log.write("start", replica=args.replica_id, pid=os.getpid(), process_start=process_start, t=time.time())
    config = task_config(args.replica_id, args.nodes, args.steps, args.seed)
    loader, test_loader, model, device = training_setup(config)
    optimizer = build_optimizer(config, model)

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    timeout = timedelta(seconds=args.ft_timeout)
    # A survivor stuck in gloo until `timeout` on the dead peer joins the next quorum that late: the others'
    # quorum wait must outlast it, or it raises out of should_commit (then every start_quorum re-raises it).
    quorum_timeout = timedelta(seconds=quorum_timeout_s(args.ft_timeout))
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # this replica group's (of one) store
    manager_start = time.time()
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=load_state_dict, state_dict=state_dict,
                      min_replica_size=args.min_replicas, replica_id=f"replica_{args.replica_id}",
                      lighthouse_addr=args.lighthouse, store_addr="127.0.0.1", store_port=store.port, rank=0,
                      world_size=1, timeout=timeout, quorum_timeout=quorum_timeout,
                      init_sync=False)  # every replica builds the same θ_0 (training_setup seeds it)
    log.write("manager", manager_start=manager_start, t=time.time())
    if args.go:  # the first start: nobody asks for a quorum before every replica's manager heartbeats
        while not Path(args.go).exists():
            time.sleep(POLL_S)
    ddp = DistributedDataParallel(manager, model)
    batches = cycle(loader)
    iteration = 0
    try:
        while manager.current_step() < args.steps:
            iteration += 1
            started = time.time()
            inputs, targets = next(batches)
            if iteration == 1:
                log.write("quorum_request", t=started)
            error = None
            manager.start_quorum()
            optimizer.zero_grad(set_to_none=True)
            try:
                loss = F.nll_loss(ddp(inputs.to(device)), targets.to(device))
                loss.backward()
                loss_value = float(loss.detach())
            except Exception as exc:  # noqa: BLE001 - a dead peer's allreduce: the step is dropped, not the run
                # Stock torchft 0.2.0 crashes here: its DDP comm hook asserts on the failed allreduce's future
                # (AssertionError out of backward), and the DDP reducer is left mid-reduction, so every later
                # forward raises. The step is reported failed (should_commit says no) and DDP is rebuilt.
                error = one_line(exc)
                manager.report_error(exc)
                loss_value = math.nan
                del ddp
                gc.collect()  # the old reducer's autograd hooks go with it
                ddp = DistributedDataParallel(manager, model)
            committed = manager.should_commit()
            if committed:
                optimizer.step()
            if manager.errored() is not None and error is None:
                error = one_line(manager.errored().original_exception)
            log.write("step", iter=iteration, step=manager.current_step(), committed=committed, t=time.time(),
                      seconds=time.time() - started, loss=loss_value, participants=manager.num_participants(),
                      **({"error": error} if error else {}))
        _, accuracy = evaluate(model, test_loader, device, loss_fn=F.nll_loss)
        log.write("done", t=time.time(), step=manager.current_step(), accuracy=accuracy,
                  params_sha256=tensor_digest(model.parameters()), optimizer_sha256=optimizer_digest(optimizer))
    except BaseException as exc:
        log.write("error", t=time.time(), message=one_line(exc))
        raise
    finally:
        manager.shutdown(wait=False)
    return 0


# -- the driver --------------------------------------------------------------------------------------
def heal_figures(records: dict[tuple[int, int], list[dict]], *, steps: int, killed: int | None) -> dict:
    """The figures of a run from its workers' records, keyed (replica, incarnation); `killed` is the
    replica that was SIGKILLed (its incarnation 1 the restarted process), None in a fault-free run."""
    survivors = {key: recs for key, recs in records.items() if key[0] != killed}
    restarted = records.get((killed, 1), []) if killed is not None else []
    final = {**survivors, **({(killed, 1): restarted} if (killed, 1) in records else {})}  # restarted: must finish too
    done = {key[0]: next((r for r in recs if r["event"] == "done"), None) for key, recs in final.items()}
    spans, durations, longest = [], [], {}
    for (replica, _), recs in survivors.items():
        step_recs = [r for r in recs if r["event"] == "step"]
        longest[replica] = max((r["seconds"] for r in step_recs), default=math.nan)
        after = [r for r in step_recs if r["step"] >= WARMUP_STEPS]
        if len(after) >= 2 and after[-1]["step"] > after[0]["step"]:
            spans.append((after[-1]["t"] - after[0]["t"]) / (after[-1]["step"] - after[0]["step"]))
            durations += [r["seconds"] for r in after[1:]]
    figures: dict = {
        "steps": steps,
        "mean_step_ms": 1e3 * statistics.fmean(spans) if spans else math.nan,
        "p50_step_ms": 1e3 * statistics.median(durations) if durations else math.nan,
        "survivor_longest_step_s": max(longest.values(), default=math.nan),
        "survivor_longest_steps_s": {str(r): s for r, s in sorted(longest.items())},
        "survivors_finished": all(done[r] is not None and done[r]["step"] >= steps for r, _ in survivors),
        "accuracy": {str(r): (d["accuracy"] if d else None) for r, d in sorted(done.items())},
    }
    digests = [d for d in done.values() if d is not None]
    complete = len(digests) == len(done) and bool(digests)
    figures["bit_identical"] = complete and len({d["params_sha256"] for d in digests}) == 1
    figures["optimizer_identical"] = complete and len({d["optimizer_sha256"] for d in digests}) == 1
    if killed is not None:
        start = next((r for r in restarted if r["event"] == "start"), None)
        asked = next((r for r in restarted if r["event"] == "quorum_request"), None)
        trained = next((r for r in restarted if r["event"] == "step" and r["committed"]), None)
        figures["restart_startup_s"] = asked["t"] - start["process_start"] if start and asked else None
        figures["rejoin_s"] = trained["t"] - asked["t"] if asked and trained else None
        figures["rejoined_at_step"] = trained["step"] if trained else None
        figures["restarted_steps_trained"] = sum(1 for r in restarted if r["event"] == "step" and r["committed"])
    step_errors = [r["error"] for recs in survivors.values() for r in recs if r["event"] == "step" and r.get("error")]
    figures["survivor_step_errors"] = len(step_errors)
    figures["first_step_error"] = step_errors[0] if step_errors else None
    return figures


def _worker_env() -> dict[str, str]:
    root = str(Path(__file__).resolve().parents[2])  # this checkout's p2ptrain, before any installed one
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


def _log_tail(path: Path) -> str:
    """The last line of a worker's log that names an error (its crash, in one line)."""
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except FileNotFoundError:
        return ""
    named = [line for line in lines if "Error" in line or "Exception" in line]
    return (named or lines or [""])[-1][:300]


# The lighthouse, in its own process (its log goes to OUT/lighthouse.log): prints its address, then serves.
LIGHTHOUSE = ("import sys, time\nfrom torchft.coordination import LighthouseServer\n"
              "server = LighthouseServer(bind='[::]:0', min_replicas=int(sys.argv[1]))\n"
              "print(server.address(), flush=True)\ntime.sleep(1e9)\n")


def run_torchft_heal(out_dir, *, steps: int = 300, kill_at: int | None = 100, restart_at: int | None = 150,
                     nodes: int = 4, timeout: float = 600, ft_timeout: float = FT_TIMEOUT_S, killed: int = 1,
                     seed: int = 0) -> dict:
    """Train `nodes` torchft replicas for `steps`; SIGKILL replica `killed` once it reaches step
    `kill_at` and restart it when the survivors reach `restart_at` (kill_at None: fault-free).
    Returns heal_figures' dict plus `error` (None, or one line: why a replica crashed or the run timed out)."""
    try:
        import torchft  # noqa: F401
    except ImportError:
        raise ModuleNotFoundError("torchft is not installed: pip install torchft==0.2.0") from None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in (*out.glob("replica*.jsonl"), out / "go"):
        old.unlink(missing_ok=True)
    env = _worker_env()
    logs = [open(out / "lighthouse.log", "w")]
    lighthouse = subprocess.Popen([sys.executable, "-c", LIGHTHOUSE, str(nodes - 1)], stdout=subprocess.PIPE,
                                  stderr=logs[0], text=True, env=env)
    lighthouse_address = lighthouse.stdout.readline().strip()
    procs: dict[tuple[int, int], subprocess.Popen] = {}

    def start(replica: int, incarnation: int) -> None:
        argv = [sys.executable, "-m", "p2ptrain.bench.torchft_heal", "worker", "--replica-id", str(replica),
                "--nodes", str(nodes), "--steps", str(steps), "--seed", str(seed), "--min-replicas", str(nodes - 1),
                "--lighthouse", lighthouse_address, "--ft-timeout", str(ft_timeout),
                "--progress", str(progress_path(out, replica, incarnation))]
        if incarnation == 0:
            argv += ["--go", str(out / "go")]
        log = open(out / f"replica{replica}-{incarnation}.log", "w")
        logs.append(log)
        procs[(replica, incarnation)] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)

    error = None
    kill_time = restart_time = None
    deadline = time.monotonic() + timeout
    try:
        for replica in range(nodes):
            start(replica, 0)
        while not all(any(r["event"] == "manager" for r in read_progress(progress_path(out, n))) for n in range(nodes)):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs.values()):
                raise RuntimeError("a replica ended or the run timed out before every manager started")
            time.sleep(POLL_S)
        (out / "go").touch()
        while True:
            if kill_at is not None and kill_time is None and \
                    last_step(read_progress(progress_path(out, killed))) >= kill_at:
                procs[(killed, 0)].send_signal(signal.SIGKILL)
                procs[(killed, 0)].wait()
                kill_time = time.time()
            survivors_at = min(last_step(read_progress(progress_path(out, n))) for n in range(nodes) if n != killed)
            if kill_time is not None and restart_time is None and restart_at is not None and survivors_at >= restart_at:
                restart_time = time.time()
                start(killed, 1)
            failed = [(key, p.returncode) for key, p in procs.items() if p.poll() not in (None, 0)
                      and not (key == (killed, 0) and kill_time is not None)]
            if failed:
                (replica, incarnation), code = failed[0]
                error = (f"replica {replica} (process {incarnation}) exited with code {code}: "
                         f"{_log_tail(out / f'replica{replica}-{incarnation}.log')}")
                break
            if all(p.poll() is not None for p in procs.values()):
                break
            if (killed, 1) in procs and procs[(killed, 1)].poll() is None and \
                    all(p.poll() is not None for key, p in procs.items() if key[0] != killed):
                # no quorum can form any more: torchft would wait out its quorum timeout, then raise
                asked = next((r["t"] for r in read_progress(progress_path(out, killed, 1))
                              if r["event"] == "quorum_request"), None)
                error = ("the survivors finished before the restarted replica rejoined (it was "
                         + (f"{time.time() - asked:.1f} s into its first quorum request)" if asked else
                            "still starting up)"))
                break
            if time.monotonic() > deadline:
                error = f"timed out after {timeout} s (steps: " + ", ".join(
                    f"{r}: {last_step(read_progress(progress_path(out, r, i)))}" for r, i in procs) + ")"
                break
            time.sleep(POLL_S)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        lighthouse.kill()
        lighthouse.wait()
        for log in logs:
            log.close()
    records = {key: read_progress(progress_path(out, *key)) for key in procs}
    figures = heal_figures(records, steps=steps, killed=killed if kill_at is not None else None)
    return {**figures, "nodes": nodes, "kill_at": kill_at, "restart_at": restart_at, "ft_timeout_s": ft_timeout,
            "quorum_timeout_s": quorum_timeout_s(ft_timeout),
            "kill_time": kill_time, "restart_time": restart_time, "error": error}


# -- the command line --------------------------------------------------------------------------------
ROWS = (("mean step ms (survivors, step 10 on)", "mean_step_ms", "{:.1f}"), ("p50 step ms", "p50_step_ms", "{:.1f}"),
        ("longest survivor step s (stall)", "survivor_longest_step_s", "{:.2f}"),
        ("restart: process start -> quorum request s", "restart_startup_s", "{:.2f}"),
        ("rejoin: quorum request -> first step s", "rejoin_s", "{:.2f}"),
        ("bit-identical parameters", "bit_identical", "{}"), ("identical optimizer state", "optimizer_identical", "{}"),
        ("accuracy by replica", "accuracy", "{}"), ("error", "error", "{}"))


def table(results: dict[str, dict]) -> str:
    names = list(results)
    rows = [["figure", *names]]
    for label, key, fmt in ROWS:
        cells = []
        for name in names:
            value = results[name].get(key)
            if isinstance(value, dict):
                value = " ".join(f"{k}:{v:.3f}" if isinstance(v, float) else f"{k}:{v}" for k, v in value.items())
            cells.append("-" if value is None else fmt.format(value))
        rows.append([label, *cells])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m p2ptrain.bench.torchft_heal", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="the kill/restart run and a fault-free run; writes OUT/torchft-heal.json")
    run.add_argument("--out", required=True)
    run.add_argument("--steps", type=int, default=300)
    run.add_argument("--kill-at", type=int, default=100)
    run.add_argument("--restart-at", type=int, default=150)
    run.add_argument("--nodes", type=int, default=4)
    run.add_argument("--ft-timeout", type=float, default=FT_TIMEOUT_S, help="torchft Manager/gloo timeout, s")
    run.add_argument("--timeout", type=float, default=600, help="limit of each run, s")
    run.add_argument("--repeats", type=int, default=1, help="kill/restart runs (default 1)")
    one = sub.add_parser("worker", help="one torchft replica (the driver starts these)")
    one.add_argument("--replica-id", type=int, required=True)
    one.add_argument("--nodes", type=int, default=4)
    one.add_argument("--steps", type=int, default=300)
    one.add_argument("--seed", type=int, default=0)
    one.add_argument("--min-replicas", type=int, default=3)
    one.add_argument("--lighthouse", required=True)
    one.add_argument("--ft-timeout", type=float, default=FT_TIMEOUT_S)
    one.add_argument("--progress", required=True)
    one.add_argument("--go", help="wait for this file before the first quorum")
    args = parser.parse_args(argv)
    if args.command == "worker":
        return worker(args)
    out = Path(args.out)
    common = dict(steps=args.steps, nodes=args.nodes, timeout=args.timeout, ft_timeout=args.ft_timeout)
    results = {}
    for repeat in range(1, args.repeats + 1):  # the stall depends on where in its step the kill lands: repeat it
        name, folder = ("kill/restart", "heal") if repeat == 1 else (f"kill/restart #{repeat}", f"heal-{repeat}")
        results[name] = run_torchft_heal(out / folder, kill_at=args.kill_at, restart_at=args.restart_at, **common)
    results["fault-free"] = run_torchft_heal(out / "fault-free", kill_at=None, restart_at=None, **common)
    (out / "torchft-heal.json").write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))
    return 0


__all__ = ["heal_figures", "read_progress", "run_torchft_heal"]

if __name__ == "__main__":
    sys.exit(main())
