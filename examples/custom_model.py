"""Decentralized training of your own torch model, optimizer and data loader with p2ptrain.

Each process is one node. Here we start 3 of them on loopback with multiprocessing; on real hosts
run the same `train_node` on every machine with its rank and the list of peer addresses.

    python examples/custom_model.py            # 3 local nodes, SGP with overlap τ = 1
"""
from __future__ import annotations

import multiprocessing as mp
import socket
import sys

import torch
import torch.nn.functional as F
from torch import nn

from p2ptrain import NodeConfig
from p2ptrain.node import Node
from p2ptrain.train import DecentralizedTrainer, cycle


def my_data(rank: int, world_size: int):
    """Any DataLoader works; here a toy regression task, a different slice per node."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 16, generator=g)
    y = x @ torch.linspace(-1, 1, 16) + 0.1 * torch.randn(4096, generator=g)
    shard = torch.utils.data.TensorDataset(x[rank::world_size], y[rank::world_size])
    return torch.utils.data.DataLoader(shard, batch_size=64, shuffle=True)


def train_node(rank: int, peers: list[str], steps: int = 200) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)  # every node starts from the same model
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1), nn.Flatten(0))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    config = NodeConfig(rank=rank, world_size=len(peers), peers=peers, algorithm="sgp",
                        topology="exponential", options={"overlap": 1})
    with Node(config) as node:
        trainer = DecentralizedTrainer(model, optimizer, node.algorithm(), loss_fn=F.mse_loss, comm=node.comm)
        result = trainer.fit(cycle(my_data(rank, len(peers))), steps, log_every=50,
                             on_log=lambda rec, _: print(f"node {rank} step {rec.step} loss {rec.loss:.4f}"))
    print(f"node {rank}: final loss {result.final_loss:.4f}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    peers = [f"127.0.0.1:{free_port()}" for _ in range(n)]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=train_node, args=(r, peers)) for r in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    sys.exit(max(p.exitcode for p in procs))
