"""OUT/node{rank}.mass: the push-sum mass a node holds right now, in a file that outlives a SIGKILL;
the launcher reads it right after a kill, so the chaos verdicts know what went down with the node.

One mmap'd page: a write is a memcpy into the page cache (no system call, no fsync), and the kernel
keeps the page when the process dies. Two writers, each in its own region, so neither takes a lock:
    training thread  step, w held, w in flight (sent, not yet acknowledged), w taken from the inbox,
                     w minted for this process (the new units a fresh process started with), and
                     the other flows, cumulative: started, sent, reabsorbed, retired, dropped
    event loop       w delivered into the inbox (push-sum shares, state transfers, leavers' mass)
received - taken is the mass acknowledged to its senders but not folded in yet. Each region is
written into two slots in turn, framed by its sequence number at both ends: a process killed in the
middle of a write leaves the other slot whole, and the reader takes the newest whole slot.
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"p2pmass3"
_HELD = struct.Struct("<qq9dq")  # seq, step, w, in flight, taken, minted, started, sent, reabsorbed, retired,
#                                   dropped, seq
_RECEIVED = struct.Struct("<qdq")    # seq, w received, seq
_HELD_AT = len(MAGIC)
_RECEIVED_AT = _HELD_AT + 2 * _HELD.size
SIZE = mmap.PAGESIZE


def mass_path(out_dir: Path, rank: int) -> Path:
    return Path(out_dir) / f"node{rank}.mass"


class MassRecord:
    """The writer, one per node process (a new incarnation starts the file over)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, SIZE)
            self._map = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        self._map[:len(MAGIC)] = MAGIC
        self._held_seq = self._received_seq = 0
        self._received = 0.0

    def held(self, step: int, w: float, in_flight: float, taken: float, minted: float = 0.0,
             flows: tuple[float, float, float, float, float] = (0.0,) * 5) -> None:
        """Training thread: the mass after a push, fold, re-absorption, split or hand-over; `flows`
        = (started, sent, reabsorbed, retired, dropped), cumulative (PushSum.flows)."""
        self._held_seq += 1
        seq = self._held_seq
        _HELD.pack_into(self._map, _HELD_AT + (seq & 1) * _HELD.size, seq, step, w, in_flight, taken, minted, *flows,
                        seq)

    def received(self, weight: float) -> None:
        """Event-loop thread: a message carrying `weight` of mass was delivered (and acknowledged)."""
        self._received += weight
        self._received_seq += 1
        seq = self._received_seq
        _RECEIVED.pack_into(self._map, _RECEIVED_AT + (seq & 1) * _RECEIVED.size, seq, self._received, seq)

    @property
    def received_total(self) -> float:
        """The w delivered into the inbox so far (for the node's summary at the end)."""
        return self._received

    def close(self) -> None:
        self._map.close()


@dataclass(frozen=True)
class MassReading:
    """What a node held when its record was last written (a killed node: when it died)."""

    step: int
    w: float          # held: lost with the node for certain
    in_flight: float  # sent, unacknowledged: lost only if it never lands
    inbox: float      # acknowledged to its senders, not folded in: lost, unless the ack never left
    minted: float = 0.0  # the new units it started with (a fresh process: joined, or restarted)
    taken: float = 0.0       # cumulative flows (PushSum.flows): the exact ledger's terms
    received: float = 0.0
    started: float = 0.0
    sent: float = 0.0
    reabsorbed: float = 0.0
    retired: float = 0.0
    dropped: float = 0.0

    @property
    def uncertain(self) -> float:
        return self.in_flight + self.inbox

    def flows(self) -> dict[str, float]:
        """The cumulative flows of w by name, as a node's summary has them (`ps_flows`)."""
        return {"minted": self.minted, "started": self.started, "taken": self.taken, "sent": self.sent,
                "reabsorbed": self.reabsorbed, "retired": self.retired, "dropped": self.dropped,
                "received": self.received}


def read_mass_record(path: Path) -> MassReading | None:
    """The newest whole record in `path`; None when there is none (the node never held mass)."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return None
    if len(data) < _RECEIVED_AT + 2 * _RECEIVED.size or not data.startswith(MAGIC):
        return None
    held = _newest(data, _HELD, _HELD_AT)
    if held is None:
        return None
    received = _newest(data, _RECEIVED, _RECEIVED_AT)
    _, step, w, in_flight, taken, minted, started, sent, reabsorbed, retired, dropped, _ = held
    total = received[1] if received is not None else 0.0
    return MassReading(step=step, w=w, in_flight=in_flight, inbox=max(0.0, total - taken), minted=minted,
                       taken=taken, received=total, started=started, sent=sent, reabsorbed=reabsorbed,
                       retired=retired, dropped=dropped)


def _newest(data: bytes, layout: struct.Struct, offset: int) -> tuple | None:
    slots = [layout.unpack_from(data, offset + i * layout.size) for i in (0, 1)]
    whole = [s for s in slots if s[0] == s[-1] and s[0] > 0]
    return max(whole, key=lambda s: s[0]) if whole else None


__all__ = ["MassReading", "MassRecord", "mass_path", "read_mass_record"]
