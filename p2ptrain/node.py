"""A p2ptrain node: transport thread, metrics endpoint and algorithm, wired from a NodeConfig.

`Node` is the reusable piece (also for the Python API); `run_node` is what `p2ptrain node` runs:
it adds the built-in data sets and models and writes the progress / summary / snapshot files
the launcher reads.
"""
from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

import torch

from p2ptrain.algorithms import Algorithm, build_algorithm
from p2ptrain.config import NodeConfig
from p2ptrain.metrics import NodeMetrics
from p2ptrain.train import DecentralizedTrainer, StepRecord, cycle, pick_device
from p2ptrain.train.loop import NonFiniteError
from p2ptrain.transport import Transport, TransportOptions
from p2ptrain.transport.communicator import Communicator
from p2ptrain.transport.runtime import PeerError

log = logging.getLogger(__name__)


class NoClusterToRejoin(PeerError):
    """A restarted node found no live peer: the cluster has finished (or is unreachable)."""


class Node:
    """Owns the transport (server + client pool on its loop thread) and the metrics server."""

    def __init__(self, config: NodeConfig, device: torch.device | None = None):
        self.config = config.validate()
        self.device = device or pick_device(config.device)
        self.metrics = NodeMetrics(config.rank, algorithm=config.algorithm)
        peers = config.peers or ["127.0.0.1:0"]
        self.transport = Transport(
            config.rank, config.world_size, peers, listen=config.listen,
            options=TransportOptions(chunk_bytes=config.chunk_bytes, step_window=config.step_window,
                                     send_timeout=config.peer_timeout, link_deadline=config.link_deadline,
                                     pin_memory=self.device.type == "cuda", links=config.link_table(),
                                     security=config.security(), relay_routes=tuple(config.relay_routes),
                                     relays=config.relays, relay_retry_after=config.relay_retry_after,
                                     max_lag=config.resolved_max_lag),
            metrics=self.metrics, config_fingerprint=config.fingerprint())
        self.comm = Communicator(self.transport, self.device, peer_timeout=config.peer_timeout)
        self.metrics_port: int | None = None
        self._metrics_server = None

    def start(self, wait_for_peers: bool = True) -> "Node":
        self.transport.start()
        if self.config.metrics_port is not None:
            server, _ = self.metrics.serve(self.config.metrics_port, addr=self.config.metrics_bind_host)
            self._metrics_server = server
            self.metrics_port = server.server_port
        if self.config.world_size > 1:
            survey = self.transport.survey()
            if self.config.rejoin and not survey.reachable:
                raise NoClusterToRejoin(f"node {self.config.rank}: no live peer to rejoin: the cluster has finished "
                                        "(or is unreachable)")
            if survey.running:
                self.comm.joining = True  # a restarted node: its peers train on; fetch state, don't wait for all
                log.info("node %d: the cluster is already training; rejoining", self.config.rank)
                return self
        if wait_for_peers and self.config.world_size > 1:
            self.transport.wait_for_peers(timeout=self.config.peer_timeout)
        return self

    def stop(self) -> None:
        self.transport.stop()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server = None

    def __enter__(self) -> "Node":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def algorithm(self) -> Algorithm:
        """The configured algorithm, bound to this node's communicator."""
        cfg = self.config
        return build_algorithm(cfg.algorithm, self.comm, topology=cfg.resolved_topology, overlap=cfg.overlap,
                               peers_per_step=cfg.peers_per_step, seed=cfg.seed, average=cfg.average,
                               compression=cfg.compression, warmup=cfg.warmup_steps)


