"""Reference baselines for the point-to-point transport benchmark.

Both move the same float32 payload (``size_bytes`` bytes) from one OS process to another over 127.0.0.1:

* :func:`bench_gloo` -- ``torch.distributed`` gloo ``send``/``recv``.
* :func:`bench_tcp`  -- a raw TCP socket (``sendall`` / ``recv_into``), i.e.
  the practical ceiling for any TCP based transport on this host.

Both are timed the same way (see :class:`TransferResult`). The harness is public so that
other measurements time themselves alike: :func:`run_pair` (spawn a sender and a receiver, relay
a port, collect results; no child outlives it), :func:`check_transfer_args` and
:func:`cpu_seconds`. It is benchmark code and is never used at training time.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Sequence

__all__ = [
    "TransferResult",
    "bench_gloo",
    "bench_tcp",
    "check_transfer_args",
    "cpu_seconds",
    "free_port",
    "run_pair",
]

_HOST = "127.0.0.1"


@dataclass
class TransferResult:
    """One baseline's timing. The scheme, identical for both: one untimed warm-up transfer, a
    synchronisation point, then ``reps`` timed transfers; the clock (on the sender) stops once the
    receiver has confirmed receipt of the last transfer."""

    name: str  # "gloo" / "tcp"
    size_bytes: int  # payload size of one transfer
    reps: int
    seconds: float  # wall time of the `reps` timed transfers (after one untimed warm-up)
    # CPU seconds (user+sys, all threads, os.times) each process spent in the
    # timed region; informational, filled by bench_gloo / bench_tcp.
    sender_cpu_s: float | None = field(default=None, compare=False)
    receiver_cpu_s: float | None = field(default=None, compare=False)

    @property
    def mb_per_s(self) -> float:
        return self.size_bytes * self.reps / self.seconds / 1e6

    def __str__(self) -> str:  # pragma: no cover - cosmetic
        return (
            f"{self.name}: {self.size_bytes} B x {self.reps} in {self.seconds:.4f} s "
            f"= {self.mb_per_s:.1f} MB/s"
        )


def free_port(host: str = _HOST) -> int:
    """Return a TCP port that is currently free on ``host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def cpu_seconds() -> float:
    """CPU seconds (user + system, all threads) this process has used so far, from ``os.times``.

    Subtract two readings to get the CPU of a timed region; the resolution is one clock tick
    (10 ms on Linux), so very short regions may read 0.
    """
    t = os.times()
    return t.user + t.system


def check_transfer_args(size_bytes: int, reps: int, timeout: float) -> None:
    """Raise ``TypeError`` / ``ValueError`` unless the arguments describe a valid measurement.

    ``size_bytes`` must be a positive multiple of 4 (whole float32 values), ``reps`` an int
    >= 1 and ``timeout`` a positive finite number of seconds. Every ``bench_*`` function checks
    its arguments with this before it starts a process.
    """
    if isinstance(size_bytes, bool) or not isinstance(size_bytes, int):
        raise TypeError(f"size_bytes must be an int, got {type(size_bytes).__name__}")
    if size_bytes <= 0 or size_bytes % 4 != 0:
        raise ValueError(f"size_bytes must be a positive multiple of 4 (float32), got {size_bytes}")
    if isinstance(reps, bool) or not isinstance(reps, int) or reps < 1:
        raise ValueError(f"reps must be an int >= 1, got {reps!r}")
    if not (timeout > 0 and math.isfinite(timeout)):
        raise ValueError(f"timeout must be a positive finite number, got {timeout!r}")


# --------------------------------------------------------------------------
# process orchestration
# --------------------------------------------------------------------------


def _child_main(fn: Callable[..., Any], conn: Connection, args: tuple) -> None:
    """Entry point of every child: run ``fn(conn, *args)``, report the outcome."""
    try:
        value = fn(conn, *args)
    except BaseException:  # noqa: BLE001 - report everything to the parent
        try:
            conn.send(("err", traceback.format_exc()))
        except Exception:
            pass
        conn.close()
        sys.exit(1)
    conn.send(("ok", value))
    conn.close()


def _stop(procs: Sequence[mp.process.BaseProcess]) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 5.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5.0)


