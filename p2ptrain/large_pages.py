"""Large host tensors on 2 MiB pages (Linux transparent huge pages), where the kernel offers them.

A socket that reads 64 MB into a tensor on 4 KiB pages walks 16k page-table entries per message
(dear in a VM), where 2 MiB pages need 32: `bench transport` measured the lane's receiving side at
0.21-0.25 CPU-s/GB on 4 KiB pages and 0.12-0.14 on 2 MiB ones (raw TCP on NumPy's, which NumPy
madvises itself: 0.14-0.16). Two switches: `host_buffer` (the Inbox's receive buffers, whoever
imported torch first), and torch's own allocator switch `TORCH_SWITCH`, which processes that
p2ptrain starts (launch, bench, simulate) get on by default: every large tensor of theirs, the
model and the shares it sends included, then sits on 2 MiB pages as well.
"""
from __future__ import annotations

import mmap
from collections.abc import Mapping
from pathlib import Path

import torch

PAGE_BYTES = 2 << 20  # one transparent huge page on x86-64 and arm64 (4 KiB base pages)
TORCH_SWITCH = "THP_MEM_ALLOC_ENABLE"  # read once per process, by torch's CPU allocator
MODE_FILE = Path("/sys/kernel/mm/transparent_hugepage/enabled")  # "always [madvise] never"


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


def with_torch_switch(env: Mapping[str, str]) -> dict[str, str]:
    """`env` for a child process, with torch's huge-page allocator on unless `env` sets it."""
    return {TORCH_SWITCH: "1", **env}


__all__ = ["PAGE_BYTES", "TORCH_SWITCH", "available", "host_buffer", "with_torch_switch"]
