"""Large host tensors on 2 MiB pages (p2ptrain/large_pages.py): the receive buffers the lane reads
into and the algorithms send from."""
from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from p2ptrain.algorithms.base import buffer_like
from p2ptrain.large_pages import PAGE_BYTES, available, empty, host_buffer, zeros
from p2ptrain.transport.inbox import BufferPool

THP = pytest.mark.skipif(not available(), reason="transparent huge pages are off on this machine")


def huge_kib_of(address: int) -> int:
    """AnonHugePages (KiB) of the mapping of this process that holds `address`."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def mappings() -> int:
    return len(Path("/proc/self/maps").read_text().splitlines())


@THP
def test_a_large_host_buffer_starts_on_a_2mib_boundary_and_is_backed_by_huge_pages():
    buffer = host_buffer(4 * PAGE_BYTES + 12345)
    assert buffer.dtype == torch.uint8 and buffer.numel() == 4 * PAGE_BYTES + 12345 and buffer.is_contiguous()
    assert buffer.data_ptr() % PAGE_BYTES == 0
    values = buffer[:4 * PAGE_BYTES].view(torch.float32)
    values.copy_(torch.arange(values.numel(), dtype=torch.float32))  # (touched: pages are now backed)
    assert huge_kib_of(buffer.data_ptr()) >= PAGE_BYTES // 1024
    assert values[12345].item() == 12345.0 and buffer.numpy().shape == (buffer.numel(),)


def test_small_buffers_are_plain_and_nothing_is_left_mapped_once_buffers_are_gone():
    small = host_buffer(PAGE_BYTES - 1)
    assert small.numel() == PAGE_BYTES - 1 and small.dtype == torch.uint8
    before = mappings()
    for _ in range(40):
        host_buffer(3 * PAGE_BYTES).fill_(1)
    gc.collect()
    assert mappings() <= before + 2  # each mapping went with its tensor


@THP
def test_the_inboxs_pool_hands_out_receive_buffers_on_huge_pages_and_takes_them_back():
    pool = BufferPool()
    buffer = pool.acquire(3 * PAGE_BYTES)
    assert buffer.data_ptr() % PAGE_BYTES == 0 and buffer.numel() == 3 * PAGE_BYTES
    pool.release(buffer)
    assert pool.acquire(3 * PAGE_BYTES) is buffer


@THP
def test_algorithm_send_buffers_and_flat_gradients_are_on_huge_pages_and_small_ones_are_plain():
    model = torch.zeros(3, PAGE_BYTES // 4)  # float32: 3 pages
    share = buffer_like(model)
    assert share.shape == model.shape and share.dtype == model.dtype and share.data_ptr() % PAGE_BYTES == 0
    grads = zeros(PAGE_BYTES, torch.float64)
    assert grads.data_ptr() % PAGE_BYTES == 0 and grads.numel() == PAGE_BYTES and not grads.any()
    small = buffer_like(torch.zeros(5, 7, dtype=torch.float16))
    assert small.shape == (5, 7) and small.dtype == torch.float16
    assert empty(10, torch.int64).dtype == torch.int64 and empty(10, torch.int64, "cpu").numel() == 10
    non_contiguous = buffer_like(model.t())
    assert non_contiguous.shape == (PAGE_BYTES // 4, 3) and non_contiguous.is_contiguous()


def test_a_mode_file_that_is_missing_or_says_never_means_no_huge_pages(tmp_path):
    mode = tmp_path / "enabled"
    assert not available(mode)
    mode.write_text("always madvise [never]\n")
    assert not available(mode)
    mode.write_text("always [madvise] never\n")
    assert available(mode)
