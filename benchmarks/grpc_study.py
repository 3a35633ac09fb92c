"""How fast can gRPC (Python) push bytes between two local processes?

A research study, not part of the p2ptrain package: it lives in the checkout's top-level
``benchmarks/`` (not in the wheel) and nothing in p2ptrain imports it. Its findings are behind
``p2ptrain/transport/tuning.py`` (glibc malloc tuning) and the gRPC flow-control options left at
their defaults in ``p2ptrain/transport/options.py``; run it again to re-check them on new hardware
or a new grpcio. It uses only public names of
:mod:`p2ptrain.bench.baselines` (``run_pair``, ``bench_gloo``, ``bench_tcp``) and
:func:`p2ptrain.transport.tuning.tune_malloc`.

Every measurement spawns a fresh receiver (gRPC server) process and a fresh
sender (gRPC client) process on 127.0.0.1 (or a unix socket), pushes a float32
payload ``reps`` times after one untimed warm-up push, and reports

* throughput (MB/s, 1 MB = 1e6 B) -- median over ``--runs`` repetitions,
* CPU of each side during the timed region, as "cores" (CPU-s / wall-s, from
  ``os.times``) and as CPU-seconds per GB moved, plus the busiest threads
  (from ``/proc/self/task/*/stat``),
* context switches per MB on each side (``/proc/self/task/*/status``),
* the number of ESTABLISHED TCP connections the sender really holds to the
  server (from ``/proc/net/tcp*``).

Per-thread figures only cover threads alive at the end of the timed region
(the sync client's short-lived request-iterator threads are missing there,
but are included in the process totals).  ``--perf DIR`` records both sides
with ``perf record`` for a CPU profile.

Findings on the 2-core development VM (grpcio 1.85.1, see the project notes):
the biggest lever is glibc malloc (``mallopt=1``); the best recipe is
``client=sync server=sync chunk=1M mallopt=1`` (or aio with ``streams=2``),
which still needs ~2-3x gloo's CPU per byte because grpc's Python layer
copies every message twice more on each side.

A configuration is a whitespace separated list of ``key=value`` tokens::

    client=aio|sync        sender API                       (default aio)
    server=aio|sync        receiver API                     (default aio)
    rpc=su|ss|uu           stream-unary | stream-stream (one empty ack per
                           message) | one unary call per chunk   (default su)
    chunk=4M               message size (K/M suffix = KiB/MiB)
    conns=1                channels, each with its own TCP connection
                           (grpc.use_local_subchannel_pool=1); the payload is
                           split evenly over conns*streams concurrent calls
    streams=1              concurrent calls per connection
    transport=tcp|uds      127.0.0.1 TCP or a unix domain socket
    recv=into|drop         receiver copies every message into a preallocated
                           float32 buffer (realistic) | only counts bytes
    send=tensor|prebuilt|memoryview
                           tensor: bytes(memoryview(array)[a:b]) per message
                           inside the timed loop (realistic); prebuilt: the
                           bytes chunks are built once before timing (ceiling);
                           memoryview: hand grpc a memoryview slice
    uvloop=0|1             run the aio side(s) on uvloop
    mallopt=0|1            call tune_malloc() (glibc mallopt: mmap threshold
                           32 MiB, trim threshold 1 GiB) in both processes
    ch:<grpc.arg>=<v>      extra channel argument (client)
    srv:<grpc.arg>=<v>     extra server argument
    opt:<grpc.arg>=<v>     extra argument for both sides
    env:<NAME>=<v>         environment variable for both processes (set
                           before grpc is imported), e.g.
                           env:GRPC_EXPERIMENTS=tcp_rcv_lowat
                           env:MALLOC_MMAP_THRESHOLD_=33554432 (read at
                           process start; set in the parent before spawn)
    name=<label>           label for the table

Examples (from the root of a checkout; ``python benchmarks/grpc_study.py ...`` works too)::

    python -m benchmarks.grpc_study --baselines --suite quick
    python -m benchmarks.grpc_study --config "client=sync server=aio chunk=1M"
    python -m benchmarks.grpc_study --list-suites
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from p2ptrain.bench.baselines import bench_gloo, bench_tcp, run_pair
from p2ptrain.transport.tuning import tune_malloc

_SERVICE = "p2pbench.Bench"
_HOST = "127.0.0.1"
_KIB = 1024
_MIB = 1024 * 1024

# --------------------------------------------------------------------------
# configuration
# --------------------------------------------------------------------------


@dataclass
class Config:
    name: str = ""
    client: str = "aio"
    server: str = "aio"
    rpc: str = "su"
    chunk: int = 4 * _MIB
    conns: int = 1
    streams: int = 1
    transport: str = "tcp"
    recv: str = "into"
    send: str = "tensor"
    uvloop: bool = False
    mallopt: bool = False
    chopts: dict = field(default_factory=dict)
    sopts: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)

    def label(self) -> str:
        if self.name:
            return self.name
        return spec_of(self)

    def validate(self) -> None:
        choices = {
            "client": ("aio", "sync"),
            "server": ("aio", "sync"),
            "rpc": ("su", "ss", "uu"),
            "transport": ("tcp", "uds"),
            "recv": ("into", "drop"),
            "send": ("tensor", "prebuilt", "memoryview"),
        }
        for k, allowed in choices.items():
            if getattr(self, k) not in allowed:
                raise ValueError(f"{k}={getattr(self, k)!r} not in {allowed}")
        if self.chunk <= 0 or self.chunk % 4:
            raise ValueError("chunk must be a positive multiple of 4")
        if self.conns < 1 or self.streams < 1:
            raise ValueError("conns and streams must be >= 1")


def _parse_size(v: str) -> int:
    v = v.strip().upper()
    mult = 1
    if v.endswith("K"):
        mult, v = _KIB, v[:-1]
    elif v.endswith("M"):
        mult, v = _MIB, v[:-1]
    return int(float(v) * mult)


def _parse_value(v: str) -> Any:
    try:
        return int(v)
    except ValueError:
        return v


def parse_config(spec: str) -> Config:
    cfg = Config()
    for tok in shlex.split(spec):
        if "=" not in tok:
            raise ValueError(f"bad token {tok!r} (expected key=value)")
        k, v = tok.split("=", 1)
        if k.startswith("ch:"):
            cfg.chopts[k[3:]] = _parse_value(v)
        elif k.startswith("srv:"):
            cfg.sopts[k[4:]] = _parse_value(v)
        elif k.startswith("opt:"):
            cfg.chopts[k[4:]] = _parse_value(v)
            cfg.sopts[k[4:]] = _parse_value(v)
        elif k.startswith("env:"):
            cfg.env[k[4:]] = v
        elif k == "chunk":
            cfg.chunk = _parse_size(v)
        elif k in ("conns", "streams"):
            setattr(cfg, k, int(v))
        elif k in ("uvloop", "mallopt"):
            setattr(cfg, k, v.lower() in ("1", "true", "yes", "on"))
        elif k in ("name", "client", "server", "rpc", "transport", "recv", "send"):
            setattr(cfg, k, v)
        else:
            raise ValueError(f"unknown key {k!r}")
    cfg.validate()
    return cfg


def _fmt_size(n: int) -> str:
    if n % _MIB == 0:
        return f"{n // _MIB}M"
    if n % _KIB == 0:
        return f"{n // _KIB}K"
    return str(n)


def spec_of(cfg: Config) -> str:
    """Compact spec string listing the non-default settings."""
    d = Config()
    parts = [f"{cfg.client}->{cfg.server}", cfg.rpc, _fmt_size(cfg.chunk)]
    if cfg.conns != d.conns:
        parts.append(f"conns={cfg.conns}")
    if cfg.streams != d.streams:
        parts.append(f"streams={cfg.streams}")
    for k in ("transport", "recv", "send"):
        if getattr(cfg, k) != getattr(d, k):
            parts.append(f"{k}={getattr(cfg, k)}")
    if cfg.uvloop:
        parts.append("uvloop")
    if cfg.mallopt:
        parts.append("mallopt")
    same = {k: v for k, v in cfg.chopts.items() if cfg.sopts.get(k) == v}
    parts += [f"opt:{k}={v}" for k, v in same.items()]
    parts += [f"ch:{k}={v}" for k, v in cfg.chopts.items() if k not in same]
    parts += [f"srv:{k}={v}" for k, v in cfg.sopts.items() if k not in same]
    parts += [f"env:{k}={v}" for k, v in cfg.env.items()]
    return " ".join(parts)


# --------------------------------------------------------------------------
# helpers shared by both children
# --------------------------------------------------------------------------




def _apply_env(cfg: Config) -> None:
    # Must run before grpc is imported in the child.  (Variables that the C
    # runtime reads at start-up are set by run_grpc before the spawn.)
    for k, v in cfg.env.items():
        os.environ[k] = str(v)
    if cfg.mallopt and not tune_malloc():
        raise RuntimeError("mallopt failed")


def _base_opts(extra: dict) -> list[tuple[str, Any]]:
    opts = {"grpc.max_send_message_length": -1, "grpc.max_receive_message_length": -1}
    opts.update(extra)
    return list(opts.items())


_CLK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _ctx_switches() -> int:
    """Voluntary + involuntary context switches of this process's live threads."""
    n = 0
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return 0
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/status") as f:
                for line in f:
                    if "ctxt_switches:" in line:
                        n += int(line.split()[-1])
        except (OSError, ValueError):
            continue
    return n


