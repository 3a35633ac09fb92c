"""One rank of the hivemind baseline of `p2ptrain bench peers` (needs the `hivemind` extra).

Run as `python -m p2ptrain.bench.hivemind_node` with a node's flags, where the launcher would
start `p2ptrain node`: the same data shard, initial model, optimizer, batches and evaluation
(p2ptrain.train.setup); after every local step the model is averaged with hivemind's
DecentralizedAverager (DHT matchmaking, then its butterfly all-reduce over libp2p), the way
hivemind averages models. Rank 0 starts the DHT and writes its multiaddresses into the run folder;
the others join through them. Files as a node writes them (RunRecorder). Benchmark code only.

CPU seconds count every process of the rank (the trainer, hivemind's DHT and averager processes
and their p2pd daemons). Bytes per step: what the butterfly all-reduce sends per node in a round
of g peers, 2 (g - 1) / g of the model (hivemind does not count its traffic), for rounds that ran.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from p2ptrain.addresses import host_of

MADDRS_FILE = "hivemind-rank0.maddrs"
PREFIX = "p2ptrain-bench"
MIN_MATCHMAKING_SECONDS = 1.0  # hivemind's default is 5 s; a group of all nodes forms well within 1 s here
REQUEST_TIMEOUT_SECONDS = 0.5  # must be below the matchmaking time (hivemind warns otherwise)


def tree_cpu_seconds(root: int | None = None) -> float:
    """CPU seconds (user + system) of process `root` (default this one) and all its descendants,
    from /proc (children that exited and were reaped are in the parent's cumulative fields)."""
    root = os.getpid() if root is None else root
    tick = os.sysconf("SC_CLK_TCK")
    parent, cpu = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        pid = int(entry)
        parent[pid] = int(fields[1])
        cpu[pid] = sum(int(v) for v in fields[11:15]) / tick  # utime stime cutime cstime
    total, frontier = cpu.get(root, 0.0), [root]
    children: dict[int, list[int]] = {}
    for pid, ppid in parent.items():
        children.setdefault(ppid, []).append(pid)
    while frontier:
        for child in children.get(frontier.pop(), ()):
            total += cpu.get(child, 0.0)
            frontier.append(child)
    return total


def _join_dht(config, out: Path, host: str):
    import hivemind

    listen = [f"/ip4/{host}/tcp/0"]
    maddrs_path = out / MADDRS_FILE
    if config.rank == 0:
        dht = hivemind.DHT(start=True, host_maddrs=listen)
        tmp = maddrs_path.with_suffix(".tmp")
        tmp.write_text("\n".join(str(a) for a in dht.get_visible_maddrs()))
        tmp.rename(maddrs_path)
        return dht
    deadline = time.monotonic() + config.peer_timeout
    while not maddrs_path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 published no DHT address in {maddrs_path} within {config.peer_timeout} s")
        time.sleep(0.1)
    return hivemind.DHT(start=True, host_maddrs=listen, initial_peers=maddrs_path.read_text().split())


def _wait_for_everyone(dht, rank: int, world_size: int, timeout: float) -> None:
    """A barrier through the DHT, so the first averaging round finds every node."""
    from hivemind.utils import get_dht_time

    deadline = time.monotonic() + timeout
    while True:
        dht.store(f"{PREFIX}-ready", subkey=rank, value=True, expiration_time=get_dht_time() + timeout)
        found = dht.get(f"{PREFIX}-ready", latest=True)
        if found is not None and len(found.value) >= world_size:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {0 if found is None else len(found.value)} of {world_size} nodes joined the DHT")
        time.sleep(0.2)


def train(config) -> dict:
    import hivemind
    import torch
    import torch.nn.functional as F

    from p2ptrain.train import cycle
    from p2ptrain.train.evaluate import evaluate
    from p2ptrain.train.progress import RunRecorder, StepClock
    from p2ptrain.train.setup import build_optimizer, training_setup

    torch.set_num_threads(config.threads)
    host = host_of(config.listen or config.peers[config.rank])
    loader, test_loader, model, device = training_setup(config)
    optimizer = build_optimizer(config, model)
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    recorder = RunRecorder(out, f"node{config.rank}", rank=config.rank, log_every=config.log_every)
    dht = averager = None
    try:
        dht = _join_dht(config, out, host)
        params = list(model.parameters())
        flat = torch.nn.utils.parameters_to_vector(params).detach().clone()
        averager = hivemind.DecentralizedAverager(
            [flat], dht, start=True, prefix=PREFIX, target_group_size=config.world_size,
            min_matchmaking_time=MIN_MATCHMAKING_SECONDS, request_timeout=REQUEST_TIMEOUT_SECONDS,
            allreduce_timeout=config.link_deadline)  # without it, a round whose peer stalls hangs for good
        _wait_for_everyone(dht, config.rank, config.world_size, config.peer_timeout)
        model_bytes = flat.numel() * flat.element_size()
        clock = StepClock(cpu=tree_cpu_seconds)

        def evaluated(step: int) -> None:
            with clock.off_the_clock() as spent:
                test_loss, test_accuracy = evaluate(model, test_loader, device, loss_fn=F.nll_loss)
            recorder.report(step, line={"eval_seconds": spent["seconds"]}, test_loss=test_loss,
                            test_accuracy=test_accuracy)

        batches = cycle(loader)
        sent, rounds, failed = 0.0, 0, 0
        clock.restart()
        for step in range(1, config.steps + 1):
            inputs, targets = next(batches)
            model.train()
            optimizer.zero_grad(set_to_none=True)
            loss = F.nll_loss(model(inputs.to(device)), targets.to(device))
            loss.backward()
            optimizer.step()
            recorder.report(step, loss=float(loss.detach()))
            with torch.no_grad(), averager.get_tensors() as tensors:
                tensors[0].copy_(torch.nn.utils.parameters_to_vector(params))
            try:
                group = averager.step(timeout=config.link_deadline)
            except Exception as exc:  # "could not find a group" (a slow peer): this step keeps the local model
                print(f"node {config.rank}: step {step}: averaging failed: {exc}", file=sys.stderr, flush=True)
                group = None
            if group:
                rounds += 1
                sent += 2 * (len(group) - 1) / len(group) * model_bytes
                with torch.no_grad(), averager.get_tensors() as tensors:
                    torch.nn.utils.vector_to_parameters(tensors[0], params)
            else:
                failed += 1
            seconds, cpu = clock.lap()
            recorder.step_done(step, seconds, None, cpu_seconds=cpu, bytes_sent=int(sent), bytes_received=int(sent))
            if config.eval_every and step % config.eval_every == 0 and step < config.steps:
                evaluated(step)
        evaluated(config.steps)
        summary = {"rank": config.rank, **recorder.summary(), "algorithm": "hivemind", "topology": "butterfly",
                   "bytes_sent": int(sent), "bytes_received": int(sent), "device": device.type,
                   "averaging_rounds": rounds, "failed_rounds": failed}
        return recorder.finish(summary, torch.nn.utils.parameters_to_vector(params).detach())
    except BaseException as exc:
        recorder.event("error", message=f"{type(exc).__name__}: {exc}")
        raise
    finally:
        recorder.close()
        if averager is not None:
            averager.shutdown()
        if dht is not None:
            dht.shutdown()


def main(argv: list[str] | None = None) -> int:
    from p2ptrain.cli.flags import node_config_from_argv

    train(node_config_from_argv("python -m p2ptrain.bench.hivemind_node",
                                "one rank of the hivemind baseline of bench peers", argv))
    return 0

if __name__ == "__main__":
    sys.exit(main())