class ProgressWriter:
    """Appends the launcher's progress lines (JSON per line, flushed) to OUT/node{rank}.progress.jsonl."""

    def __init__(self, out: Path | None, rank: int):
        self.rank = rank
        self._file = open(out / f"node{rank}.progress.jsonl", "a", buffering=1) if out else None

    def write(self, **record) -> None:
        if self._file is not None:
            self._file.write(json.dumps({"rank": self.rank, **record}, allow_nan=True) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def training_setup(config: NodeConfig):
    """(train loader of this rank's shard, test loader, model on its device, device): the same for
    every role, so peers, parameter-server workers and the proxy train on identical data/models."""
    from p2ptrain.train.data import build_dataset, node_shard
    from p2ptrain.train.models import build_model

    splits = build_dataset(config.dataset, config.data_dir, seed=config.seed,
                           num_train=config.num_train, num_test=config.num_test)
    if config.dirichlet_alpha is None:
        shard = node_shard(splits.train, config.rank, config.world_size, seed=config.seed)
    else:
        from p2ptrain.train.partition import dirichlet_shard

        shard = dirichlet_shard(splits.train, config.rank, config.world_size, config.dirichlet_alpha,
                                seed=config.seed)
    device = pick_device(config.device)
    generator = torch.Generator().manual_seed(config.seed * 1_000_003 + config.rank)
    loader = torch.utils.data.DataLoader(shard, batch_size=config.batch_size, shuffle=True,
                                         drop_last=len(shard) >= config.batch_size, generator=generator,
                                         pin_memory=device.type == "cuda")
    test_loader = torch.utils.data.DataLoader(splits.test, batch_size=512)
    torch.manual_seed(config.seed)  # identical initial model on every node (and θ_0 on the server)
    model = build_model(config.model, splits.input_shape, splits.num_classes, hidden=config.hidden).to(device)
    return loader, test_loader, model, device


def run_node(config: NodeConfig) -> dict:
    """Train one node end to end; returns (and writes) its summary."""
    torch.set_num_threads(config.threads)
    out = Path(config.out) if config.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    progress = ProgressWriter(out, config.rank)
    started = time.time()
    try:
        loader, test_loader, model, device = training_setup(config)
        with Node(config, device=device) as node:
            optimizer = torch.optim.SGD(model.parameters(), lr=config.learning_rate, momentum=config.momentum,
                                        weight_decay=config.weight_decay)
            trainer = DecentralizedTrainer(model, optimizer, node.algorithm(), device=device, metrics=node.metrics,
                                           slowdown=config.compute_slowdown, inject_nan_at=config.nan_injection_step)

            def on_log(record: StepRecord, trainer: DecentralizedTrainer) -> None:
                stats = trainer.algorithm.stats()
                progress.write(step=record.step, time=time.time(), loss=record.loss,
                               bytes_sent=node.metrics.bytes_sent_total,
                               bytes_received=node.metrics.bytes_received_total,
                               ps_weight=stats.get("ps_weight", 1.0), step_seconds=record.seconds)

            try:
                result = trainer.fit(cycle(loader), config.steps, on_log=on_log, log_every=config.log_every)
            except NonFiniteError as exc:  # a failed run: say where, in the summary the launcher reads
                if out:
                    (out / f"node{config.rank}.json").write_text(json.dumps({
                        "rank": config.rank, "steps": config.steps, "failed": True, "error": str(exc),
                        "nonfinite_step": exc.step, "nonfinite": exc.what,
                        "wall_seconds": time.time() - started}, indent=2))
                raise
            test_loss, test_accuracy = trainer.evaluate(test_loader)
            summary = {
                "rank": config.rank, "steps": config.steps, "final_loss": result.final_loss,
                "test_accuracy": test_accuracy, "test_loss": test_loss,
                "bytes_sent": node.metrics.bytes_sent_total,
                "bytes_received": node.metrics.bytes_received_total,
                "forwarded_messages": _counter_total(node.metrics, "p2ptrain_forwarded_messages_total"),
                "forwarded_bytes": _counter_total(node.metrics, "p2ptrain_forwarded_bytes_total"),
                "mean_step_seconds": result.mean_step_seconds,
                "steady_step_seconds": result.steady_step_seconds,
                "ps_weight": trainer.algorithm.stats().get("ps_weight", 1.0),
                "min_ps_weight": trainer.algorithm.stats().get("min_ps_weight", 1.0),
                "wall_seconds": time.time() - started, "device": device.type,
                "metrics_port": node.metrics_port, "start_step": trainer.start_step,
                "rejoined": trainer.start_step > 0,
                "dead_peers": sorted(node.transport.membership.dead()),
                "catch_ups": trainer.catch_ups,
                "dropped_shares": int(trainer.algorithm.stats().get("dropped_shares", 0)),
                "dropped_messages": node.metrics.dropped_total, "link_timeouts": node.metrics.link_timeouts_total,
            }
        if out:
            steps = sorted(result.snapshots)
            torch.save({"steps": steps, "params": torch.stack([result.snapshots[s] for s in steps])},
                       out / f"node{config.rank}.snapshots.pt")
            (out / f"node{config.rank}.json").write_text(json.dumps(_finite(summary), indent=2))
        progress.write(event="done")
        return summary
    except NoClusterToRejoin as exc:  # restarted after the others finished: nothing failed
        progress.write(event="not_rejoined", message=str(exc))
        raise
    except BaseException as exc:
        progress.write(event="error", message=f"{type(exc).__name__}: {exc}")
        raise
    finally:
        progress.close()


def _counter_total(metrics: NodeMetrics, sample: str) -> int:
    """A counter summed over its labels (e.g. what this node relayed, to every next hop)."""
    return int(sum(s.value for m in metrics.registry.collect() for s in m.samples if s.name == sample))


def _finite(summary: dict) -> dict:
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in summary.items()}
