"""Shared memory for a lane connection between two processes of one host: the payload's bytes go
through a sealed memfd the sender maps and the receiver maps read-only, instead of through the
kernel's TCP stack (on loopback that is two copies and a socket's worth of CPU per byte; here one
copy in and one out). The lane's frames, Acks and checks stay on the connection: only where the
payload bytes travel changes, and only for a payload that fits the segment.

The receiver finds the segment at /proc/PID/fd/FD, takes it only from a process of its own network
namespace (a namespace is a host to the lane: tc shaping and NAT tests stay honest), only with the
seals that keep its size fixed (a shrunk mapping would SIGBUS the reader) and only when it holds the
nonce the sender announced. Anything else: the payloads travel over TCP, as before.
"""
from __future__ import annotations

import fcntl
import logging
import mmap
import os

import numpy

log = logging.getLogger(__name__)

HEADER_BYTES = 64          # the nonce, then the payload area, cache-line aligned
MIN_PAYLOAD_BYTES = 1 << 20
# The largest segment: a connection's segment is a copy of what it carries, so a model of gigabytes
# would hold one per pooled connection; larger payloads go over TCP
MAX_PAYLOAD_BYTES = 256 << 20
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def supported() -> bool:
    """memfd with seals and /proc: Linux."""
    return hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")


def capacity_for(payload_bytes: int) -> int:
    """The payload area of a segment first used for a `payload_bytes` message: at least that,
    rounded up to whole MiB (a peer pair carries messages of about one size), at most
    MAX_PAYLOAD_BYTES."""
    wanted = min(max(payload_bytes, MIN_PAYLOAD_BYTES), MAX_PAYLOAD_BYTES)
    return -(-wanted // MIN_PAYLOAD_BYTES) * MIN_PAYLOAD_BYTES


class OwnSegment:
    """The sender's side: a sealed memfd holding `nonce`, mapped for writing. Offer (pid, fd,
    capacity, nonce) to the receiver; close_fd() once it answered (its mapping stays)."""

    def __init__(self, capacity: int, nonce: bytes):
        if len(nonce) > HEADER_BYTES:
            raise ValueError(f"a nonce of at most {HEADER_BYTES} bytes, got {len(nonce)}")
        self.capacity = capacity
        self.nonce = nonce
        self.pid = os.getpid()
        self.fd = os.memfd_create("p2ptrain-lane", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, HEADER_BYTES + capacity)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SEALS)
            self._map = mmap.mmap(self.fd, HEADER_BYTES + capacity)
        except BaseException:
            os.close(self.fd)
            raise
        self._view = memoryview(self._map)
        self._view[:len(nonce)] = nonce
        self._array = numpy.frombuffer(self._view, numpy.uint8)

    def write(self, payload: memoryview) -> None:
        """Put a message's payload (at most `capacity` bytes) into the segment."""
        if self._view is None:
            raise ConnectionError("the lane connection's shared memory is closed")
        data = numpy.frombuffer(payload, numpy.uint8)  # (numpy copies without the GIL: the loop's
        numpy.copyto(self._array[HEADER_BYTES:HEADER_BYTES + data.size], data)  # training thread runs on)

    def area(self) -> numpy.ndarray:
        """The payload area as bytes, writable (host_memory.py lays its own words out there)."""
        return self._array[HEADER_BYTES:]

    def close_fd(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def close(self) -> None:
        self.close_fd()
        if self._view is not None:
            self._array = None
            self._view.release()
            self._view = None
            self._map.close()


class PeerSegment:
    """The receiver's side: the sender's segment, mapped read-only."""

    def __init__(self, mapping: mmap.mmap, capacity: int):
        self.capacity = capacity
        self._map = mapping
        self._view = memoryview(mapping)
        self._array = numpy.frombuffer(self._view, numpy.uint8)

    @classmethod
    def open(cls, pid: int, fd: int, capacity: int, nonce: bytes) -> "PeerSegment":
        """Map the segment process `pid` offers as its `fd`; ValueError (why) where it cannot be used."""
        if pid <= 0 or fd < 0 or not 0 < capacity <= 1 << 40 or not nonce or len(nonce) > HEADER_BYTES:
            raise ValueError(f"a malformed offer (pid {pid}, fd {fd}, {capacity} bytes, {len(nonce)}-byte nonce)")
        try:
            if os.readlink(f"/proc/{pid}/ns/net") != os.readlink("/proc/self/ns/net"):
                raise ValueError(f"process {pid} is in another network namespace")
            descriptor = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise ValueError(f"not reachable here: {exc.strerror or exc}") from None
        try:
            if fcntl.fcntl(descriptor, fcntl.F_GET_SEALS) & SEALS != SEALS:
                raise ValueError("its size is not sealed")
            if os.fstat(descriptor).st_size != HEADER_BYTES + capacity:
                raise ValueError(f"it holds {os.fstat(descriptor).st_size} bytes, not {HEADER_BYTES + capacity}")
            mapping = mmap.mmap(descriptor, HEADER_BYTES + capacity, prot=mmap.PROT_READ)
        except OSError as exc:
            raise ValueError(f"it cannot be mapped: {exc.strerror or exc}") from None
        finally:
            os.close(descriptor)
        if mapping[:len(nonce)] != nonce:
            mapping.close()
            raise ValueError("it does not hold the announced nonce")
        return cls(mapping, capacity)

    def area(self) -> numpy.ndarray:
        """The payload area as bytes, read-only."""
        return self._array[HEADER_BYTES:]

    def read_into(self, destination: memoryview, nbytes: int) -> None:
        """Copy the current message's `nbytes` (at most `capacity`) into `destination`."""
        numpy.copyto(numpy.frombuffer(destination, numpy.uint8, nbytes),
                     self._array[HEADER_BYTES:HEADER_BYTES + nbytes])  # (without the GIL)

    def close(self) -> None:
        if self._view is not None:
            self._array = None
            self._view.release()
            self._view = None
            self._map.close()


__all__ = ["OwnSegment", "PeerSegment", "capacity_for", "supported", "HEADER_BYTES", "MAX_PAYLOAD_BYTES",
           "MIN_PAYLOAD_BYTES"]
