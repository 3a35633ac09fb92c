"""Shuffled mini-batches of a TensorDataset by indexing its tensors, batch for batch what
torch's DataLoader(shuffle=True, generator=g) yields, at a fraction of its cost.

DataLoader fetches a batch sample by sample and stacks them (default_collate): for the 32-sample
batches of the 4-node benchmark that was 0.34 ms of the training thread's ~5.5 ms per step. Here
a batch is one index per tensor. The random draws are DataLoader's, in its order (its iterator's
base seed, the sampler's permutation, and the permutation the sampler draws when it runs out), so
the generator ends every epoch where DataLoader's would, and a run's batches do not change
(tests/test_data.py compares them).
"""
from __future__ import annotations

from typing import Iterator

import torch
from torch.utils.data import TensorDataset


class ShuffledBatches:
    """Re-iterable: each iteration is one epoch in a new order (drop_last: no short last batch);
    `pin_memory` pins each batch (CUDA training: asynchronous host-to-device copies)."""

    def __init__(self, dataset: TensorDataset, batch_size: int, *, generator: torch.Generator,
                 drop_last: bool = False, pin_memory: bool = False):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.generator = generator
        self.drop_last = drop_last
        self.pin_memory = pin_memory

    def __len__(self) -> int:
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        # DataLoader's iterator draws its workers' base seed when it is made, also with no workers
        torch.empty((), dtype=torch.int64).random_(generator=self.generator)
        return self._epoch()

    def _epoch(self) -> Iterator[tuple[torch.Tensor, ...]]:
        n, size = len(self.dataset), self.batch_size
        order = torch.randperm(n, generator=self.generator)
        for start in range(0, n, size):
            if start + size > n:  # a short last batch: the sampler ran out (and drew) before it
                self._remainder_draw(n)
                if self.drop_last:
                    return
            index = order[start:start + size]
            batch = tuple(tensor[index] for tensor in self.dataset.tensors)
            yield tuple(t.pin_memory() for t in batch) if self.pin_memory else batch
        if n % size == 0:
            self._remainder_draw(n)

    def _remainder_draw(self, n: int) -> None:
        torch.randperm(n, generator=self.generator)  # RandomSampler's permutation for its remainder (none)


__all__ = ["ShuffledBatches"]
