"""Long-lived host buffers on 2 MiB pages (Linux transparent huge pages), where the kernel offers them.

A socket that reads 64 MB into a tensor on 4 KiB pages walks 16k page-table entries per message
(dear in a VM), where 2 MiB pages need 32: `bench transport` measured the lane's receiving side at
0.21-0.23 CPU-s/GB on 4 KiB pages and 0.16-0.18 on 2 MiB ones. So the buffers that sockets copy
into and out of every step come from here: the Inbox's receive buffers, the algorithms' send
buffers (`buffer_like`) and the flat gradients the rings reduce. torch's own switch for every large
tensor of a process (THP_MEM_ALLOC_ENABLE=1) did not pay in `bench peers` (docs/benchmarks.md): a
step's temporaries are freed and faulted in again each step.
"""
from __future__ import annotations

import mmap
from pathlib import Path

import torch

PAGE_BYTES = 2 << 20  # one transparent huge page on x86-64 and arm64 (4 KiB base pages)
MODE_FILE = Path("/sys/kernel/mm/transparent_hugepage/enabled")  # e.g. "always [madvise] never"


def available(mode_file: Path = MODE_FILE) -> bool:
    """Whether asking for huge pages can get them: THP in `always` or `madvise` mode."""
    try:
        mode = mode_file.read_text()
    except OSError:
        return False
    return hasattr(mmap, "MADV_HUGEPAGE") and ("[always]" in mode or "[madvise]" in mode)


_AVAILABLE = available()


def host_buffer(nbytes: int) -> torch.Tensor:
    """An uninitialized uint8 CPU tensor of `nbytes`; from PAGE_BYTES up it starts on a 2 MiB
    boundary of a private mapping madvised for huge pages (freed with its last view), elsewhere
    and where THP is off it is torch.empty's."""
    if nbytes < PAGE_BYTES or not _AVAILABLE:
        return torch.empty(nbytes, dtype=torch.uint8)
    try:
        region = mmap.mmap(-1, nbytes + PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:
        return torch.empty(nbytes, dtype=torch.uint8)
    whole = torch.frombuffer(region, dtype=torch.uint8)  # (keeps `region` alive as long as any view)
    start = -whole.data_ptr() % PAGE_BYTES
    try:
        region.madvise(mmap.MADV_HUGEPAGE, start, nbytes - nbytes % PAGE_BYTES)
    except OSError:  # (a kernel that refuses: 4 KiB pages, as torch.empty's)
        pass
    return whole[start:start + nbytes]


def empty(numel: int, dtype: torch.dtype, device: torch.device | str | None = None) -> torch.Tensor:
    """torch.empty(numel, dtype=dtype, device=device), on 2 MiB pages where it is a large CPU tensor
    (device None: the CPU)."""
    if device is not None and torch.device(device).type != "cpu":
        return torch.empty(numel, dtype=dtype, device=device)
    return host_buffer(numel * dtype.itemsize).view(dtype)


def zeros(numel: int, dtype: torch.dtype, device: torch.device | str | None = None) -> torch.Tensor:
    """torch.zeros(numel, ...), on 2 MiB pages where it is a large CPU tensor."""
    return empty(numel, dtype, device).zero_()


def empty_like(tensor: torch.Tensor) -> torch.Tensor:
    """torch.empty_like(tensor), contiguous, on 2 MiB pages where it is a large CPU tensor."""
    if tensor.device.type != "cpu" or tensor.layout != torch.strided or tensor.is_quantized:
        return torch.empty_like(tensor)
    return empty(tensor.numel(), tensor.dtype).view(tensor.shape)


__all__ = ["MODE_FILE", "PAGE_BYTES", "available", "empty", "empty_like", "host_buffer", "zeros"]
