"""One real node process for the push-sum averaging tests (tests/test_sgp.py).

Runs SGP with a zero gradient (learning rate 0) over real gRPC: the model update is the identity,
so the trace of (w, z) per step must follow the exact push-sum matrix recursion. Each experiment in
the JSON spec runs on its own set of ports; the trace goes to OUT/trace_{name}_{rank}.pt.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from p2ptrain.algorithms import SGP
from p2ptrain.communicator import Communicator
from p2ptrain.topology import build_topology
from p2ptrain.transport import Transport


def initial_vector(rank: int, dim: int, seed: int = 1234) -> torch.Tensor:
    return torch.randn(dim, generator=torch.Generator().manual_seed(seed + rank), dtype=torch.float64)


def run(rank: int, spec: dict, out: Path) -> None:
    torch.set_num_threads(1)
    for exp in spec["experiments"]:
        n = exp["world_size"]
        peers = [f"127.0.0.1:{p}" for p in exp["ports"]]
        topology = build_topology(exp["topology"], n, peers_per_step=exp.get("peers_per_step", 1),
                                  seed=exp.get("seed", 0))
        with Transport(rank, n, peers) as transport:
            transport.membership.wait_for_peers(timeout=60)
            sgp = SGP(Communicator(transport, peer_timeout=60), topology, overlap=exp["overlap"])
            z = sgp.setup(initial_vector(rank, exp["dim"]))
            ws, zs = [], []
            for step in range(exp["steps"]):
                z = sgp.after_step(step, z.clone())  # lr = 0: the local update changes nothing
                ws.append(sgp.w)
                zs.append(z.clone())
            z = sgp.finish()
            torch.save({"w": ws, "z": torch.stack(zs), "final_w": sgp.w, "final_z": z.clone()},
                       out / f"trace_{exp['name']}_{rank}.pt")


if __name__ == "__main__":
    run(int(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text()), Path(sys.argv[3]))
