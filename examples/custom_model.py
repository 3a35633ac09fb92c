"""Decentralized training of your own torch model, optimizer and loop with p2ptrain.

Each process is one node. Run it under the launcher, which starts N copies and tells each its rank
and its peers (RANK, WORLD_SIZE, P2PTRAIN_PEERS, ...):

    p2ptrain launch --nodes 3 --algorithm sgp --overlap 1 -- python examples/custom_model.py

or on its own (`python examples/custom_model.py 3`), when it starts 3 local nodes itself with
multiprocessing. The three p2ptrain lines are marked.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import socket
import sys

import torch
import torch.nn.functional as F
from torch import nn

import p2ptrain


def my_data(rank: int, world_size: int):
    """Any DataLoader works; here a toy regression task, a different slice per node."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 16, generator=g)
    y = x @ torch.linspace(-1, 1, 16) + 0.1 * torch.randn(4096, generator=g)
    shard = torch.utils.data.TensorDataset(x[rank::world_size], y[rank::world_size])
    return torch.utils.data.DataLoader(shard, batch_size=64, shuffle=True)


def train(**settings) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)  # every node starts from the same model
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1), nn.Flatten(0))
    with p2ptrain.init(**settings) as node:                                                    # p2ptrain 1/3
        steps = node.config.steps  # --steps of `p2ptrain launch`, or the settings given here
        opt = p2ptrain.DecentralizedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                              model=model, node=node)                          # p2ptrain 2/3
        data = iter(())
        for step in range(opt.local_step, steps):  # (a restarted node rejoins at a live peer's step)
            try:
                x, y = next(data)
            except StopIteration:
                data = iter(my_data(node.rank, node.world_size))
                x, y = next(data)
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            node.report(step + 1, loss=loss.item())                                           # p2ptrain 3/3
            if (step + 1) % 50 == 0:
                print(f"node {node.rank} step {step + 1} loss {loss.item():.4f}")
        opt.finish()
        print(f"node {node.rank}: final loss {node.summary()['final_loss']:.4f}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    if "RANK" in os.environ:  # started by `p2ptrain launch` (or torchrun): it set everything
        train()
    else:
        n = int(sys.argv[1]) if len(sys.argv) > 1 else 3
        peers = ",".join(f"127.0.0.1:{free_port()}" for _ in range(n))
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=train, kwargs=dict(rank=r, world_size=n, peers=peers, algorithm="sgp",
                                                      overlap=1, steps=200)) for r in range(n)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        sys.exit(max(p.exitcode for p in procs))
