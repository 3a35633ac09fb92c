"""The built-in training's data follows the membership (p2ptrain/train/member_shards.py): fault-free
a node's batches are its fixed shard's, batch for batch; after leaves and joins the members'
parts cover the whole training set once; a node outside the members keeps the part it had."""
from __future__ import annotations

import itertools

import torch
from torch.utils.data import DataLoader, TensorDataset

from p2ptrain.train.data import node_shard
from p2ptrain.train.member_shards import MemberShards
from p2ptrain.train.trainer import cycle

DATA = TensorDataset(torch.arange(1000, dtype=torch.float32)[:, None], torch.arange(1000))


def loader_for(rank: int):
    generator = torch.Generator().manual_seed(7 + rank)
    return lambda shard: DataLoader(shard, batch_size=16, shuffle=True, drop_last=True, generator=generator)


def labels(batches, count: int) -> list[int]:
    return [int(i) for _, y in itertools.islice(batches, count) for i in y]


def test_fault_free_batches_are_exactly_the_fixed_shards():
    for rank in range(4):
        fixed = cycle(loader_for(rank)(node_shard(DATA, rank, 4, seed=3)))
        shards = MemberShards(DATA, rank, 4, members=lambda: (0, 1, 2, 3), loader=loader_for(rank), seed=3)
        assert labels(cycle(shards), 200) == labels(fixed, 200)  # 200 batches: several epochs
        assert shards.reshards == 0


def test_after_leaves_and_joins_the_members_parts_cover_the_data_once():
    members = [0, 1, 2, 3]
    nodes = {rank: MemberShards(DATA, rank, 4, members=lambda: members, loader=loader_for(rank), seed=3)
             for rank in range(6)}
    streams = {rank: cycle(shards) for rank, shards in nodes.items()}
    for rank in members:
        next(streams[rank])
    members[:] = [1, 3, 4, 5]  # 0 and 2 left, 4 and 5 joined (with fixed shards: 4 and 5 reuse 0's and 1's)
    seen = {rank: set(labels(streams[rank], 200)) for rank in members}
    assert set().union(*seen.values()) == set(range(1000))  # every sample trained on by someone
    assert all(not (seen[a] & seen[b]) for a, b in itertools.combinations(members, 2))
    assert [nodes[r].part for r in members] == [(0, 4), (1, 4), (2, 4), (3, 4)]
    assert all(nodes[r].reshards == 1 for r in (1, 3))


def test_a_node_outside_the_members_keeps_its_part_and_a_joiner_starts_on_its_ranks():
    members = [0, 1, 2]
    joiner = MemberShards(DATA, 5, 3, members=lambda: members, loader=loader_for(5))
    assert joiner.current_part() == (2, 3)  # rank 5 of a 3-rank start: part 5 % 3, until admitted
    member = MemberShards(DATA, 1, 3, members=lambda: members, loader=loader_for(1))
    stream = cycle(member)
    next(stream)
    members[:] = [0, 2]  # node 1 dropped (it is being declared dead, say): it trains on what it had
    assert labels(stream, 3) and member.part == (1, 3) and member.reshards == 0
