"""`p2ptrain bench heal`: how a lockstep cluster heals after a SIGKILL and a restart (issue 27).

Kill node 1 at step K and restart it at step R under AllReduce (gradients), Pipe-SGD and DiLoCo on
the 4-node MLP task, beside a fault-free run of each: the survivors' longest step (the stall
around the kill), the mean step (wall time per step), the restarted process's start-up (spawn to
asking for state) and rejoin (asking to its first step as a member), and whether every final
member is bit-identical (model and optimizer state) with accuracy near the fault-free run's.
With torchft installed, the same runs under torchft (bench/torchft_heal.py) make the last rows.
"""
from __future__ import annotations

import io
import json
import math
import shutil
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from p2ptrain.bench.clusters import nan_if_none, print_table, variant_dir

ALGORITHMS = {  # the algorithm's flags on top of the task's (DiLoCo: its inner AdamW at its default lr)
    "allreduce": ["--algorithm", "allreduce", "--lr", "0.05"],
    "pipesgd": ["--algorithm", "pipesgd", "--lr", "0.05"],
    "diloco": ["--algorithm", "diloco", "--inner-steps", "20"],
}
# DiLoCo's steps cost a third of a ring's: it runs this many times the steps, so that the restart
# (a few seconds of process start-up) still lands well before the end
STEPS_FACTOR = {"diloco": 3}
TASK = ["--model", "mlp", "--batch-size", "32", "--threads", "1"]
KILLED = 1  # the rank killed and restarted


@dataclass
class HealResult:
    name: str
    faults: bool
    mean_step_ms: float = math.nan         # survivors' wall time per step (what users pay)
    p50_step_ms: float = math.nan
    survivor_longest_s: float = math.nan   # the longest single step of any survivor (the stall)
    startup_s: float = math.nan            # restarted process: spawn -> asks for state
    rejoin_s: float = math.nan             # asks for state -> its first step trained as a member
    state_mb: float = math.nan             # the state it took from a donor
    transfer_mb_s: float = math.nan        # MB/s of the state it took from the holders at its switch (hand-out)
    identical: str = ""                    # the identical verdict: what is bit-identical, or why not
    accuracy: float = math.nan             # mean test accuracy of the final members
    error: str | None = None
    figures: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def add_arguments(parser) -> None:
    parser.add_argument("--nodes", type=int, default=4, help="node processes (default 4)")
    parser.add_argument("--steps", type=int, default=600,
                        help="training steps per run (default 600; DiLoCo runs 3x the steps, kill and restart)")
    parser.add_argument("--kill-at", type=int, default=100, help="step at which node 1 is SIGKILLed (default 100)")
    parser.add_argument("--restart-at", type=int, default=150, help="step at which it restarts (default 150)")
    parser.add_argument("--hidden", type=int, default=640,
                        help="MLP width (default 640: 0.92 M parameters; 3600 makes a 63 MB model)")
    parser.add_argument("--lane", action="store_true",
                        help="also measure the lane (bench transport's figure) for the state's size, for the "
                             "state transfer's ratio")
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS),
                        help=f"comma-separated subset of {','.join(ALGORITHMS)} (default all)")
    parser.add_argument("--no-fault-free", dest="fault_free", action="store_false",
                        help="skip the fault-free run of each algorithm (its mean step and accuracy)")
    parser.add_argument("--no-torchft", dest="torchft", action="store_false",
                        help="leave torchft out even when it is installed")
    parser.add_argument("--out", default="runs/bench-heal", help="run folders (default runs/bench-heal)")
    parser.add_argument("--timeout", type=float, default=900, help="per-run timeout in seconds (default 900)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON on stdout (table on stderr)")


def main(args) -> int:
    names = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    unknown = [a for a in names if a not in ALGORITHMS]
    if unknown or not names:
        print(f"p2ptrain bench heal: unknown algorithm(s) {unknown}; choose from {', '.join(ALGORITHMS)}",
              file=sys.stderr)
        return 2
    if not 0 < args.kill_at < args.restart_at < args.steps or args.nodes < 3:
        print("p2ptrain bench heal: needs 0 < --kill-at < --restart-at < --steps and --nodes >= 3", file=sys.stderr)
        return 2
    log = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    out = Path(args.out)
    results: list[HealResult] = []
    for name in names:
        for faults in ([False, True] if args.fault_free else [True]):
            log(f"  running {name} {'kill/restart' if faults else 'fault-free'} ...")
            factor = STEPS_FACTOR.get(name, 1)
            results.append(run_heal(name, args.nodes, factor * args.steps, factor * args.kill_at if faults else None,
                                    factor * args.restart_at, out, timeout=args.timeout, hidden=args.hidden))
            if results[-1].error:
                log(f"  {name} failed: {results[-1].error}")
    if args.torchft:
        results += torchft_rows(args, out, log)
    lane = lane_mb_s(results, log) if args.lane else None
    table = sys.stderr if args.json else sys.stdout
    report(results, args, table, lane)
    if args.json:
        print(json.dumps({"nodes": args.nodes, "steps": args.steps, "kill_at": args.kill_at, "hidden": args.hidden,
                          "restart_at": args.restart_at, "lane_mb_s": lane, "runs": [r.to_dict() for r in results]},
                         indent=2,
                         default=str))
    return 0 if not any(r.error for r in results if r.name in ALGORITHMS) else 1


