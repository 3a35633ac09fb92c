"""Data shards that follow the membership: the training set is split among the members of the
moment, not among the ranks a run started with.

Why: a shard fixed by rank loses the data of every member that leaves or is dropped, and a joiner
(which reuses a starting rank's shard) trains on data another member already has. After five
leaves and three joins of a 6-node chaos run, the four members left held 3 of the 6 shards, one of
them twice, and DiLoCo's accuracy fell from 0.91 to 0.894 as they trained on. torchrun's elastic
restarts re-shard the same way (a DistributedSampler over the new world size).

Faithful: fault-free, the members are every rank of the world and never change, so a node's
batches are exactly those of its fixed shard (the same loader, the same generator).
"""
from __future__ import annotations

from typing import Callable, Iterable, Iterator, Sequence

from torch.utils.data import TensorDataset

from p2ptrain.train.data import node_shard


class MemberShards:
    """A loader of this node's part of `dataset`: part `position` of `len(members)`, where
    `members()` says who trains together now and `position` is this rank's place among them (while
    this node is no member, e.g. a joiner being admitted, the part it had, at first
    `rank % world_size`'s). Each iteration is one epoch of the current part; it ends early when the
    members change, so the next one (`cycle`) is over the new part. `loader(shard)` makes a
    shuffling loader of a shard (an iterable of batches, one epoch per iteration: ShuffledBatches,
    or a DataLoader); `reshards` counts the changes."""

    def __init__(self, dataset: TensorDataset, rank: int, world_size: int, *,
                 members: Callable[[], Sequence[int]], loader: Callable[[TensorDataset], Iterable],
                 seed: int = 0):
        self.dataset, self.rank, self.world_size, self.seed = dataset, rank, world_size, seed
        self.members, self.loader = members, loader
        self.part: tuple[int, int] | None = None  # (position, count) of the part in use
        self.reshards = 0
        self._epochs: Iterable | None = None

    def current_part(self) -> tuple[int, int]:
        """(position, count): the part of the data set this node should train on now."""
        members = sorted(set(self.members()))
        if self.rank not in members:
            return self.part or (self.rank % self.world_size, self.world_size)
        return members.index(self.rank), len(members)

    def __iter__(self) -> Iterator:
        part = self.current_part()
        if part != self.part or self._epochs is None:
            self.reshards += self.part is not None
            self.part = part
            self._epochs = self.loader(node_shard(self.dataset, *part, seed=self.seed))
        for batch in self._epochs:
            yield batch
            if self.current_part() != self.part:
                return


__all__ = ["MemberShards"]
