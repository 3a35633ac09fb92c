"""Free TCP port discovery for local clusters.

Ports are drawn at random below the kernel's ephemeral range, which the kernel never hands out on
its own (neither to a bind to port 0 nor as the local port of an outgoing connection). A port
released here before a node binds it is then only at risk from another caller that picks ports the
same way, one chance in thousands, instead of from every connection any program opens meanwhile.
"""
from __future__ import annotations

import random
import socket
from collections.abc import Iterable
from contextlib import ExitStack
from pathlib import Path

LOWEST_PORT = 20000          # below it sit many well-known services' defaults
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_draw = random.Random()      # seeded from the OS: a caller's random.seed() must not align processes


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for automatically assigned ports (Linux's default where unreadable)."""
    try:
        low, high = (int(v) for v in EPHEMERAL_RANGE_FILE.read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_ports(count: int, host: str = "127.0.0.1", exclude: Iterable[int] = ()) -> list[int]:
    """Return `count` distinct TCP ports that were free on `host` a moment ago, none in `exclude`."""
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    taken = set(exclude)
    low = ephemeral_range()[0]
    pool = range(LOWEST_PORT, low) if low - LOWEST_PORT >= 1000 else range(0)
    with ExitStack() as stack:  # every socket stays bound until all are chosen, so they differ
        ports: list[int] = []
        for attempt in range(50 * count):
            if len(ports) == count:
                break
            port = _draw.choice(pool) if pool and attempt < 40 * count else 0
            if port in taken:
                continue
            sock = stack.enter_context(socket.socket(family, socket.SOCK_STREAM))
            try:
                sock.bind((host, port))
            except OSError:
                continue
            port = sock.getsockname()[1]
            if port in taken:
                continue
            taken.add(port)
            ports.append(port)
        if len(ports) < count:
            raise OSError(f"found only {len(ports)} of {count} free TCP ports on {host}")
        return ports