def _thread_cpu() -> dict[str, float]:
    """CPU seconds per thread name (threads with equal names are summed)."""
    out: dict[str, float] = {}
    base = "/proc/self/task"
    try:
        tids = os.listdir(base)
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"{base}/{tid}/stat") as f:
                s = f.read()
        except OSError:
            continue
        comm = s[s.index("(") + 1 : s.rindex(")")]
        fields = s[s.rindex(")") + 2 :].split()
        cpu = (int(fields[11]) + int(fields[12])) / _CLK
        key = comm if tid != str(os.getpid()) else f"main({comm})"
        out[key] = out.get(key, 0.0) + cpu
    return out


class CpuMeter:
    """CPU of this process over a region; optionally ``perf record`` it.

    With ``GRPC_STUDY_PERF_DIR`` set (``--perf DIR``), ``perf record`` is
    attached to this process for the region and writes ``DIR/<role>-<pid>.data``.
    """

    def __init__(self, role: str = "proc"):
        self.role = role
        self.perf = None

    def start(self) -> None:
        d = os.environ.get("GRPC_STUDY_PERF_DIR")
        if d:
            import subprocess

            out = os.path.join(d, f"{self.role}-{os.getpid()}.data")
            self.perf = subprocess.Popen(
                ["perf", "record", "-q", "-F", "999", "--call-graph",
                 os.environ.get("GRPC_STUDY_PERF_CALLGRAPH", "fp"), "-p", str(os.getpid()), "-o", out],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            time.sleep(0.5)  # let perf attach
        self.t0 = os.times()
        self.w0 = time.perf_counter()
        self.th0 = _thread_cpu()
        self.cs0 = _ctx_switches()

    def stop(self) -> dict:
        t1 = os.times()
        wall = time.perf_counter() - self.w0
        th1 = _thread_cpu()
        csw = _ctx_switches() - self.cs0
        if self.perf is not None:
            import signal

            self.perf.send_signal(signal.SIGINT)
            try:
                self.perf.wait(30)
            except Exception:
                self.perf.kill()
                self.perf.wait(5)
            self.perf = None
        user, sys_ = t1.user - self.t0.user, t1.system - self.t0.system
        threads = {k: v - self.th0.get(k, 0.0) for k, v in th1.items()}
        top = sorted(((v, k) for k, v in threads.items() if v > 0), reverse=True)[:4]
        return {
            "wall": wall,
            "user": user,
            "sys": sys_,
            "cores": (user + sys_) / wall if wall > 0 else float("nan"),
            "ctx_switches": csw,
            "threads": [(k, round(v / wall, 2)) for v, k in top],
        }


def _count_tcp_conns(port: int) -> int:
    """ESTABLISHED TCP connections of this process whose remote port is ``port``."""
    inodes = set()
    try:
        for fd in os.listdir("/proc/self/fd"):
            try:
                t = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if t.startswith("socket:["):
                inodes.add(t[8:-1])
    except OSError:
        return -1
    n = 0
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                next(f)
                for line in f:
                    p = line.split()
                    rport = int(p[2].rsplit(":", 1)[1], 16)
                    if p[3] == "01" and rport == port and p[9] in inodes:
                        n += 1
        except OSError:
            continue
    return n


def _split(size: int, parts: int, chunk: int) -> list[list[tuple[int, int]]]:
    """Split [0,size) into ``parts`` contiguous 4-byte aligned ranges, each cut into chunks."""
    words = size // 4
    out = []
    for i in range(parts):
        a = (words * i // parts) * 4
        b = (words * (i + 1) // parts) * 4
        out.append([(o, min(o + chunk, b)) for o in range(a, b, chunk)])
    return out


# --------------------------------------------------------------------------
# receiver (server) child
# --------------------------------------------------------------------------


class _Receiver:
    def __init__(self, cfg: Config, size: int):
        import numpy as np

        self.cfg = cfg
        self.size = size
        self.buf = np.zeros(size // 4, dtype=np.float32)
        self.mv = memoryview(self.buf).cast("B")
        self.into = cfg.recv == "into"
        self.meter = CpuMeter("receiver")
        self.received = 0

    def put(self, off: int, m: bytes) -> int:
        n = len(m)
        if self.into:
            self.mv[off : off + n] = m
        self.received += n
        return off + n

    def ctl(self, req: bytes) -> bytes:
        if req == b"start":
            self.received = 0
            self.meter.start()
            return b"{}"
        stats = self.meter.stop()
        stats["received"] = self.received
        n = len(self.buf)
        idx = [0, n // 2, n - 1]
        stats["probe"] = [float(self.buf[i]) for i in idx] if self.into else None
        return json.dumps(stats).encode()


def _off(metadata) -> int:
    for k, v in metadata:
        if k == "off":
            return int(v)
    raise KeyError("missing 'off' metadata")


def _server_child(conn, cfg_d: dict, size: int, timeout: float):
    cfg = Config(**cfg_d)
    _apply_env(cfg)
    import grpc

    rx = _Receiver(cfg, size)
    tmpdir = tempfile.mkdtemp(prefix="grpc_study_") if cfg.transport == "uds" else None
    bind = f"unix:{tmpdir}/s.sock" if tmpdir else f"{_HOST}:0"
    opts = _base_opts(cfg.sopts)
    try:
        if cfg.server == "sync":
            return _sync_server(grpc, conn, cfg, rx, bind, opts, timeout)
        return _aio_server(grpc, conn, cfg, rx, bind, opts, timeout)
    finally:
        if tmpdir:
            try:
                os.unlink(f"{tmpdir}/s.sock")
            except OSError:
                pass
            os.rmdir(tmpdir)


def _sync_server(grpc, conn, cfg, rx, bind, opts, timeout):
    import threading
    from concurrent.futures import ThreadPoolExecutor

    stop = threading.Event()

    def su(it, ctx):
        off = _off(ctx.invocation_metadata())
        for m in it:
            off = rx.put(off, m)
        return b"k"

    def ss(it, ctx):
        off = _off(ctx.invocation_metadata())
        for m in it:
            off = rx.put(off, m)
            yield b""

    def uu(m, ctx):
        rx.put(_off(ctx.invocation_metadata()), m)
        return b"k"

    def ctl(req, ctx):
        out = rx.ctl(req)
        if req == b"stop":
            stop.set()
        return out

    workers = cfg.conns * cfg.streams + 4
    server = grpc.server(ThreadPoolExecutor(max_workers=workers), options=opts)
    server.add_generic_rpc_handlers((_handlers(grpc, su, ss, uu, ctl),))
    port = server.add_insecure_port(bind)
    server.start()
    try:
        conn.send(("msg", bind if bind.startswith("unix:") else f"{_HOST}:{port}"))
        if not stop.wait(timeout):
            raise TimeoutError("sender never sent 'stop'")
    finally:
        server.stop(grace=1.0).wait(5.0)
    return None


def _aio_server(grpc, conn, cfg, rx, bind, opts, timeout):
    import asyncio

    if cfg.uvloop:
        import uvloop

        uvloop.install()

    async def main():
        stop = asyncio.Event()

        async def su(it, ctx):
            off = _off(ctx.invocation_metadata())
            async for m in it:
                off = rx.put(off, m)
            return b"k"

        async def ss(it, ctx):
            off = _off(ctx.invocation_metadata())
            async for m in it:
                off = rx.put(off, m)
                yield b""

        async def uu(m, ctx):
            rx.put(_off(ctx.invocation_metadata()), m)
            return b"k"

        async def ctl(req, ctx):
            out = rx.ctl(req)
            if req == b"stop":
                stop.set()
            return out

        server = grpc.aio.server(options=opts)
        server.add_generic_rpc_handlers((_handlers(grpc, su, ss, uu, ctl),))
        port = server.add_insecure_port(bind)
        await server.start()
        try:
            conn.send(("msg", bind if bind.startswith("unix:") else f"{_HOST}:{port}"))
            await asyncio.wait_for(stop.wait(), timeout)
        finally:
            await server.stop(grace=1.0)

    asyncio.run(main())
    return None


def _handlers(grpc, su, ss, uu, ctl):
    return grpc.method_handlers_generic_handler(
        _SERVICE,
        {
            "PushSU": grpc.stream_unary_rpc_method_handler(su),
            "PushSS": grpc.stream_stream_rpc_method_handler(ss),
            "PushUU": grpc.unary_unary_rpc_method_handler(uu),
            "Ctl": grpc.unary_unary_rpc_method_handler(ctl),
        },
    )


# --------------------------------------------------------------------------
# sender (client) child
# --------------------------------------------------------------------------


class _Payload:
    def __init__(self, cfg: Config, size: int):
        import numpy as np

        self.arr = np.arange(size // 4, dtype=np.float32)
        self.mv = memoryview(self.arr).cast("B")
        self.parts = _split(size, cfg.conns * cfg.streams, cfg.chunk)
        self.mode = cfg.send
        self.prebuilt = None
        if cfg.send == "prebuilt":
            self.prebuilt = {(a, b): bytes(self.mv[a:b]) for part in self.parts for a, b in part}

    def get(self, a: int, b: int):
        if self.mode == "tensor":
            return bytes(self.mv[a:b])
        if self.mode == "memoryview":
            return self.mv[a:b]
        return self.prebuilt[(a, b)]

    def expected_probe(self) -> list[float]:
        n = len(self.arr)
        return [float(self.arr[i]) for i in (0, n // 2, n - 1)]


def _client_child(conn, cfg_d: dict, size: int, reps: int, timeout: float):
    cfg = Config(**cfg_d)
    _apply_env(cfg)
    import grpc

    if not conn.poll(timeout):
        raise TimeoutError("did not get the server address")
    addr = conn.recv()
    payload = _Payload(cfg, size)
    opts = _base_opts(cfg.chopts) + [("grpc.use_local_subchannel_pool", 1)]
    if cfg.client == "sync":
        res = _sync_client(grpc, cfg, addr, opts, payload, reps, timeout)
    else:
        res = _aio_client(grpc, cfg, addr, opts, payload, reps, timeout)
    srv = res["server"]
    if srv["received"] != size * reps:
        raise AssertionError(f"server received {srv['received']} B, expected {size * reps}")
    if srv["probe"] is not None and srv["probe"] != payload.expected_probe():
        raise AssertionError(f"payload mismatch: {srv['probe']} != {payload.expected_probe()}")
    return res


def _port_of(addr: str) -> int:
    return -1 if addr.startswith("unix:") else int(addr.rsplit(":", 1)[1])


def _sync_client(grpc, cfg, addr, opts, payload, reps, timeout):
    from concurrent.futures import ThreadPoolExecutor

    chans = [grpc.insecure_channel(addr, options=opts) for _ in range(cfg.conns)]
    try:
        for ch in chans:
            grpc.channel_ready_future(ch).result(timeout=timeout)
        ctl = chans[0].unary_unary(f"/{_SERVICE}/Ctl")
        su = [ch.stream_unary(f"/{_SERVICE}/PushSU") for ch in chans]
        ss = [ch.stream_stream(f"/{_SERVICE}/PushSS") for ch in chans]
        uu = [ch.unary_unary(f"/{_SERVICE}/PushUU") for ch in chans]
        nparts = len(payload.parts)

        def send_part(i: int) -> None:
            part = payload.parts[i]
            c = i // cfg.streams
            md = (("off", str(part[0][0])),)
            if cfg.rpc == "su":
                su[c]((payload.get(a, b) for a, b in part), metadata=md, timeout=timeout)
            elif cfg.rpc == "ss":
                for _ in ss[c]((payload.get(a, b) for a, b in part), metadata=md, timeout=timeout):
                    pass
            else:
                for a, b in part:
                    uu[c](payload.get(a, b), metadata=(("off", str(a)),), timeout=timeout)

        pool = ThreadPoolExecutor(max_workers=nparts) if nparts > 1 else None

        def one_rep() -> None:
            if pool is None:
                send_part(0)
            else:
                for f in [pool.submit(send_part, i) for i in range(nparts)]:
                    f.result()

        try:
            one_rep()  # warm-up
            nconn = _count_tcp_conns(_port_of(addr)) if cfg.transport == "tcp" else -1
            ctl(b"start", timeout=timeout)
            meter = CpuMeter("sender")
            meter.start()
            t0 = time.perf_counter()
            for _ in range(reps):
                one_rep()
            seconds = time.perf_counter() - t0
            cpu = meter.stop()
            srv = json.loads(ctl(b"stop", timeout=timeout))
        finally:
            if pool is not None:
                pool.shutdown(wait=True)
        return {"seconds": seconds, "client": cpu, "server": srv, "tcp_conns": nconn}
    finally:
        for ch in chans:
            ch.close()


def _aio_client(grpc, cfg, addr, opts, payload, reps, timeout):
    import asyncio

    if cfg.uvloop:
        import uvloop

        uvloop.install()

    async def main():
        chans = [grpc.aio.insecure_channel(addr, options=opts) for _ in range(cfg.conns)]
        try:
            for ch in chans:
                await asyncio.wait_for(ch.channel_ready(), timeout)
            ctl = chans[0].unary_unary(f"/{_SERVICE}/Ctl")
            su = [ch.stream_unary(f"/{_SERVICE}/PushSU") for ch in chans]
            ss = [ch.stream_stream(f"/{_SERVICE}/PushSS") for ch in chans]
            uu = [ch.unary_unary(f"/{_SERVICE}/PushUU") for ch in chans]

            async def send_part(i: int) -> None:
                part = payload.parts[i]
                c = i // cfg.streams
                md = (("off", str(part[0][0])),)
                if cfg.rpc == "su":
                    call = su[c](metadata=md, timeout=timeout)
                    for a, b in part:
                        await call.write(payload.get(a, b))
                    await call.done_writing()
                    await call
                elif cfg.rpc == "ss":
                    call = ss[c](metadata=md, timeout=timeout)

                    async def drain():
                        async for _ in call:
                            pass

                    reader = asyncio.ensure_future(drain())
                    for a, b in part:
                        await call.write(payload.get(a, b))
                    await call.done_writing()
                    await reader
                else:
                    for a, b in part:
                        await uu[c](payload.get(a, b), metadata=(("off", str(a)),), timeout=timeout)

            async def one_rep() -> None:
                await asyncio.gather(*(send_part(i) for i in range(len(payload.parts))))

            await one_rep()  # warm-up
            nconn = _count_tcp_conns(_port_of(addr)) if cfg.transport == "tcp" else -1
            await ctl(b"start", timeout=timeout)
            meter = CpuMeter("sender")
            meter.start()
            t0 = time.perf_counter()
            for _ in range(reps):
                await one_rep()
            seconds = time.perf_counter() - t0
            cpu = meter.stop()
            srv = json.loads(await ctl(b"stop", timeout=timeout))
            return {"seconds": seconds, "client": cpu, "server": srv, "tcp_conns": nconn}
        finally:
            for ch in chans:
                await ch.close()

    return asyncio.run(main())


# --------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------


def run_grpc(cfg: Config, size: int, reps: int, timeout: float = 300.0) -> dict:
    """One measurement (fresh server + client process). Returns a result dict."""
    cfg.validate()
    d = dataclasses.asdict(cfg)
    # The children inherit the environment at spawn time: variables read at
    # process start-up (MALLOC_*, GLIBC_TUNABLES, LD_PRELOAD) must be set here.
    saved = {k: os.environ.get(k) for k in cfg.env}
    os.environ.update({k: str(v) for k, v in cfg.env.items()})
    try:
        client, _ = run_pair(
            "grpc",
            [_client_child, _server_child],
            [(d, size, reps, timeout), (d, size, timeout)],
            timeout + 30.0,
            relay={1: 0},
        )
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    client["mb_per_s"] = size * reps / client["seconds"] / 1e6
    return client


def _s(a: Sequence[str]) -> str:
    return " ".join(shlex.quote(x) for x in a)


_M = "mallopt=1"  # glibc malloc tuning, see tune_malloc()
SUITES: dict[str, list[str]] = {
    # the malloc effect (the single biggest knob found)
    "malloc": [
        "chunk=1M",
        "chunk=1M mallopt=1",
        "chunk=1M env:MALLOC_MMAP_THRESHOLD_=33554432 env:MALLOC_TRIM_THRESHOLD_=1073741824",
        "chunk=1M env:MALLOC_TRIM_THRESHOLD_=1073741824",
        "chunk=4M",
        "chunk=4M mallopt=1",
        "client=sync server=sync chunk=1M",
        "client=sync server=sync chunk=1M mallopt=1",
    ],
    # API combinations
    "api": [
        f"client=aio server=aio chunk=1M {_M}",
        f"client=sync server=sync chunk=1M {_M}",
        f"client=sync server=aio chunk=1M {_M}",
        f"client=aio server=sync chunk=1M {_M}",
    ],
    "chunk": [f"chunk={c} {_M}" for c in ("256K", "1M", "4M", "16M")]
    + [f"client=sync server=sync chunk={c} {_M}" for c in ("256K", "4M")],
    "rpc": [
        f"chunk=1M {_M} rpc=su",
        f"chunk=1M {_M} rpc=ss",
        f"chunk=1M {_M} rpc=uu",
        f"chunk=1M {_M} rpc=uu streams=4",
    ],
    "conns": [
        f"chunk=1M {_M} conns=1",
        f"chunk=1M {_M} conns=2",
        f"chunk=1M {_M} conns=4",
        f"chunk=1M {_M} streams=2",
        f"client=sync server=sync chunk=1M {_M} conns=2",
    ],
    "opts": [
        f"chunk=1M {_M}",
        f"chunk=1M {_M} opt:grpc.optimization_target=throughput",
        f"chunk=1M {_M} opt:grpc.http2.max_frame_size=16777215",
        f"chunk=1M {_M} opt:grpc.http2.bdp_probe=0 opt:grpc.http2.lookahead_bytes=67108864",
        f"chunk=1M {_M} opt:grpc.experimental.tcp_tx_zerocopy_enabled=1",
        f"chunk=1M {_M} srv:grpc.so_reuseport=0",
    ],
    "exp": [
        f"chunk=1M {_M}",
        f"chunk=1M {_M} env:GRPC_EXPERIMENTS=tcp_rcv_lowat",
        f"chunk=1M {_M} env:GRPC_EXPERIMENTS=tcp_frame_size_tuning",
        f"chunk=1M {_M} env:GRPC_EXPERIMENTS=free_large_allocator,unconstrained_max_quota_buffer_size",
        f"chunk=1M {_M} env:GRPC_EXPERIMENTS=pollset_alternative",
        f"chunk=1M {_M} env:GRPC_EXPERIMENTS=ph2_client,ph2_server",
        f"chunk=1M {_M} env:GRPC_POLL_STRATEGY=poll",
    ],
    "misc": [
        f"chunk=1M {_M}",
        f"chunk=1M {_M} transport=uds",
        f"chunk=1M {_M} recv=drop",
        f"chunk=1M {_M} send=prebuilt",
        f"chunk=1M {_M} send=prebuilt recv=drop",
        f"chunk=1M {_M} send=memoryview",
        f"chunk=1M {_M} uvloop=1",
    ],
    "quick": [
        "chunk=4M",
        f"chunk=1M {_M}",
        f"client=sync server=sync chunk=1M {_M}",
    ],
}


def _fmt_threads(th: list) -> str:
    return ",".join(f"{k}:{v:.2f}" for k, v in th[:3])


def _measure(spec: str, cfg: Config | None, size: int, reps: int, timeout: float) -> dict:
    if spec in ("gloo", "tcp"):
        r = (bench_gloo if spec == "gloo" else bench_tcp)(size, reps, timeout=timeout)

        def side(cpu):
            cpu = float("nan") if cpu is None else cpu
            return {"user": cpu, "sys": 0.0, "cores": cpu / r.seconds, "threads": []}

        return {
            "mb_per_s": r.mb_per_s,
            "seconds": r.seconds,
            "client": side(r.sender_cpu_s),
            "server": side(r.receiver_cpu_s),
            "tcp_conns": 1 if spec == "tcp" else -1,
        }
    assert cfg is not None
    return run_grpc(cfg, size, reps, timeout)


def _csw(side: dict, nbytes: int) -> str:
    n = side.get("ctx_switches")
    return "-" if n is None else f"{n / (nbytes / 1e6):.1f}"


def _row(label: str, res: list[dict], err: str | None, size: int, reps: int) -> str:
    if not res:
        return f"{label:64s} FAILED: {err}"
    res = sorted(res, key=lambda r: r["mb_per_s"])
    vals = [r["mb_per_s"] for r in res]
    line = f"{label:64s} {statistics.median(vals):7.0f} {min(vals):6.0f} {max(vals):6.0f}"
    med = res[len(res) // 2]
    if "client" in med:
        gb = size * reps / 1e9
        c, s = med["client"], med["server"]
        line += (
            f" | {c['cores']:9.2f} {s['cores']:9.2f} |"
            f" {(c['user'] + c['sys']) / gb:8.3f} {(s['user'] + s['sys']) / gb:8.3f} |"
            f" {_csw(c, size * reps):>4s} {_csw(s, size * reps):>4s} |"
            f" {med['tcp_conns']:5d} | {_fmt_threads(c['threads'])} / {_fmt_threads(s['threads'])}"
        )
    if err:
        line += f"  [{len(res)} ok; error: {err}]"
    return line


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.grpc_study",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--size-mib", type=float, default=64.0, help="payload per push (MiB)")
    ap.add_argument("--reps", type=int, default=10, help="timed pushes per measurement")
    ap.add_argument("--runs", type=int, default=3, help="measurements per configuration (median)")
    ap.add_argument("--timeout", type=float, default=120.0, help="per measurement, seconds")
    ap.add_argument("--config", action="append", default=[], help="configuration spec (repeatable)")
    ap.add_argument("--suite", action="append", default=[], help=f"predefined suite(s): {', '.join(SUITES)}")
    ap.add_argument("--list-suites", action="store_true")
    ap.add_argument("--baselines", action="store_true", help="also measure gloo and raw TCP")
    ap.add_argument("--json", help="append one JSON line per configuration to this file")
    ap.add_argument("--perf", metavar="DIR", help="perf record both sides' timed regions into DIR")
    ap.add_argument("--perf-callgraph", default="fp", help="perf --call-graph mode (fp, dwarf, lbr)")
    ap.add_argument("--quiet", action="store_true", help="no per-measurement progress on stderr")
    a = ap.parse_args(argv)

    if a.list_suites:
        for k, v in SUITES.items():
            print(f"[{k}]")
            for s in v:
                print("   ", s)
        return 0
    if a.perf:
        os.makedirs(a.perf, exist_ok=True)
        os.environ["GRPC_STUDY_PERF_DIR"] = os.path.abspath(a.perf)  # inherited by the children
        os.environ["GRPC_STUDY_PERF_CALLGRAPH"] = a.perf_callgraph
    size = int(a.size_mib * _MIB) // 4 * 4
    specs = list(a.config)
    for s in a.suite:
        if s not in SUITES:
            ap.error(f"unknown suite {s!r}")
        specs += SUITES[s]
    if not specs and not a.baselines:
        specs = SUITES["quick"]
    entries: list[tuple[str, Config | None]] = []
    if a.baselines:
        entries += [("gloo", None), ("tcp", None)]
    seen = set()
    for sp in specs:
        cfg = parse_config(sp)
        key = spec_of(cfg) + "|" + cfg.name
        if key not in seen:  # suites share their reference configuration
            seen.add(key)
            entries.append((cfg.label(), cfg))

    # Round-robin over the configurations so that background load on a shared
    # machine hits all of them alike.
    results: dict[int, list[dict]] = {i: [] for i in range(len(entries))}
    errors: dict[int, str] = {}
    for r in range(a.runs):
        for i, (label, cfg) in enumerate(entries):
            if i in errors:
                continue
            try:
                res = _measure(label, cfg, size, a.reps, a.timeout)
                results[i].append(res)
                if not a.quiet:
                    print(f"  run {r + 1}/{a.runs} {label}: {res['mb_per_s']:.0f} MB/s", file=sys.stderr, flush=True)
            except Exception as e:  # keep going with the other configurations
                errors[i] = str(e).strip().splitlines()[-1][:160]
                if not a.quiet:
                    print(f"  run {r + 1}/{a.runs} {label}: FAILED {errors[i]}", file=sys.stderr, flush=True)

    print(f"payload {size} B x {a.reps} reps, {a.runs} interleaved runs per config; MB/s (1 MB = 1e6 B)")
    print(
        f"{'configuration':64s} {'median':>7s} {'min':>6s} {'max':>6s} | {'snd cores':>9s} {'rcv cores':>9s}"
        f" | {'snd s/GB':>8s} {'rcv s/GB':>8s} | csw/MB    | conns | busiest threads (cores) snd / rcv"
    )
    for i, (label, cfg) in enumerate(entries):
        print(_row(label, results[i], errors.get(i), size, a.reps), flush=True)
    if a.json:
        with open(a.json, "a") as jf:
            for i, (label, cfg) in enumerate(entries):
                jf.write(json.dumps({"config": label, "results": results[i], "error": errors.get(i)}) + "\n")
    return 0


if __name__ == "__main__":
    # Re-import under the package name so that spawned children unpickle the
    # worker functions from ``benchmarks.grpc_study``, not ``__main__``. Run as
    # ``python benchmarks/grpc_study.py``, the checkout's root is not on
    # sys.path yet (spawned children inherit sys.path).
    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if _root not in sys.path:
        sys.path.insert(0, _root)
    from benchmarks.grpc_study import main as study_main

    sys.exit(study_main())