def run_pair(
    name: str,
    targets: Sequence[Callable[..., Any]],
    args: Sequence[tuple],
    timeout: float,
    relay: dict[int, int] | None = None,
) -> list[Any]:
    """Run one spawned child per target (a sender and a receiver) and return their results in order.

    Child ``i`` runs ``targets[i](conn, *args[i])``, where ``conn`` is its end of a duplex pipe to
    this process; whatever it returns (picklable) is its result. ``targets`` must be module-level
    functions, since children are started with ``spawn``.

    ``relay`` maps a child index to another child index: every message a child sends as
    ``conn.send(("msg", payload))`` is forwarded to that other child, which reads it with
    ``conn.recv()`` (used to hand the receiver's port to the sender).

    Raises ``RuntimeError`` naming the child, its exit code and its traceback if a child fails or
    dies, or if the whole run exceeds ``timeout`` seconds; no child outlives the call.
    """
    ctx = mp.get_context("spawn")
    relay = relay or {}
    procs: list[mp.process.BaseProcess] = []
    conns: list[Connection] = []
    results: list[Any] = [None] * len(targets)
    done = [False] * len(targets)
    deadline = time.monotonic() + timeout
    try:
        for i, (fn, a) in enumerate(zip(targets, args)):
            parent_conn, child_conn = ctx.Pipe(duplex=True)
            p = ctx.Process(
                target=_child_main, args=(fn, child_conn, a), name=f"{name}-{i}", daemon=True
            )
            p.start()
            child_conn.close()
            procs.append(p)
            conns.append(parent_conn)

        while not all(done):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                codes = {p.name: p.exitcode for p in procs}
                raise RuntimeError(f"{name} benchmark timed out after {timeout:.1f} s (exit codes: {codes})")
            waitables: list[Any] = [c for c, d in zip(conns, done) if not d]
            waitables += [p.sentinel for p, d in zip(procs, done) if not d]
            ready = wait(waitables, timeout=min(remaining, 1.0))
            for i, (c, p) in enumerate(zip(conns, procs)):
                if done[i]:
                    continue
                if c in ready or c.poll():
                    try:
                        tag, payload = c.recv()
                    except EOFError:
                        p.join(5.0)
                        raise RuntimeError(
                            f"{name} child {p.name} died without a result (exit code {p.exitcode})"
                        ) from None
                    if tag == "ok":
                        results[i], done[i] = payload, True
                    elif tag == "msg" and i in relay:
                        conns[relay[i]].send(payload)
                    else:  # "err"
                        p.join(5.0)
                        raise RuntimeError(
                            f"{name} child {p.name} failed (exit code {p.exitcode}):\n{payload}"
                        )
                elif p.sentinel in ready:
                    p.join(5.0)
                    raise RuntimeError(
                        f"{name} child {p.name} exited without a result (exit code {p.exitcode})"
                    )
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
        return results
    finally:
        _stop(procs)
        for c in conns:
            c.close()


# --------------------------------------------------------------------------
# gloo
# --------------------------------------------------------------------------


def _gloo_child(conn: Connection, rank: int, port: int, size_bytes: int, reps: int, timeout: float):
    import datetime

    # Keep gloo's data connections on the loopback interface (127.0.0.1).
    if sys.platform.startswith("linux"):
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{_HOST}:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=timeout),
    )
    try:
        n = size_bytes // 4
        ack = torch.zeros(1, dtype=torch.float32)
        if rank == 0:
            payload = torch.ones(n, dtype=torch.float32)
            dist.send(payload, 1)  # warm-up
            dist.recv(ack, 1)
            dist.barrier()
            c0, t0 = cpu_seconds(), time.perf_counter()
            for _ in range(reps):
                dist.send(payload, 1)
            dist.recv(ack, 1)  # receiver got the last transfer
            return time.perf_counter() - t0, cpu_seconds() - c0
        buf = torch.empty(n, dtype=torch.float32)
        dist.recv(buf, 0)  # warm-up
        dist.send(ack, 0)
        dist.barrier()
        c0 = cpu_seconds()
        for _ in range(reps):
            dist.recv(buf, 0)
        dist.send(ack, 0)
        cpu = cpu_seconds() - c0
        if float(buf[0]) != 1.0 or float(buf[-1]) != 1.0:
            raise AssertionError("gloo receiver got corrupted payload")
        return cpu
    finally:
        dist.destroy_process_group()


