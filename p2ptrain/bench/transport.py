"""`p2ptrain bench transport`: p2ptrain's gRPC push vs gloo send/recv vs a raw TCP socket.

All three move the same float32 payload between two fresh processes on loopback, with one untimed
warm-up transfer, in one invocation, so the ratios compare like with like on a noisy machine.
For p2ptrain, one transfer = one PushTensor stream acknowledged after the receiver has the whole
tensor in its (preallocated, reused) receive buffer.
"""
from __future__ import annotations

import json
import math
import statistics
import sys
import time
from multiprocessing.connection import Connection

from p2ptrain.bench.baselines import (TransferResult, bench_gloo, bench_tcp, check_transfer_args, cpu_seconds,
                                      run_pair)

METHODS = ("p2ptrain", "gloo", "tcp")


def _p2ptrain_node(conn: Connection, rank: int, ports: list[int], size_bytes: int, reps: int,
                   timeout: float, chunk_bytes: int | None):
    import torch

    from p2ptrain._proto import p2ptrain_pb2 as pb
    from p2ptrain.transport import Transport, TransportOptions

    torch.set_num_threads(1)
    numel = size_bytes // 4
    options = TransportOptions(step_window=reps + 2, send_timeout=timeout,
                               **({"chunk_bytes": chunk_bytes} if chunk_bytes else {}))
    peers = [f"127.0.0.1:{p}" for p in ports]
    with Transport(rank, 2, peers, options=options) as transport:
        transport.expect(pb.MESSAGE_KIND_BENCH, torch.float32, numel, preallocate=2)
        start_cpu = cpu_seconds()  # the sender may start as soon as we are marked ready
        transport.mark_ready()
        transport.wait_for_peers(timeout, require_ready=True)
        if rank == 1:  # receiver: consume each tensor so its buffer goes back to the pool
            # Receiving happens on the loop thread, ahead of this one: count the CPU of all
            # reps + 1 transfers and scale to `reps`.
            for step in range(reps + 1):
                message = transport.recv(pb.MESSAGE_KIND_BENCH, step, [0], timeout=timeout)[0]
                message.release()
            return {"cpu": (cpu_seconds() - start_cpu) * reps / (reps + 1)}
        payload = torch.rand(numel, generator=torch.Generator().manual_seed(0))
        ack = transport.send(1, payload, kind=pb.MESSAGE_KIND_BENCH, step=0).result(timeout)
        if ack.status != pb.Ack.STATUS_ACCEPTED:
            raise RuntimeError(f"warm-up transfer refused: {ack.reason} {ack.detail}")
        cpu0, start = cpu_seconds(), time.perf_counter()
        for step in range(1, reps + 1):
            ack = transport.send(1, payload, kind=pb.MESSAGE_KIND_BENCH, step=step).result(timeout)
            if ack.status != pb.Ack.STATUS_ACCEPTED:
                raise RuntimeError(f"transfer {step} refused: {ack.reason} {ack.detail}")
        return {"seconds": time.perf_counter() - start, "cpu": cpu_seconds() - cpu0}


def bench_p2ptrain(size_bytes: int, reps: int, timeout: float = 300.0,
                   chunk_bytes: int | None = None) -> TransferResult:
    from launcher.ports import free_ports

    check_transfer_args(size_bytes, reps, timeout)
    ports = free_ports(2)
    receiver, sender = run_pair(
        "p2ptrain", [_p2ptrain_node, _p2ptrain_node],
        [(1, ports, size_bytes, reps, timeout, chunk_bytes), (0, ports, size_bytes, reps, timeout, chunk_bytes)],
        timeout)
    return TransferResult("p2ptrain", size_bytes, reps, sender["seconds"], sender_cpu_s=sender["cpu"],
                          receiver_cpu_s=receiver["cpu"])


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