def run_heal(name: str, nodes: int, steps: int, kill_at: int | None, restart_at: int, out: Path, *,
             timeout: float | None = None, hidden: int = 640) -> HealResult:
    """One cluster of `name`, with node 1 killed at `kill_at` and restarted at `restart_at` (no
    fault with kill_at None); a failure comes back as `error`."""
    from launcher import run_local_cluster
    from launcher.local import ClusterError, fault_plan

    run_dir = variant_dir(out, f"{name}-{'heal' if kill_at is not None else 'fault-free'}")
    if run_dir.exists():
        shutil.rmtree(run_dir)
    args = ["--steps", str(steps), *ALGORITHMS[name], *TASK, "--hidden", str(hidden), "--eval-every", str(steps),
            "--log-every", str(max(1, steps // 5))]
    faults = fault_plan([f"{KILLED}@{kill_at}"], [f"{KILLED}@{restart_at}"], nodes) if kill_at is not None else []
    result = HealResult(name, kill_at is not None)
    try:
        report = run_local_cluster(nodes, run_dir, args, config={"steps": steps, "algorithm": name}, metrics=False,
                                   live=False, timeout=timeout, stream=io.StringIO(), faults=faults)
    except ClusterError as exc:
        result.error = str(exc).splitlines()[0]
        return result
    return summarize(result, report, run_dir)


def summarize(result: HealResult, report: dict, run_dir: Path) -> HealResult:
    """Fill `result` from a run's report (and its fault log)."""
    from launcher.report import step_times

    nodes = [n for n in report["nodes"] if n]
    survivors = [n for n in nodes if n["rank"] != KILLED] if result.faults else nodes
    times = step_times(survivors)
    result.mean_step_ms = 1000 * nan_if_none(times["steady_step_seconds"])
    result.p50_step_ms = 1000 * nan_if_none(times["p50_step_seconds"])
    result.survivor_longest_s = nan_if_none(times["max_step_seconds"])
    accuracies = [n["test_accuracy"] for n in nodes if isinstance(n.get("test_accuracy"), (int, float))]
    result.accuracy = sum(accuracies) / len(accuracies) if accuracies else math.nan
    verdict = next((v for v in report.get("verdicts", []) if v["name"] == "identical"), None)
    if verdict is not None:
        result.identical = verdict["detail"] if verdict["ok"] else f"NO: {verdict['detail']}"
    if result.faults:
        restarted = next((n for n in nodes if n["rank"] == KILLED), {})
        timeline = restarted.get("join_timeline") or {}
        spawned = restart_time(run_dir)
        if "asked" in timeline and spawned is not None:
            result.startup_s = timeline["asked"] - spawned
        if "trained" in timeline:
            result.rejoin_s = timeline["trained"] - timeline["asked"]
        result.state_mb = timeline.get("state_bytes", math.nan) / 1e6
        if restarted.get("state_received_seconds"):
            result.transfer_mb_s = restarted["state_received_mb"] / restarted["state_received_seconds"]
        result.figures = {"join_timeline": timeline, "restarted_start_step": restarted.get("start_step")}
    return result


def restart_time(run_dir: Path) -> float | None:
    """When the launcher spawned the restarted process (its fault log's wall-clock time)."""
    log = run_dir / "faults.jsonl"
    if not log.exists():
        return None
    for line in log.read_text().splitlines():
        event = json.loads(line)
        if event.get("action") == "restart" and not event.get("skipped"):
            return float(event["time"])
    return None


def lane_mb_s(results: list[HealResult], log) -> float | None:
    """bench transport's lane figure (two processes, one transfer after a warm-up) for the size
    of the state the restarted nodes took."""
    from p2ptrain.bench.push import bench_p2ptrain

    sizes = [r.state_mb for r in results if math.isfinite(r.state_mb)]
    if not sizes:
        return None
    log(f"  measuring the lane for {max(sizes):.1f} MB ...")
    return bench_p2ptrain(int(max(sizes) * 1e6) // 4 * 4, 3, data_plane="tcp").mb_per_s


def torchft_rows(args, out: Path, log) -> list[HealResult]:
    """torchft's DDP on the same task (kill/restart and fault-free), when torchft is installed."""
    import importlib.util

    if importlib.util.find_spec("torchft") is None:
        log("bench heal: torchft is not installed (pip install torchft==0.2.0): its rows are skipped")
        return []
    from p2ptrain.bench import torchft_heal

    rows = []
    for faults in ([False, True] if args.fault_free else [True]):
        log(f"  running torchft {'kill/restart' if faults else 'fault-free'} ...")
        try:
            figures = torchft_heal.run_torchft_heal(out / ("torchft-heal" if faults else "torchft-fault-free"),
                                                    steps=args.steps, kill_at=args.kill_at if faults else None,
                                                    restart_at=args.restart_at, nodes=args.nodes,
                                                    timeout=args.timeout)
        except Exception as exc:  # noqa: BLE001 (a baseline's failure is a row, not the end of the benchmark)
            rows.append(HealResult("torchft ddp", faults, error=f"{type(exc).__name__}: {exc}".splitlines()[0]))
            continue
        rows.append(torchft_result(figures, faults))
    return rows


def torchft_result(figures: dict, faults: bool) -> HealResult:
    """A HealResult from run_torchft_heal's figures."""
    accuracies = [a for a in (figures.get("accuracy") or {}).values() if isinstance(a, (int, float))]
    same, same_state = figures.get("bit_identical"), figures.get("optimizer_identical")
    identical = "" if same is None else "NO: the models differ" if not same else \
        "model and optimizer state bit-identical" if same_state else "model bit-identical, optimizer state differs"
    return HealResult(
        "torchft ddp", faults, mean_step_ms=nan_if_none(figures.get("mean_step_ms")),
        p50_step_ms=nan_if_none(figures.get("p50_step_ms")),
        survivor_longest_s=nan_if_none(figures.get("survivor_longest_step_s")),
        startup_s=nan_if_none(figures.get("restart_startup_s")) if faults else math.nan,
        rejoin_s=nan_if_none(figures.get("rejoin_s")) if faults else math.nan,
        identical=identical,
        accuracy=sum(accuracies) / len(accuracies) if accuracies else math.nan,
        error=figures.get("error"), figures=figures)


def report(results: list[HealResult], args, stream, lane: float | None = None) -> None:
    def f(value: float, digits: int = 2) -> str:
        return "-" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"

    print(f"bench heal: {args.nodes} nodes, mlp {args.hidden}, batch 32, {args.steps} steps; kill node {KILLED} at "
          f"step {args.kill_at}, restart at {args.restart_at} (DiLoCo: 3x the steps)", file=stream)
    rows = [[r.name, "kill/restart" if r.faults else "none", f(r.mean_step_ms, 1), f(r.p50_step_ms, 1),
             f(r.survivor_longest_s), f(r.startup_s), f(r.rejoin_s), f(r.transfer_mb_s, 0), f(r.accuracy, 4),
             r.error or r.identical or "-"] for r in results]
    print_table(rows, ["run", "faults", "mean ms", "p50 ms", "longest step s", "start-up s", "rejoin s",
                       "state MB/s", "accuracy", "final members"], stream)
    if lane is not None:
        print(f"  lane (bench transport, same size): {lane:.0f} MB/s", file=stream)
    for r in results:
        if not r.faults or r.error or r.name not in ALGORITHMS:
            continue
        clean = next((c for c in results if c.name == r.name and not c.faults and not c.error), None)
        checks = [("survivors' longest step <= 1 s", r.survivor_longest_s <= 1.0),
                  ("rejoin (asked -> training) <= 1 s", r.rejoin_s <= 1.0),
                  ("final members bit-identical", "bit-identical" in r.identical)]
        if lane is not None and math.isfinite(r.transfer_mb_s):
            checks.append((f"state transfer {r.transfer_mb_s / lane:.2f}x the lane >= 0.8x",
                           r.transfer_mb_s >= 0.8 * lane))
        if clean is not None:
            checks.append((f"accuracy no more than 0.01 under fault-free ({clean.accuracy:.4f})",
                           r.accuracy >= clean.accuracy - 0.01))
        for what, ok in checks:
            print(f"  {r.name}: {what}: {'PASS' if ok else 'MISS'}", file=stream)


__all__ = ["ALGORITHMS", "HealResult", "add_arguments", "main", "run_heal", "summarize", "torchft_result"]