def bench_gloo(size_bytes: int, reps: int, timeout: float = 300.0) -> TransferResult:
    """Time ``reps`` gloo ``send``/``recv`` transfers of ``size_bytes`` bytes."""
    check_transfer_args(size_bytes, reps, timeout)
    port = free_port()
    res = run_pair(
        "gloo",
        [_gloo_child, _gloo_child],
        [(0, port, size_bytes, reps, timeout), (1, port, size_bytes, reps, timeout)],
        timeout,
    )
    (seconds, snd_cpu), rcv_cpu = res
    return TransferResult("gloo", size_bytes, reps, float(seconds), snd_cpu, rcv_cpu)


# --------------------------------------------------------------------------
# raw TCP
# --------------------------------------------------------------------------


def _tcp_receiver(conn: Connection, size_bytes: int, reps: int, timeout: float):
    import numpy as np

    buf = np.empty(size_bytes // 4, dtype=np.float32)
    mv = memoryview(buf).cast("B")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as ls:
        ls.bind((_HOST, 0))
        ls.listen(1)
        ls.settimeout(timeout)
        conn.send(("msg", ls.getsockname()[1]))  # relayed to the sender
        s, _ = ls.accept()
    with s:
        s.settimeout(timeout)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        c0 = 0.0
        for i in range(reps + 1):  # warm-up + timed
            if i == 1:
                c0 = cpu_seconds()
            got = 0
            while got < size_bytes:
                k = s.recv_into(mv[got:], size_bytes - got)
                if k == 0:
                    raise ConnectionError(f"sender closed the connection after {got} bytes")
                got += k
            s.sendall(b"\x01")
        cpu = cpu_seconds() - c0
        if buf[0] != 1.0 or buf[-1] != 1.0:
            raise AssertionError("tcp receiver got corrupted payload")
    return cpu


def _tcp_sender(conn: Connection, size_bytes: int, reps: int, timeout: float):
    import numpy as np

    if not conn.poll(timeout):
        raise TimeoutError("did not get the receiver's port")
    port = conn.recv()
    payload = np.ones(size_bytes // 4, dtype=np.float32)
    view = memoryview(payload).cast("B")  # zero-copy view of the array
    ack = bytearray(1)

    def one(s: socket.socket) -> None:
        s.sendall(view)
        if s.recv_into(ack, 1) != 1:
            raise ConnectionError("receiver closed the connection")

    with socket.create_connection((_HOST, port), timeout=timeout) as s:
        s.settimeout(timeout)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        one(s)  # warm-up (the ack doubles as the barrier)
        c0, t0 = cpu_seconds(), time.perf_counter()
        for _ in range(reps):
            one(s)
        return time.perf_counter() - t0, cpu_seconds() - c0


def bench_tcp(size_bytes: int, reps: int, timeout: float = 300.0) -> TransferResult:
    """Time ``reps`` raw-socket transfers of ``size_bytes`` bytes (ack per transfer)."""
    check_transfer_args(size_bytes, reps, timeout)
    res = run_pair(
        "tcp",
        [_tcp_sender, _tcp_receiver],
        [(size_bytes, reps, timeout), (size_bytes, reps, timeout)],
        timeout,
        relay={1: 0},
    )
    (seconds, snd_cpu), rcv_cpu = res
    return TransferResult("tcp", size_bytes, reps, float(seconds), snd_cpu, rcv_cpu)


def _main(argv: Sequence[str] | None = None) -> None:
    import argparse
    import statistics

    ap = argparse.ArgumentParser(description="gloo / raw-TCP point-to-point baselines")
    ap.add_argument("--size-mib", type=float, default=64.0)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--which", choices=["gloo", "tcp", "both"], default="both")
    a = ap.parse_args(argv)
    size = int(a.size_mib * 2**20) // 4 * 4
    benches = {"gloo": bench_gloo, "tcp": bench_tcp}
    names = ["gloo", "tcp"] if a.which == "both" else [a.which]
    for n in names:
        vals = [benches[n](size, a.reps).mb_per_s for _ in range(a.runs)]
        runs = [round(v) for v in vals]
        print(f"{n:5s} {size} B x {a.reps}: median {statistics.median(vals):8.1f} MB/s  runs={runs}")


if __name__ == "__main__":
    _main()
