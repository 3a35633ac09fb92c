"""`p2ptrain bench transport`: p2ptrain's gRPC push vs gloo send/recv vs a raw TCP socket.

All three move the same float32 payload between two fresh processes on loopback, with one untimed
warm-up transfer, in one invocation, so the ratios compare like with like on a noisy machine.
For p2ptrain, one transfer = one PushTensor stream acknowledged after the receiver has the whole
tensor in its (preallocated, reused) receive buffer.
"""
from __future__ import annotations

import json
import math
import time
from multiprocessing.connection import Connection

from p2ptrain.bench.baselines import TransferResult, _check_args, _cpu, _run_pair, bench_gloo, bench_tcp

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
        transport.mark_ready()
        transport.wait_for_peers(timeout, require_ready=True)
        if rank == 1:  # receiver: consume each tensor so its buffer goes back to the pool
            cpu0 = None
            for step in range(reps + 1):
                if step == 1:
                    cpu0 = _cpu()
                message = transport.recv(pb.MESSAGE_KIND_BENCH, step, [0], timeout=timeout)[0]
                message.release()
            return {"cpu": _cpu() - cpu0}
        payload = torch.rand(numel, generator=torch.Generator().manual_seed(0))
        ack = transport.send(1, payload, kind=pb.MESSAGE_KIND_BENCH, step=0).result(timeout)
        if ack.status != pb.Ack.STATUS_ACCEPTED:
            raise RuntimeError(f"warm-up transfer refused: {ack.reason} {ack.detail}")
        cpu0, start = _cpu(), time.perf_counter()
        for step in range(1, reps + 1):
            ack = transport.send(1, payload, kind=pb.MESSAGE_KIND_BENCH, step=step).result(timeout)
            if ack.status != pb.Ack.STATUS_ACCEPTED:
                raise RuntimeError(f"transfer {step} refused: {ack.reason} {ack.detail}")
        return {"seconds": time.perf_counter() - start, "cpu": _cpu() - cpu0}


def bench_p2ptrain(size_bytes: int, reps: int, timeout: float = 300.0,
                   chunk_bytes: int | None = None) -> TransferResult:
    from launcher.ports import free_ports

    _check_args(size_bytes, reps, timeout)
    ports = free_ports(2)
    receiver, sender = _run_pair(
        "p2ptrain", [_p2ptrain_node, _p2ptrain_node],
        [(1, ports, size_bytes, reps, timeout, chunk_bytes), (0, ports, size_bytes, reps, timeout, chunk_bytes)],
        timeout)
    return TransferResult("p2ptrain", size_bytes, reps, sender["seconds"], sender_cpu_s=sender["cpu"],
                          receiver_cpu_s=receiver["cpu"])


def run(size_mb: float, reps: int, methods=METHODS, chunk_mb: float | None = None) -> dict:
    size_bytes = int(size_mb * 1e6) // 4 * 4
    chunk_bytes = int(chunk_mb * 1024 * 1024) if chunk_mb else None
    runners = {"p2ptrain": lambda: bench_p2ptrain(size_bytes, reps, chunk_bytes=chunk_bytes),
               "gloo": lambda: bench_gloo(size_bytes, reps), "tcp": lambda: bench_tcp(size_bytes, reps)}
    results = {name: runners[name]() for name in methods}
    mbps = {name: r.mb_per_s for name, r in results.items()}
    ratios = {}
    if "p2ptrain" in mbps:
        for base in ("gloo", "tcp"):
            if base in mbps:
                ratios[f"p2ptrain/{base}"] = mbps["p2ptrain"] / mbps[base]
    return {"size_bytes": size_bytes, "reps": reps,
            "methods": {name: {"mb_per_s": r.mb_per_s, "seconds": r.seconds, "sender_cpu_s": r.sender_cpu_s,
                               "receiver_cpu_s": r.receiver_cpu_s} for name, r in results.items()},
            "ratios": ratios}


def format_table(report: dict) -> str:
    lines = [f"payload {report['size_bytes'] / 1e6:.1f} MB x {report['reps']} transfers",
             f"{'method':<10} {'MB/s':>10} {'seconds':>9} {'snd cpu':>8} {'rcv cpu':>8}"]
    for name, r in report["methods"].items():
        cpu = [f"{v:8.2f}" if v is not None else f"{'-':>8}" for v in (r["sender_cpu_s"], r["receiver_cpu_s"])]
        lines.append(f"{name:<10} {r['mb_per_s']:>10.0f} {r['seconds']:>9.3f} {cpu[0]} {cpu[1]}")
    for name, ratio in report["ratios"].items():
        lines.append(f"ratio {name}: {ratio:.2f}x")
    return "\n".join(lines)


def main(args) -> int:
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = set(methods) - set(METHODS)
    if unknown or not methods:
        raise SystemExit(f"p2ptrain bench transport: unknown method(s) {sorted(unknown)}; choose from {METHODS}")
    if not (args.size_mb > 0 and math.isfinite(args.size_mb)) or args.reps < 1:
        raise SystemExit("p2ptrain bench transport: --size-mb must be > 0 and --reps >= 1")
    report = run(args.size_mb, args.reps, methods, args.chunk_mb)
    print(json.dumps(report, indent=2) if args.json else format_table(report))
    return 0
