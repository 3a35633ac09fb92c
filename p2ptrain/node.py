"""A p2ptrain node, composed from a NodeConfig: transport (options, security, link emulation),
metrics endpoint, communicator and algorithm.

`Node` is the reusable piece (also for the Python API); `run_node` is what `p2ptrain node` runs:
it adds the built-in data sets and models and writes the progress / summary / snapshot files the
launcher reads. This is the one place that turns settings into runtime objects.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from p2ptrain.algorithms import registry
from p2ptrain.algorithms.base import Algorithm
from p2ptrain.algorithms.registry import BuildContext
from p2ptrain.communicator import Communicator
from p2ptrain.config import NodeConfig
from p2ptrain.metrics import NodeMetrics, counter_total
from p2ptrain.train import DecentralizedTrainer, StepRecord, cycle, pick_device
from p2ptrain.train.loop import NonFiniteError
from p2ptrain.train.progress import ProgressWriter, write_summary
from p2ptrain.train.setup import build_optimizer, training_setup
from p2ptrain.transport import Transport, TransportOptions, rendezvous
from p2ptrain.transport.faults import LinkTable
from p2ptrain.transport.runtime import PeerError
from p2ptrain.transport.security import security_from_settings

log = logging.getLogger(__name__)


class NoClusterToRejoin(PeerError):
    """A restarted node found no live peer: the cluster has finished (or is unreachable)."""


def link_table(config: NodeConfig) -> LinkTable | None:
    """The emulation of this node's outgoing links (seeded from `seed`); None when off."""
    if not config.link and not config.link_overrides:
        return None
    table = LinkTable.parse(config.link, config.link_overrides, seed=config.seed)
    table.check_ranks(config.world_size)
    return table


def transport_options(config: NodeConfig, device: torch.device) -> TransportOptions:
    return TransportOptions(chunk_bytes=config.chunk_bytes, step_window=config.step_window,
                            send_timeout=config.peer_timeout, link_deadline=config.link_deadline,
                            pin_memory=device.type == "cuda", links=link_table(config),
                            security=security_from_settings(config), relay_routes=tuple(config.relay_routes),
                            relays=config.relays, relay_retry_after=config.relay_retry_after,
                            max_lag=config.resolved_max_lag)


class Node:
    """Owns the transport (server + client pool on its loop thread) and the metrics server."""

    def __init__(self, config: NodeConfig, device: torch.device | None = None):
        self.config = config.validate()
        self.device = device or pick_device(config.device)
        self.metrics = NodeMetrics(config.rank, algorithm=config.algorithm)
        peers, listen = config.peers or ["127.0.0.1:0"], config.listen
        if config.uses_rendezvous:  # addresses come from the store once the server is bound (start)
            peers, listen = None, rendezvous.listen_address(config)
        self.transport = Transport(config.rank, config.world_size, peers, listen=listen,
                                   options=transport_options(config, self.device), metrics=self.metrics,
                                   config_fingerprint=config.fingerprint())
        self.comm = Communicator(self.transport, self.device, peer_timeout=config.peer_timeout)
        self.metrics_port: int | None = None
        self._metrics_server = None
        if config.ignored_options:
            log.warning("node %d: settings for other algorithms than %s ignored: %s", config.rank, config.algorithm,
                        ", ".join(sorted(config.ignored_options)))

    def start(self, wait_for_peers: bool = True) -> "Node":
        self.transport.start()
        if self.config.uses_rendezvous:
            self.transport.set_peer_addresses(rendezvous.exchange_addresses(self.config, self.transport.port))
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
        return registry.build(cfg.algorithm, self.comm, cfg.algorithm_options,
                              BuildContext(topology=cfg.resolved_topology, seed=cfg.seed))


def run_node(config: NodeConfig) -> dict:
    """Train one node end to end; returns (and writes) its summary."""
    torch.set_num_threads(config.threads)
    out = Path(config.out) if config.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    name = f"node{config.rank}"
    progress = ProgressWriter(out, name, rank=config.rank)
    started = time.time()
    try:
        loader, test_loader, model, device = training_setup(config)
        with Node(config, device=device) as node:
            optimizer = build_optimizer(config, model)
            trainer = DecentralizedTrainer(model, optimizer, node.algorithm(), device=device, metrics=node.metrics,
                                           slowdown=config.compute_slowdown, inject_nan_at=config.nan_injection_step,
                                           comm=node.comm)

            def on_log(record: StepRecord, trainer: DecentralizedTrainer) -> None:
                stats = trainer.algorithm.stats()
                progress.write(step=record.step, time=time.time(), loss=record.loss,
                               bytes_sent=node.metrics.bytes_sent_total,
                               bytes_received=node.metrics.bytes_received_total,
                               ps_weight=stats.get("ps_weight", 1.0), step_seconds=record.seconds)

            try:
                result = trainer.fit(cycle(loader), config.steps, on_log=on_log, log_every=config.log_every)
            except NonFiniteError as exc:  # a failed run: say where, in the summary the launcher reads
                write_summary(out, name, {"rank": config.rank, "steps": config.steps, "failed": True,
                                          "error": str(exc), "nonfinite_step": exc.step, "nonfinite": exc.what,
                                          "wall_seconds": time.time() - started})
                raise
            test_loss, test_accuracy = trainer.evaluate(test_loader)
            stats = trainer.algorithm.stats()
            summary = {
                "rank": config.rank, "steps": config.steps, "final_loss": result.final_loss,
                "test_accuracy": test_accuracy, "test_loss": test_loss,
                "bytes_sent": node.metrics.bytes_sent_total,
                "bytes_received": node.metrics.bytes_received_total,
                "forwarded_messages": counter_total(node.metrics.registry, "p2ptrain_forwarded_messages_total"),
                "forwarded_bytes": counter_total(node.metrics.registry, "p2ptrain_forwarded_bytes_total"),
                "mean_step_seconds": result.mean_step_seconds,
                "steady_step_seconds": result.steady_step_seconds,
                "ps_weight": stats.get("ps_weight", 1.0),
                "min_ps_weight": stats.get("min_ps_weight", 1.0),
                "wall_seconds": time.time() - started, "device": device.type,
                "metrics_port": node.metrics_port, "start_step": trainer.start_step,
                "rejoined": trainer.start_step > 0,
                "dead_peers": sorted(node.transport.membership.dead()),
                "catch_ups": trainer.catch_ups,
                "dropped_shares": int(stats.get("dropped_shares", 0)),
                "dropped_messages": node.metrics.dropped_total, "link_timeouts": node.metrics.link_timeouts_total,
            }
        write_summary(out, name, summary, result.snapshots)
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


__all__ = ["Node", "NoClusterToRejoin", "link_table", "run_node", "transport_options"]
