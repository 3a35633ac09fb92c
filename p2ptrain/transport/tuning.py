"""Process-level tuning for bulk tensor transfer.

Measured with `python -m benchmarks.grpc_study`: with glibc's default dynamic mmap threshold,
every MiB-sized buffer gRPC and Python allocate per chunk is mmapped, page-faulted and zeroed
afresh; keeping such buffers in the heap doubles to triples gRPC throughput on loopback.
"""
from __future__ import annotations

import sys

MALLOPT_MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's maximum for M_MMAP_THRESHOLD
MALLOPT_TRIM_THRESHOLD = 1 << 30
_tuned = False


def tune_malloc(mmap_threshold: int = MALLOPT_MMAP_THRESHOLD, trim_threshold: int = MALLOPT_TRIM_THRESHOLD) -> bool:
    """Stop glibc malloc from returning freed MiB-sized buffers to the kernel.

    By default glibc serves allocations >= 128 KiB with mmap (dynamic threshold)
    and trims the heap top once more than 2x that is free, so every
    MiB-sized message buffer that grpc / Python allocates is freshly page
    faulted and zeroed by the kernel.  Raising both thresholds keeps the
    memory in the heap and makes those buffers reusable.  Same effect as
    ``MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=1073741824`` in
    the environment at process start.  Returns False where unavailable.
    """
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        ok = libc.mallopt(m_mmap_threshold, int(mmap_threshold)) == 1
        ok &= libc.mallopt(m_trim_threshold, int(trim_threshold)) == 1
        return bool(ok)
    except (OSError, AttributeError):
        return False


def tune_process_for_transfer() -> bool:
    """Apply tune_malloc() once per process (the Transport calls this on start)."""
    global _tuned
    if not _tuned:
        _tuned = tune_malloc()
    return _tuned
