"""Free TCP port discovery for local clusters.

All sockets stay bound together while the kernel assigns the ports, so the ports returned are
distinct. They are released before the nodes bind them, which leaves a small race with other
programs on the machine; that is acceptable for a local launcher.
"""
from __future__ import annotations

import socket
from contextlib import ExitStack


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """Return `count` distinct TCP ports that were free on `host` a moment ago."""
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with ExitStack() as stack:
        sockets = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(family, socket.SOCK_STREAM))
            sock.bind((host, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]

