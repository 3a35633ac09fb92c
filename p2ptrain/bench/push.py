"""The p2ptrain push measurement: how fast p2ptrain's own Transport moves a tensor from one process to another.

One transfer = one tensor message (a PushTensor stream, or a message on the TCP lane, per the
data plane) of a float32 tensor, acknowledged once the receiver has the whole tensor in its
(preallocated, reused) receive buffer. WARMUP untimed transfers (TCP window, a shaped link's token
bucket, both receive buffers paged in), the receiver's go, then ``reps`` timed ones; the clock is the
sender's and stops at the last Ack (payload goodput). CPU counts from the go on each end, as gloo's does.

:func:`bench_p2ptrain` is the loopback case that ``p2ptrain bench transport`` compares with gloo
and a raw TCP socket; :func:`bench_p2ptrain_between` runs the two ends as commands (``python -m
p2ptrain.bench.push``, one :func:`push_endpoint` each), each behind an optional argv prefix.
Benchmark code: nothing here runs during training.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

from p2ptrain.bench.baselines import TransferResult, check_transfer_args, cpu_seconds

SENDER, RECEIVER = 0, 1
RESULT_NAMES = {"grpc": "grpc", "tcp": "lane"}  # TransferResult.name per data plane ("p2ptrain" for auto)
STARTUP_GRACE_S = 30.0  # per run, on top of `timeout`: two fresh interpreters importing torch and grpc
# Untimed transfers: the receiver holds the first until the second is in, so both buffers of its pool (one
# the consumer holds, one the next message lands in) are paged in before the clock starts, as a raw
# socket's one buffer is by its warm-up; a fresh 64 MB buffer costs its first message 16k page faults.
WARMUP = 2
GO_CHANNEL = "go"  # the receiver's one-element message to the sender: its CPU clock runs, start timing


def push_endpoint(rank: int, peers: Sequence[str], size_bytes: int, reps: int, timeout: float,
                  chunk_bytes: int | None = None, data_plane: str = "auto", shared_memory: bool = False) -> dict:
    """Run one end of the measurement here, listening on ``peers[rank]``; ``peers`` = [sender, receiver].

    Returns ``{"seconds": ..., "cpu": ...}`` on the sender (wall time of the ``reps`` timed pushes and
    the CPU seconds spent meanwhile) and ``{"cpu": ...}`` on the receiver (its CPU seconds from the go
    to the last of them). Raises if a push is refused or the peer does not show up within ``timeout``.
    ``shared_memory``: lane payloads through shared memory where both ends share a host (off: the
    TCP lane is measured as TCP).
    """
    if rank not in (SENDER, RECEIVER) or len(peers) != 2:
        raise ValueError(f"need rank 0 (sender) or 1 (receiver) and two peer addresses, got {rank}, {peers}")
    check_transfer_args(size_bytes, reps, timeout)
    import torch

    from p2ptrain import large_pages
    from p2ptrain._proto import p2ptrain_pb2 as pb
    from p2ptrain.transport import Transport, TransportOptions

    torch.set_num_threads(1)
    numel = size_bytes // 4
    options = TransportOptions(step_window=WARMUP + reps + 1, send_timeout=timeout, data_plane=data_plane,
                               shared_memory=shared_memory, **({"chunk_bytes": chunk_bytes} if chunk_bytes else {}))
    kind = pb.MESSAGE_KIND_BENCH

    def accepted(ack: pb.Ack, what: str) -> None:
        if ack.status != pb.Ack.STATUS_ACCEPTED:
            raise RuntimeError(f"{what} refused: {ack.reason} {ack.detail}")

    with Transport(rank, 2, list(peers), listen=peers[rank], options=options) as transport:
        transport.expect(kind, torch.float32, numel, preallocate=2)
        transport.expect(kind, torch.float32, 1, channel=GO_CHANNEL, preallocate=0)
        transport.mark_ready()
        transport.membership.wait_for_peers(timeout, require_ready=True)
        if rank == RECEIVER:  # consume each tensor so its buffer goes back to the pool
            held = [transport.recv(kind, step, [SENDER], timeout=timeout)[SENDER] for step in range(WARMUP)]
            for message in held:
                message.release()
            start_cpu = cpu_seconds()
            go = transport.sender.send(SENDER, torch.zeros(1), kind=kind, step=0, channel=GO_CHANNEL)
            accepted(go.result(timeout), "go")
            for step in range(WARMUP, WARMUP + reps):
                transport.recv(kind, step, [SENDER], timeout=timeout)[SENDER].release()
            return {"cpu": cpu_seconds() - start_cpu}
        # sent from a buffer of the kind the algorithms send from (buffer_like: on 2 MiB pages)
        payload = large_pages.empty(numel, torch.float32)
        payload.copy_(torch.rand(numel, generator=torch.Generator().manual_seed(0)))
        start = cpu0 = 0.0
        for step in range(WARMUP + reps):
            if step == WARMUP:
                transport.recv(kind, 0, [RECEIVER], timeout=timeout, channel=GO_CHANNEL)[RECEIVER].release()
                cpu0, start = cpu_seconds(), time.perf_counter()
            accepted(transport.sender.send(RECEIVER, payload, kind=kind, step=step).result(timeout), f"push {step}")
        shared = transport.lanes.shared_messages if transport.lanes is not None else 0
        return {"seconds": time.perf_counter() - start, "cpu": cpu_seconds() - cpu0, "shared": shared}


def bench_p2ptrain_between(peers: Sequence[str], size_bytes: int, reps: int, timeout: float = 300.0,
                           chunk_bytes: int | None = None,
                           argv_prefixes: Sequence[Sequence[str]] = ((), ()),
                           data_plane: str = "auto", shared_memory: bool = False) -> TransferResult:
    """Time ``reps`` pushes from ``peers[0]`` to ``peers[1]`` ("host:port" each, where that end listens).

    Each end runs as ``[*argv_prefixes[i], python, -m, p2ptrain.bench.push, ...]``; a prefix places
    it (``["ip", "netns", "exec", NS]``: in a namespace whose address is ``peers[i]``'s host, as
    ``python -m p2ptrain.bench.netns_link`` does). Raises ``RuntimeError`` with the failing end's
    stderr if either exits non-zero or the run takes longer than ``timeout`` plus STARTUP_GRACE_S;
    both processes are gone when this returns.
    """
    check_transfer_args(size_bytes, reps, timeout)
    if len(peers) != 2 or len(argv_prefixes) != 2:
        raise ValueError(f"need a sender and a receiver: 2 peers and 2 argv prefixes, got {peers}, {argv_prefixes}")
    argv = [sys.executable, "-m", "p2ptrain.bench.push", "--peers", ",".join(peers), "--size-bytes",
            str(size_bytes), "--reps", str(reps), "--timeout", str(timeout), "--data-plane", data_plane]
    if chunk_bytes:
        argv += ["--chunk-bytes", str(chunk_bytes)]
    if shared_memory:
        argv.append("--shared-memory")
    package_root = str(Path(__file__).resolve().parents[2])  # finds p2ptrain even from a bare checkout
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)}
    roles = ("sender", "receiver")
    with tempfile.TemporaryDirectory(prefix="p2ptrain-push-") as logs:
        outputs = [(open(Path(logs, f"{role}.out"), "w+"), open(Path(logs, f"{role}.err"), "w+")) for role in roles]
        procs: list[subprocess.Popen] = []
        try:
            for rank, (prefix, (out, err)) in enumerate(zip(argv_prefixes, outputs)):
                procs.append(subprocess.Popen([*prefix, *argv, "--rank", str(rank)], env=env, stdin=subprocess.DEVNULL,
                                              stdout=out, stderr=err))
            deadline = time.monotonic() + timeout + STARTUP_GRACE_S
            while any(p.poll() is None for p in procs):
                failed = [i for i, p in enumerate(procs) if p.returncode not in (None, 0)]
                if failed:
                    i = failed[0]
                    raise RuntimeError(f"p2ptrain push {roles[i]} failed (exit {procs[i].returncode}): "
                                       f"{_tail(outputs[i][1])}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"p2ptrain push timed out after {timeout + STARTUP_GRACE_S:.0f} s")
                time.sleep(0.05)
            results = []
            for i, (p, (out, err)) in enumerate(zip(procs, outputs)):
                if p.returncode != 0:
                    raise RuntimeError(f"p2ptrain push {roles[i]} failed (exit {p.returncode}): {_tail(err)}")
                out.seek(0)
                results.append(json.loads(out.read().strip().splitlines()[-1]))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for out, err in outputs:
                out.close()
                err.close()
    sender, receiver = results
    if shared_memory and sender.get("shared", 0) < reps:
        raise RuntimeError(f"shared memory was asked for, but {sender.get('shared', 0)} of {WARMUP + reps} payloads "
                           "went through it (another host or network namespace, TLS, or no memfd here)")
    name = "shm" if shared_memory and data_plane != "grpc" else RESULT_NAMES.get(data_plane, "p2ptrain")
    return TransferResult(name, size_bytes, reps, sender["seconds"],
                          sender_cpu_s=sender["cpu"], receiver_cpu_s=receiver["cpu"])


def bench_p2ptrain(size_bytes: int, reps: int, timeout: float = 300.0, chunk_bytes: int | None = None,
                   data_plane: str = "auto", shared_memory: bool = False) -> TransferResult:
    """Time ``reps`` pushes between two fresh processes on 127.0.0.1 (as bench_gloo / bench_tcp do)."""
    from launcher.ports import free_ports

    check_transfer_args(size_bytes, reps, timeout)
    return bench_p2ptrain_between([f"127.0.0.1:{port}" for port in free_ports(2)], size_bytes, reps, timeout,
                                  chunk_bytes, data_plane=data_plane, shared_memory=shared_memory)


def _tail(stream, chars: int = 2000) -> str:
    stream.flush()
    stream.seek(0)
    return stream.read().strip()[-chars:]


def main(argv: Sequence[str] | None = None) -> int:
    """One end of bench_p2ptrain_between: prints push_endpoint's result as one JSON line."""
    parser = argparse.ArgumentParser(prog="python -m p2ptrain.bench.push",
                                     description="One end of the p2ptrain push measurement (rank 0 sends, 1 receives).")
    parser.add_argument("--rank", type=int, choices=(SENDER, RECEIVER), required=True)
    parser.add_argument("--peers", required=True, help="SENDER_HOST:PORT,RECEIVER_HOST:PORT")
    parser.add_argument("--size-bytes", type=int, required=True)
    parser.add_argument("--reps", type=int, required=True)
    parser.add_argument("--timeout", type=float, required=True)
    parser.add_argument("--chunk-bytes", type=int, default=None)
    parser.add_argument("--data-plane", choices=("auto", "grpc", "tcp"), default="auto")
    parser.add_argument("--shared-memory", action="store_true", help="lane payloads through shared memory")
    args = parser.parse_args(argv)
    result = push_endpoint(args.rank, args.peers.split(","), args.size_bytes, args.reps, args.timeout,
                           args.chunk_bytes, args.data_plane, args.shared_memory)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
