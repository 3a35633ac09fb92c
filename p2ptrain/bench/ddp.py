"""One rank of the torch DDP (gloo) baseline of `p2ptrain bench peers`.

Run as `python -m p2ptrain.bench.ddp` with a node's flags (the launcher starts it where it would
start `p2ptrain node`, in a network namespace too): the same settings, data shard, initial model,
optimizer, batches and evaluation as a p2ptrain node (p2ptrain.train.setup), but trained by
torch.nn.parallel.DistributedDataParallel over a gloo process group whose store is hosted by rank 0
at rank 0's node address. It writes the run folder's files as a node does (RunRecorder), so the
launcher and the benchmark read both the same way. With `--no-communication` every rank trains its
shard alone (no process group): the host's compute floor, `bench peers`' "local" row. Benchmark
code: never used to train.

Bytes per step are what gloo's ring sends per node for the gradients: 2 (n - 1) / n of them.
"""
from __future__ import annotations

import datetime
import fcntl
import ipaddress
import os
import socket
import struct
import sys
from pathlib import Path

from p2ptrain.addresses import host_of, split_address

SIOCGIFADDR = 0x8915


def interface_of(host: str) -> str:
    """The name of the local network interface holding IPv4 address `host` (gloo must use the
    interface the node's address is on: `lo` on loopback, the veth inside a namespace)."""
    if ipaddress.ip_address(host).is_loopback:
        return "lo"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address
                continue
            if socket.inet_ntoa(packed[20:24]) == host:
                return name
    raise ValueError(f"no local interface holds {host}")


def ring_bytes_per_step(model, world_size: int) -> float:
    """Payload one node sends per step in a ring all-reduce of `model`'s gradients."""
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return 2 * (world_size - 1) / world_size * grad_bytes


NO_COMMUNICATION = "--no-communication"  # (taken off the argv before the node flags are parsed)


def train(config, communicate: bool = True) -> dict:
    """Train as one DDP rank; `communicate=False`: the same loop with no process group and no
    gradient averaging (what a step costs this host when no algorithm communicates at all)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from p2ptrain.train import cycle
    from p2ptrain.train.evaluate import evaluate
    from p2ptrain.train.progress import RunRecorder, StepClock
    from p2ptrain.train.setup import build_optimizer, training_setup

    torch.set_num_threads(config.threads)
    own_host = host_of(config.listen or config.peers[config.rank])
    os.environ["GLOO_SOCKET_IFNAME"] = interface_of(own_host)
    loader, test_loader, model, device = training_setup(config)
    out = Path(config.out) if config.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    recorder = RunRecorder(out, f"node{config.rank}", rank=config.rank, log_every=config.log_every)
    try:
        if communicate:
            master_host, master_port = split_address(config.peers[0])
            dist.init_process_group("gloo", init_method=f"tcp://{master_host}:{master_port}",
                                    rank=config.rank, world_size=config.world_size,
                                    timeout=datetime.timedelta(seconds=config.peer_timeout))
        ddp = DistributedDataParallel(model) if communicate else model
        optimizer = build_optimizer(config, model)
        per_step = ring_bytes_per_step(model, config.world_size) if communicate else 0.0
        clock = StepClock()

        def evaluated(step: int) -> None:
            with clock.off_the_clock() as spent:
                test_loss, test_accuracy = evaluate(model, test_loader, device, loss_fn=F.nll_loss)
            recorder.report(step, line={"eval_seconds": spent["seconds"]}, test_loss=test_loss,
                            test_accuracy=test_accuracy)

        batches = cycle(loader)
        if communicate:
            dist.barrier()
        clock.restart()
        sent = 0.0
        for step in range(1, config.steps + 1):
            inputs, targets = next(batches)
            model.train()
            optimizer.zero_grad(set_to_none=True)
            loss = F.nll_loss(ddp(inputs.to(device)), targets.to(device))
            loss.backward()  # DDP all-reduces the gradient buckets while backward runs
            optimizer.step()
            recorder.report(step, loss=float(loss.detach()))
            sent += per_step
            seconds, cpu = clock.lap()
            recorder.step_done(step, seconds, None, cpu_seconds=cpu, bytes_sent=int(sent), bytes_received=int(sent))
            if config.eval_every and step % config.eval_every == 0 and step < config.steps:
                evaluated(step)
        evaluated(config.steps)
        flat = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
        summary = {"rank": config.rank, **recorder.summary(), "algorithm": "ddp" if communicate else "local",
                   "topology": "ring" if communicate else "none", "bytes_sent": int(sent),
                   "bytes_received": int(sent), "device": device.type}
        result = recorder.finish(summary, flat)
        if communicate:
            dist.destroy_process_group()
        return result
    except BaseException as exc:
        recorder.event("error", message=f"{type(exc).__name__}: {exc}")
        raise
    finally:
        recorder.close()


def main(argv: list[str] | None = None) -> int:
    from p2ptrain.cli.flags import node_config_from_argv

    argv = list(sys.argv[1:] if argv is None else argv)
    communicate = NO_COMMUNICATION not in argv
    argv = [arg for arg in argv if arg != NO_COMMUNICATION]
    train(node_config_from_argv("python -m p2ptrain.bench.ddp",
                                "one rank of the torch DDP (gloo) baseline of bench peers "
                                f"({NO_COMMUNICATION}: each rank alone)", argv), communicate)
    return 0

if __name__ == "__main__":
    sys.exit(main())
