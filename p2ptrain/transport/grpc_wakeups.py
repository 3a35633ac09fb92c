"""Keeps grpc.aio's poller thread from blocking when one event loop carries hundreds of calls.

grpc.aio's poller thread queues each completion event and writes one byte to a socket pair to
wake the event loop; the loop reads one byte per wake-up and handles every queued event at once.
Each one-byte write costs about 768 bytes of socket buffer, so about 280 unread bytes fill it: a
burst of that many completions between two wake-ups (512 simulated nodes greeting their
neighbours on one loop) blocks the poller in write(). No call completes after that, the loop
waits inside the next call it starts, and every server of the process goes silent for good (seen
at 1,024 simulated nodes). With the sockets non-blocking the write that finds the buffer full
fails instead (grpc ignores its result): its event is queued, and the bytes already waiting
wake the loop to handle it. Only the loop that made the sockets reads them, and only when told
they are readable, so its reads never find them empty.
"""
from __future__ import annotations

import gc
import socket

_made_non_blocking: list[socket.socket] = []  # grpc.aio's current pair, once changed (one per process)


def wakeup_sockets() -> list[socket.socket]:
    """The socket pair of grpc.aio's poller ([] before grpc.aio is used, or if grpc changes)."""
    try:
        from grpc._cython import cygrpc
        queue_type = cygrpc.PollerCompletionQueue
    except (ImportError, AttributeError):
        return []
    queues = [o for o in gc.get_objects() if type(o) is queue_type]  # (type(): no property is touched)
    return [o for q in queues for o in gc.get_referents(q) if isinstance(o, socket.socket)]


def never_block_the_poller() -> int:
    """Make grpc.aio's wake-up sockets non-blocking (call once grpc.aio is in use: every server
    start does); how many sockets were changed now. Cheap once done: it looks for them again
    only after grpc.aio closed them (it shuts down when its last object goes)."""
    if _made_non_blocking and all(sock.fileno() >= 0 for sock in _made_non_blocking):
        return 0
    found = wakeup_sockets()
    changed = sum(1 for sock in found if sock.getblocking())
    for sock in found:
        sock.setblocking(False)
    _made_non_blocking[:] = found
    return changed


__all__ = ["never_block_the_poller", "wakeup_sockets"]
