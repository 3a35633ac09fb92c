"""`p2ptrain bench transport`: p2ptrain's two data planes, gRPC streaming (`grpc`) and the TCP lane
(`lane`; `shm`: the lane with its payloads through shared memory, as between nodes of one host),
vs gloo send/recv vs a raw TCP socket.

All four move the same float32 payload between two fresh processes on loopback, after untimed
warm-up transfers (one; two for p2ptrain, whose receiver alternates two pooled buffers), in one
invocation, so the ratios compare like with like on a noisy machine. For p2ptrain, one transfer =
one tensor message (a PushTensor stream, or a lane message) acknowledged after the receiver has the
whole tensor in its (preallocated, reused) receive buffer (p2ptrain.bench.push, which `python -m
p2ptrain.bench.netns_link` runs between two network namespaces). CPU is counted on both ends (user +
system, all threads) over the timed transfers only, and reported per GB moved.
"""
from __future__ import annotations

import json
import math
import statistics
import sys

from p2ptrain.bench.baselines import TransferResult, bench_gloo, bench_tcp
from p2ptrain.bench.push import bench_p2ptrain

METHODS = ("grpc", "lane", "shm", "gloo", "tcp")
OURS = ("grpc", "lane", "shm")
ALIASES = {"p2ptrain": "grpc"}  # the method's name before the lane existed
BASELINES = ("gloo", "tcp")


def run(size_mb: float, reps: int, methods=METHODS, chunk_mb: float | None = None, rounds: int = 3,
        progress=None) -> dict:
    """`rounds` interleaved rounds of every method (fresh processes each time); medians reported,
    because one process pair's speed varies a lot with scheduling on a shared 2-core machine."""
    size_bytes = int(size_mb * 1e6) // 4 * 4
    chunk_bytes = int(chunk_mb * 1024 * 1024) if chunk_mb else None
    runners = {"grpc": lambda: bench_p2ptrain(size_bytes, reps, chunk_bytes=chunk_bytes, data_plane="grpc"),
               "lane": lambda: bench_p2ptrain(size_bytes, reps, data_plane="tcp"),
               "shm": lambda: bench_p2ptrain(size_bytes, reps, data_plane="tcp", shared_memory=True),
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
        sender, receiver = _per_gb(runs, "sender_cpu_s"), _per_gb(runs, "receiver_cpu_s")
        summary[name] = {"mb_per_s": statistics.median(mbps), "min_mb_per_s": mbps[0], "max_mb_per_s": mbps[-1],
                         "sender_cpu_s_per_gb": sender, "receiver_cpu_s_per_gb": receiver,
                         "cpu_s_per_gb": sender + receiver if sender is not None and receiver is not None else None}
    ratios = {f"{name}/{base}": summary[name]["mb_per_s"] / summary[base]["mb_per_s"]
              for name in OURS if name in summary for base in BASELINES if base in summary}
    return {"size_bytes": size_bytes, "reps": reps, "rounds": rounds, "chunk_bytes": chunk_bytes,
            "methods": summary, "ratios": ratios}


def _per_gb(runs: list[TransferResult], field: str) -> float | None:
    values = [getattr(r, field) / (r.size_bytes * r.reps / 1e9) for r in runs if getattr(r, field) is not None]
    return statistics.median(values) if values else None


def format_table(report: dict) -> str:
    lines = [f"payload {report['size_bytes'] / 1e6:.1f} MB x {report['reps']} transfers, "
             f"median of {report['rounds']} interleaved rounds",
             f"{'method':<10} {'MB/s':>8} {'min':>8} {'max':>8} {'snd cpu-s/GB':>13} {'rcv cpu-s/GB':>13} "
             f"{'cpu-s/GB':>9}"]
    for name, r in report["methods"].items():
        cpu = [f"{v:{width}.2f}" if v is not None else f"{'-':>{width}}"
               for v, width in ((r["sender_cpu_s_per_gb"], 13), (r["receiver_cpu_s_per_gb"], 13),
                                (r["cpu_s_per_gb"], 9))]
        lines.append(f"{name:<10} {r['mb_per_s']:>8.0f} {r['min_mb_per_s']:>8.0f} {r['max_mb_per_s']:>8.0f} "
                     f"{' '.join(cpu)}")
    for name, ratio in report["ratios"].items():
        lines.append(f"ratio {name}: {ratio:.2f}x")
    return "\n".join(lines)


def main(args) -> int:
    methods = [ALIASES.get(m.strip(), m.strip()) for m in args.methods.split(",") if m.strip()]
    unknown = set(methods) - set(METHODS)
    if unknown or not methods:
        raise SystemExit(f"p2ptrain bench transport: unknown method(s) {sorted(unknown)}; choose from {METHODS}")
    if not (args.size_mb > 0 and math.isfinite(args.size_mb)) or args.reps < 1 or args.rounds < 1:
        raise SystemExit("p2ptrain bench transport: --size-mb must be > 0, --reps and --rounds >= 1")
    log = None if args.json else (lambda line: print(line, file=sys.stderr, flush=True))
    report = run(args.size_mb, args.reps, methods, args.chunk_mb, args.rounds, progress=log)
    print(json.dumps(report, indent=2) if args.json else format_table(report))
    return 0
