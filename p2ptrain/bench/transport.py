"""`p2ptrain bench transport`: p2ptrain's gRPC push vs gloo send/recv vs a raw TCP socket.

All three move the same float32 payload between two fresh processes on loopback, with one untimed
warm-up transfer, in one invocation, so the ratios compare like with like on a noisy machine.
For p2ptrain, one transfer = one PushTensor stream acknowledged after the receiver has the whole
tensor in its (preallocated, reused) receive buffer (p2ptrain.bench.push, which
`python -m launcher.netns measure` runs between two network namespaces).
"""
from __future__ import annotations

import json
import math
import statistics
import sys

from p2ptrain.bench.baselines import TransferResult, bench_gloo, bench_tcp
from p2ptrain.bench.push import bench_p2ptrain

METHODS = ("p2ptrain", "gloo", "tcp")


def run(size_mb: float, reps: int, methods=METHODS, chunk_mb: float | None = None, rounds: int = 3,
        progress=None) -> dict:
    """`rounds` interleaved rounds of every method (fresh processes each time); medians reported,
    because one process pair's speed varies a lot with scheduling on a shared 2-core machine."""
    size_bytes = int(size_mb * 1e6) // 4 * 4
    chunk_bytes = int(chunk_mb * 1024 * 1024) if chunk_mb else None
    runners = {"p2ptrain": lambda: bench_p2ptrain(size_bytes, reps, chunk_bytes=chunk_bytes),
               "gloo": lambda: bench_gloo(size_bytes, reps), "tcp": lambda: bench_tcp(size_bytes, reps)}
    results: dict[str, list[TransferResult]] = {name: [] for name in methods}
    for round_index in range(rounds):
        for name in methods:
            results[name].append(runners[name]())
            if progress is not None:
                progress(f"round {round_index + 1}/{rounds} {name}: {results[name][-1].mb_per_s:.0f} MB/s")
    summary = {}
    for name, runs in results.items():
        mbps = sorted(r.mb_per_s for r in runs)
        summary[name] = {"mb_per_s": statistics.median(mbps), "min_mb_per_s": mbps[0], "max_mb_per_s": mbps[-1],
                         "sender_cpu_s_per_gb": _per_gb(runs, "sender_cpu_s"),
                         "receiver_cpu_s_per_gb": _per_gb(runs, "receiver_cpu_s")}
    ratios = {}
    if "p2ptrain" in summary:
        for base in ("gloo", "tcp"):
            if base in summary:
                ratios[f"p2ptrain/{base}"] = summary["p2ptrain"]["mb_per_s"] / summary[base]["mb_per_s"]
    return {"size_bytes": size_bytes, "reps": reps, "rounds": rounds, "chunk_bytes": chunk_bytes,
            "methods": summary, "ratios": ratios}


def _per_gb(runs: list[TransferResult], field: str) -> float | None:
    values = [getattr(r, field) / (r.size_bytes * r.reps / 1e9) for r in runs if getattr(r, field) is not None]
    return statistics.median(values) if values else None


def format_table(report: dict) -> str:
    lines = [f"payload {report['size_bytes'] / 1e6:.1f} MB x {report['reps']} transfers, "
             f"median of {report['rounds']} interleaved rounds",
             f"{'method':<10} {'MB/s':>8} {'min':>8} {'max':>8} {'snd cpu-s/GB':>13} {'rcv cpu-s/GB':>13}"]
    for name, r in report["methods"].items():
        cpu = [f"{v:13.2f}" if v is not None else f"{'-':>13}"
               for v in (r["sender_cpu_s_per_gb"], r["receiver_cpu_s_per_gb"])]
        lines.append(f"{name:<10} {r['mb_per_s']:>8.0f} {r['min_mb_per_s']:>8.0f} {r['max_mb_per_s']:>8.0f} "
                     f"{cpu[0]} {cpu[1]}")
    for name, ratio in report["ratios"].items():
        lines.append(f"ratio {name}: {ratio:.2f}x")
    return "\n".join(lines)


def main(args) -> int:
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = set(methods) - set(METHODS)
    if unknown or not methods:
        raise SystemExit(f"p2ptrain bench transport: unknown method(s) {sorted(unknown)}; choose from {METHODS}")
    if not (args.size_mb > 0 and math.isfinite(args.size_mb)) or args.reps < 1 or args.rounds < 1:
        raise SystemExit("p2ptrain bench transport: --size-mb must be > 0, --reps and --rounds >= 1")
    log = None if args.json else (lambda line: print(line, file=sys.stderr, flush=True))
    report = run(args.size_mb, args.reps, methods, args.chunk_mb, args.rounds, progress=log)
    print(json.dumps(report, indent=2) if args.json else format_table(report))
    return 0
