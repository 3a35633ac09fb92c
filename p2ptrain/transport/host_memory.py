"""Regions of shared memory that the processes of one host read from each other, with words each
owner publishes and the others wait on without spinning: what a host collective (the algorithms'
host_allreduce.py) needs to sum tensors with no message per segment.

A region is a sealed memfd (shared_segment.py: the same offer, seals and checks), which the owner
maps for writing and its peers read-only. Its first 64 bytes are control: a 32-bit generation the
owner bumps around each publication (a seqlock, and the futex its peers sleep on), then the words it
publishes. They are plain loads and stores, ordered against the data as x86-64 orders them (stores
are seen in the order they were made), so regions exist only there, on Linux; elsewhere
`supported()` is False and callers use messages.
"""
from __future__ import annotations

import ctypes
import math
import platform
import secrets
import warnings

import numpy
import torch

from p2ptrain.transport import shared_segment

CONTROL_BYTES = 64
WORDS = 6  # 64-bit words an owner publishes at once, after its 32-bit generation
_SYS_FUTEX = {"x86_64": 202, "amd64": 202}.get(platform.machine().lower())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_WAKE_ALL = 2**31 - 1
READ_TRIES = 10_000  # reads of a generation left odd before read() gives up (a live owner takes ~1 µs)
NONCE_BITS = 52  # a nonce travels in a float64 (an all-reduce of offers): exact up to 2**53


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = ctypes.CDLL(None, use_errno=True) if _SYS_FUTEX is not None else None


def supported() -> bool:
    """Linux on x86-64 (memfd, /proc, futexes, stores seen in order)."""
    return _libc is not None and shared_segment.supported()


class Region:
    """A mapped region: its data bytes, and the words its owner last published, read whole.
    Subclasses hold the mapping as `_segment` (shared_segment.py)."""

    _segment: shared_segment.OwnSegment | shared_segment.PeerSegment

    def __init__(self, area: numpy.ndarray, nbytes: int):
        self._generation = area[0:4].view(numpy.int32)
        self._words = area[8:8 + 8 * WORDS].view(numpy.int64)
        self._address = self._generation.ctypes.data
        with warnings.catch_warnings():  # (a peer's region is read-only: torch warns about the view)
            warnings.simplefilter("ignore")
            self.data = torch.from_numpy(area[CONTROL_BYTES:CONTROL_BYTES + nbytes])

    def generation(self) -> int:
        return int(self._generation[0])

    def read(self) -> tuple[int, ...] | None:
        """The WORDS words of one publication: a seqlock (the generation is odd while the owner
        writes them and moves on after), so never half of one publication and half of the next.
        None where none could be read: an owner killed between its stores leaves it odd."""
        for _ in range(READ_TRIES):
            before = int(self._generation[0])
            if before & 1:
                continue  # (the owner is between two stores of a few words)
            words = tuple(int(word) for word in self._words)
            if int(self._generation[0]) == before:
                return words
        return None

    def wait(self, generation: int, timeout: float) -> None:
        """Sleep until the owner publishes past `generation` (or `timeout` seconds pass; a spurious
        wake-up is possible: callers read again)."""
        if timeout <= 0 or self.generation() != generation:
            return
        fraction, whole = math.modf(timeout)
        spec = _Timespec(int(whole), int(fraction * 1e9))
        _libc.syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(self._address), ctypes.c_int(_FUTEX_WAIT),
                      ctypes.c_int(generation), ctypes.byref(spec), None, ctypes.c_int(0))

    def close(self) -> None:
        """Unmap (a tensor still viewing `data` keeps the mapping until it goes)."""
        self._generation = self._words = self.data = None
        try:
            self._segment.close()
        except BufferError:
            pass


class OwnRegion(Region):
    """This process's region, `nbytes` of data: write `data`, then publish() words."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.nonce = secrets.randbits(NONCE_BITS)
        self._segment = shared_segment.OwnSegment(CONTROL_BYTES + nbytes, nonce_bytes(self.nonce))
        super().__init__(self._segment.area(), nbytes)

    @property
    def offer(self) -> tuple[int, int, int]:
        """(pid, fd, nonce): what a peer of this host needs to map the region (PeerRegion.open)."""
        return self._segment.pid, self._segment.fd, self.nonce

    def publish(self, *words: int, wake: bool = True) -> None:
        """Set the first len(words) words (the rest keep theirs) and, with `wake`, wake every peer
        sleeping on this region."""
        generation = int(self._generation[0])
        self._generation[0] = (generation + 1) & 0x7FFFFFFF
        self._words[:len(words)] = words
        self._generation[0] = (generation + 2) & 0x7FFFFFFF
        if wake:
            _libc.syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(self._address), ctypes.c_int(_FUTEX_WAKE),
                          ctypes.c_int(_WAKE_ALL), None, None, ctypes.c_int(0))


class PeerRegion(Region):
    """Another process's region of this host, mapped read-only."""

    def __init__(self, segment: shared_segment.PeerSegment, nbytes: int):
        self._segment = segment
        super().__init__(segment.area(), nbytes)

    @classmethod
    def open(cls, pid: int, fd: int, nonce: int, nbytes: int) -> "PeerRegion":
        """Map the region a peer offered as (pid, fd, nonce); ValueError (why) where it cannot be
        used: another host or network namespace, the process is gone, or the size or nonce differ."""
        if not supported():
            raise ValueError("no host regions on this platform")
        if not 0 < nonce < 1 << NONCE_BITS:  # (an offer comes from a peer: an absurd one is refused, not raised on)
            raise ValueError(f"a nonce outside (0, 2**{NONCE_BITS}): {nonce}")
        return cls(shared_segment.PeerSegment.open(pid, fd, CONTROL_BYTES + nbytes, nonce_bytes(nonce)), nbytes)


def nonce_bytes(nonce: int) -> bytes:
    return int(nonce).to_bytes(8, "little")


__all__ = ["OwnRegion", "PeerRegion", "Region", "supported", "CONTROL_BYTES", "NONCE_BITS", "WORDS"]
