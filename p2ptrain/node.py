"""A p2ptrain node, composed from a NodeConfig: transport (options, security, link emulation),
metrics endpoint, communicator, algorithm, and what it records into the run folder.

`Node` is what `p2ptrain.init()` returns to a training script of your own and what `p2ptrain node`
runs its built-in training on (`run_node`). This is the one place that turns settings into runtime
objects.
"""
from __future__ import annotations

import hashlib
import logging
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from p2ptrain.algorithms import registry
from p2ptrain.algorithms.base import Algorithm
from p2ptrain.algorithms.registry import BuildContext
from p2ptrain.communicator import Communicator
from p2ptrain.metrics import NodeMetrics, counter_total
from p2ptrain.settings import NodeConfig
from p2ptrain.topology import build_topology
from p2ptrain.train import DecentralizedTrainer, cycle, pick_device
from p2ptrain.train.errors import LeftCluster, NonFiniteError
from p2ptrain.train.mass_record import MassRecord, mass_path
from p2ptrain.train.progress import RunRecorder, StepClock
from p2ptrain.train.setup import build_optimizer, training_setup
from p2ptrain.transport import Transport, TransportOptions, rendezvous
from p2ptrain.transport.errors import NoClusterToRejoin
from p2ptrain.transport.security import security_from_settings

if TYPE_CHECKING:
    from p2ptrain.train.optimizer import DecentralizedOptimizer

log = logging.getLogger(__name__)
PROJECTION_DIRECTIONS = 4


def transport_options(config: NodeConfig, device: torch.device) -> TransportOptions:
    """The transport settings, and what the node derives for its transport: link emulation,
    security, pinned memory on CUDA, the lag limit, an elastic run's starting members."""
    return TransportOptions.from_settings(
        config.transport, links=config.link_table(), security=security_from_settings(config.security),
        pin_memory=device.type == "cuda", max_lag=config.resolved_max_lag,
        initial_members=config.world_size if config.elastic else None, view_notice=VIEW_NOTICE_SECONDS)


VIEW_NOTICE_SECONDS = 1.0  # a membership view switches at least ~1 s of steps ahead: every member hears of it first
EMPTY_SURVEYS = 3  # surveys in a row that reach no peer before a (re)joiner concludes the cluster is gone


class Node:
    """One node: its transport (server and client pool on their loop thread), metrics endpoint,
    communicator, and the run folder's files (`out`). Use it as a context manager, or call
    start() and close(); `report()` adds scalars such as a test accuracy to the progress lines and
    the summary."""

    def __init__(self, config: NodeConfig, device: torch.device | None = None):
        self.config = config.validate()
        self.device = device or pick_device(config.device)
        self.metrics = NodeMetrics(config.rank, algorithm=config.algorithm)
        peers, listen = config.peers or ["127.0.0.1:0"], config.listen
        if config.uses_rendezvous:  # addresses come from the store once the server is bound (start)
            peers, listen = None, rendezvous.listen_address(config)
        self.transport = Transport(config.rank, config.slots, peers, listen=listen,
                                   options=transport_options(config, self.device), metrics=self.metrics,
                                   config_fingerprint=config.fingerprint())
        self.comm = Communicator(self.transport, self.device, peer_timeout=config.peer_timeout)
        self.metrics_port: int | None = None
        self._metrics_server = None
        self.reachability = "unknown"  # whether peers can dial this node: public / private (start() asks)
        out = Path(config.out) if config.out else None
        if out:
            out.mkdir(parents=True, exist_ok=True)
        self.recorder = RunRecorder(out, f"node{config.rank}", rank=config.rank, log_every=config.log_every)
        self.mass_record: MassRecord | None = None  # a push-sum node's OUT/node{rank}.mass (algorithm())
        self.optimizer: DecentralizedOptimizer | None = None  # the one attached by DecentralizedOptimizer
        self.clock = StepClock()  # wall and CPU seconds per step; evaluations go off the clock
        self._directions: torch.Tensor | None = None
        self._started = self._closed = False
        if config.ignored_options:
            log.warning("node %d: settings for other algorithms than %s ignored: %s", config.rank, config.algorithm,
                        ", ".join(sorted(config.ignored_options)))

    @property
    def rank(self) -> int:
        return self.config.rank

    @property
    def metrics_address(self) -> tuple[str, int] | None:
        """(host, port) the /metrics endpoint is bound to; None when it is not serving."""
        server = self._metrics_server
        return tuple(server.server_address[:2]) if server is not None else None

    @property
    def world_size(self) -> int:
        return self.config.world_size

    def members(self) -> tuple[int, ...]:
        """The ranks training together at this node's current step (every rank, fault-free)."""
        membership = self.transport.membership
        return membership.members(membership.step)

    # Lifecycle ----------------------------------------------------------------------------------
    def start(self, wait_for_peers: bool = True) -> "Node":
        """Start the transport and metrics endpoint; meet the peers (or rejoin a running cluster).
        Starting a started node does nothing (p2ptrain.init() starts it; `with` may follow)."""
        if self._started:
            return self
        self._started = True
        self.transport.start()
        if self.config.uses_rendezvous:
            self.transport.set_peer_addresses(rendezvous.exchange_addresses(self.config, self.transport.port))
        if self.config.metrics_port is not None:
            server, _ = self.metrics.serve(self.config.metrics_port, addr=self.config.metrics_bind_host)
            self._metrics_server = server
            self.metrics_port = server.server_port
        self._meet(wait_for_peers)
        if self.config.world_size > 1:
            self.reachability = self.transport.check_reachability()
            if self.config.uses_rendezvous:
                try:
                    rendezvous.publish_reachability(self.config, self.reachability)
                except Exception as exc:  # (informational: peers hear it in Hellos anyway)
                    log.warning("node %d: could not publish its reachability to the store: %s", self.config.rank, exc)
        return self

    def _meet(self, wait_for_peers: bool) -> None:
        """Meet the peers, or prepare to (re)join a running cluster."""
        membership = self.transport.membership
        if self.config.join:  # a new member of a running elastic cluster: take a live peer's state first
            self.wait_to_join(running=self.config.rejoin)
            membership.joining = True
            log.info("node %d: joining the running cluster", self.config.rank)
            return
        if self.config.rejoin and self.config.world_size > 1:  # restarted into a running cluster: never a fresh start
            self.wait_to_join(running=True)
            membership.joining = True
            log.info("node %d: the cluster is already training; rejoining", self.config.rank)
            return
        near = None  # (meet everyone)
        if self.transport.options.meet == "neighbours":
            # only the exponential graph's neighbours (O(log n): what the reachability check asks);
            # no survey: a node that is not the algorithm's neighbour may already train while this
            # one starts afresh, so a restart must say so (--rejoin, as the launcher's restarts do)
            near = build_topology("exponential", self.config.world_size).neighbourhood(self.config.rank)
        elif self.config.world_size > 1:
            survey = membership.survey()
            if survey.running:
                membership.joining = True  # a restarted node: its peers train on; fetch state, don't wait for all
                log.info("node %d: the cluster is already training; rejoining", self.config.rank)
                return
        if wait_for_peers and self.config.world_size > 1:
            membership.wait_for_peers(timeout=self.config.peer_timeout, peers=near)

    def wait_to_join(self, running: bool = False) -> None:
        """A joiner: wait (up to the peer timeout) for the cluster to answer, and with join_at for it
        to reach that step (`running`, a restarted node: for a ready peer past step 0 to answer, as
        busy peers may miss one survey); NoClusterToRejoin if it has finished (EMPTY_SURVEYS surveys
        in a row reach nobody) or never answers."""
        deadline, seen, empty, furthest = time.monotonic() + self.config.peer_timeout, False, 0, 0
        watched = None  # once the cluster answered: the peer furthest ahead, the only one asked again
        while True:
            # (everyone: joiners since are in no view it knows. Asking all n peers five times a
            # second for as long as the cluster takes to reach join_at was O(n) Hellos per poll.)
            membership = self.transport.membership
            survey = membership.survey(everyone=True) if watched is None else membership.survey(peers=[watched])
            if watched is not None and not (survey.reachable and survey.running):
                watched = None  # (gone, or restarting: everyone is asked again next time)
                time.sleep(0.2)
                continue
            if survey.reachable and survey.running and survey.furthest_peer is not None:
                watched = survey.furthest_peer
            if survey.furthest > furthest:  # the cluster answers and moves on (towards join_at): wait on
                furthest, deadline = survey.furthest, time.monotonic() + self.config.peer_timeout
            seen |= bool(survey.reachable)
            # (one empty survey may be busy peers; a peer that keeps its port but does not answer may
            # be frozen, SIGSTOPped for 30 s in a chaos run: waited for up to the peer timeout)
            empty = 0 if survey.reachable or survey.silent else empty + 1
            if running and not seen and empty >= EMPTY_SURVEYS:
                raise NoClusterToRejoin(f"node {self.config.rank}: no live peer to rejoin: the cluster has finished "
                                        "(or is unreachable)")
            if survey.reachable and (survey.running or not running) and \
                    (self.config.join_at is None or survey.furthest >= self.config.join_at):
                return
            if (seen and empty >= EMPTY_SURVEYS) or time.monotonic() >= deadline:
                raise NoClusterToRejoin(f"node {self.config.rank}: no live peer to join: the cluster has finished "
                                        "(or is unreachable)")
            time.sleep(0.2)

    @property
    def closed(self) -> bool:
        """close() (or fail()) ran: the node no longer trains."""
        return self._closed

    def stop(self) -> None:
        """Stop the transport, the communication worker and the metrics endpoint (close() also
        writes the summary)."""
        self.transport.stop()
        self.comm.close()  # after the transport: a background job still waiting fails at once
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server = None
        self.recorder.close()
        if self.mass_record is not None:
            self.mass_record.close()
            self.mass_record = None

    def close(self, **summary) -> dict:
        """Finish the attached optimizer (if its run was not finished), write the summary (the last
        reported scalars, traffic, push-sum weight, ... plus `summary`) and stop. Idempotent."""
        if self._closed:
            return {}
        self._closed = True
        try:
            model, final, shared = None, {}, {}
            if self.optimizer is not None:
                self.optimizer.finish()
                model = self.optimizer.state_vector.parameter_vector()
                algorithm = self.optimizer.algorithm
                final = {k: v for k, v in algorithm.stats().items() if k == "ps_weight"}
                shared = {"push_sum": algorithm.holds_mass, "shared_state": state_digest(algorithm.shared_state(model))}
                optimizer_state = self.optimizer.optimizer_state
                if algorithm.shares_optimizer_state and optimizer_state is not None:
                    shared["optimizer_state"] = state_digest(("optimizer state", optimizer_state.vector()))
            final.update(bytes_sent=self.metrics.bytes_sent_total, bytes_received=self.metrics.bytes_received_total,
                         reach=self.reach())
            return self.recorder.finish({**self.summary(), **shared, **summary}, model, **final)
        finally:
            self.stop()

    def __enter__(self) -> "Node":
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is None:
            self.close()
            return
        if isinstance(exc, LeftCluster):  # left gracefully (SIGTERM in an elastic run): a normal end
            self.close(left_at=exc.step)
            return
        self.fail(exc)

    def fail(self, exc: BaseException) -> None:
        """The run ended with `exc`: say so in the run folder (a non-finite run in its summary too)."""
        self._closed = True
        try:
            if isinstance(exc, NonFiniteError):
                self.recorder.finish({"rank": self.rank, "failed": True, "error": str(exc), "nonfinite_step": exc.step,
                                      "nonfinite": exc.what, **self.recorder.summary()})
                self.recorder.event("error", message=f"{type(exc).__name__}: {exc}")
            elif isinstance(exc, NoClusterToRejoin):  # restarted after the others finished: nothing failed
                self.recorder.event("not_rejoined", message=str(exc))
            else:
                self.recorder.event("error", message=f"{type(exc).__name__}: {exc}")
        finally:
            self.stop()

    def _record_deliveries(self, record: MassRecord) -> None:
        """(Loop thread, so no delivery slips in between.) The record counts every w delivered from
        now on, after what was delivered before it existed (a joiner's state, late donors')."""
        inbox = self.transport.inbox
        if inbox.mass_delivered:
            record.received(inbox.mass_delivered)
        inbox.on_mass = record.received

    # What a training loop tells the node ---------------------------------------------------------
    def algorithm(self) -> Algorithm:
        """The configured algorithm, bound to this node's communicator."""
        cfg = self.config
        algorithm = registry.build(cfg.algorithm, self.comm, cfg.algorithm_options,
                                   BuildContext(topology=cfg.resolved_topology, seed=cfg.seed))
        if algorithm.holds_mass and self.recorder.out is not None:  # what a SIGKILL would take with it
            if self.mass_record is None:
                self.mass_record = MassRecord(mass_path(self.recorder.out, self.rank))
                self.transport.loop.call(self._record_deliveries, self.mass_record)
            algorithm.watch_mass(self.mass_record)
        return algorithm

    def attach(self, optimizer: DecentralizedOptimizer) -> None:
        """The DecentralizedOptimizer of this node's model (one per node)."""
        if self.optimizer is not None and self.optimizer is not optimizer:
            raise RuntimeError("this node already has a DecentralizedOptimizer: one model replica per node")
        self.optimizer = optimizer
        optimizer.add_step_listener(self.after_step)
        links = self.transport.links
        if links is not None and links.scheduled:  # link bursts: this node's links follow its own steps
            links.at_step(optimizer.local_step)
            optimizer.add_step_listener(lambda done: links.at_step(done.local_step))
        model = optimizer.state_vector.parameter_vector()
        self.recorder.snapshot(optimizer.local_step, model)  # the start
        if self._metrics_server is not None:  # draws the projection's directions now, not in a timed step
            self.metrics.set_model_projection(self.model_projection(model))
        self.clock.restart()

    def report(self, step: int, **scalars: float) -> None:
        """Scalars of `step` (loss=..., accuracy=..., perplexity=...): they reach the live table,
        Prometheus (loss) and the summary (the last value of each; the loss averaged)."""
        self.recorder.report(step, **scalars)
        if "loss" in scalars:
            self.metrics.set_loss(float(scalars["loss"]))

    def evaluated(self, step: int, spent: dict[str, float], **scalars: float) -> None:
        """Scalars of an evaluation at `step` (test_accuracy=...) that ran off the step clock
        (`with node.clock.off_the_clock() as spent:`): reported like report(), and the scalar line
        says how long the evaluation took, so the training time up to it can be told apart."""
        self.recorder.report(step, line={"eval_seconds": spent.get("seconds", 0.0)}, **scalars)

    def after_step(self, optimizer: DecentralizedOptimizer) -> None:
        """After every step of the attached optimizer: metrics, progress line, snapshot."""
        seconds, cpu_seconds = self.clock.lap()
        step = optimizer.local_step
        stats = optimizer.algorithm.stats()
        self.metrics.on_step(step, seconds, None)
        if "ps_weight" in stats:
            self.metrics.set_ps_weight(stats["ps_weight"])
        model = optimizer.state_vector.parameter_vector()
        if step % self.config.log_every == 0 and self._metrics_server is not None:  # only Prometheus reads it
            self.metrics.set_model_projection(self.model_projection(model))
        extra = {"ps_weight": stats["ps_weight"]} if "ps_weight" in stats else {}
        if step % self.config.log_every == 0:
            extra["reach"] = self.reach()
        self.recorder.step_done(step, seconds, model, cpu_seconds=cpu_seconds, bytes_sent=self.metrics.bytes_sent_total,
                                bytes_received=self.metrics.bytes_received_total, **extra)

    def reach(self) -> str:
        """The live table's `reach` cell: this node's reachability, then how many peers it last
        reached otherwise than directly: "private 2v" (two relayed), "public 1r" (one down a
        reverse stream)."""
        ways = Counter(how.split()[0] for how in self.transport.router.paths_taken().values())
        return " ".join([self.reachability, *(f"{ways[way]}{way[0]}" for way in ("reverse", "via") if ways[way])])

    def model_projection(self, model: torch.Tensor) -> list[float]:
        """<model, v_k> for fixed Gaussian directions v_k (seeded, identical on every node): for two
        nodes, E[(<x_i, v> - <x_j, v>)^2] = |x_i - x_j|^2, so the spread across nodes estimates the
        consensus distance without moving any model (exported as p2ptrain_model_projection)."""
        model = model.detach().float()
        if self._directions is None or self._directions.shape[1] != model.numel():
            generator = torch.Generator().manual_seed(20261121)
            self._directions = torch.randn(PROJECTION_DIRECTIONS, model.numel(), generator=generator).to(model.device)
        return (self._directions @ model).tolist()

    def _mass_flows(self, optimizer: DecentralizedOptimizer | None) -> dict[str, float] | None:
        """A push-sum node's flows of w (Algorithm.mass_flows) with the w delivered into its inbox."""
        flows = optimizer.algorithm.mass_flows() if optimizer is not None else None
        if flows is None or self.mass_record is None:
            return flows
        return {**flows, "received": self.mass_record.received_total}

    def summary(self) -> dict:
        """The run so far: reported scalars, step times, traffic, membership, the algorithm's stats."""
        optimizer = self.optimizer
        stats = optimizer.algorithm.stats() if optimizer is not None else {}
        return {
            "rank": self.rank, **self.recorder.summary(),
            "algorithm": self.config.algorithm, "topology": self.config.resolved_topology,
            "bytes_sent": self.metrics.bytes_sent_total, "bytes_received": self.metrics.bytes_received_total,
            "forwarded_messages": counter_total(self.metrics.registry, "p2ptrain_forwarded_messages_total"),
            "forwarded_bytes": counter_total(self.metrics.registry, "p2ptrain_forwarded_bytes_total"),
            "ps_weight": stats.get("ps_weight", 1.0), "min_ps_weight": stats.get("min_ps_weight", 1.0),
            "device": self.device.type, "metrics_port": self.metrics_port, "reachability": self.reachability,
            "paths": {str(peer): how for peer, how in self.transport.router.paths_taken().items()},
            "start_step": 0, "rejoined": False, "catch_ups": 0, "skipped_steps": 0,
            **(optimizer.summary() if optimizer is not None else {}),
            "joined": self.config.join,
            "members": list(self.transport.membership.latest.members),
            "placement": list(self.transport.membership.latest.placed),  # ring / graph order (placement.py)
            "dead_peers": sorted(self.transport.membership.dead()),
            "dropped_shares": int(stats.get("dropped_shares", 0)),
            "ps_in_flight": stats.get("ps_in_flight", 0.0),  # push-sum shares never acknowledged (at the end)
            "ps_minted": stats.get("ps_minted", 0.0),  # the new units this process started with (joined, restarted)
            # rings: the state this node took from holders at switches (member_ring.py; bench heal)
            "state_received_mb": stats.get("state_received_mb", 0.0),
            "state_received_seconds": stats.get("state_received_seconds", 0.0),
            "ps_flows": self._mass_flows(optimizer),  # push-sum: every flow of w, for the exact mass ledger
            "dropped_messages": self.metrics.dropped_total, "link_timeouts": self.metrics.link_timeouts_total,
            # membership's cost: its gRPC calls by method (the tensor pushes apart), its open channels
            "control_calls": {method: calls for method, (calls, _) in self.metrics.rpc_totals.items()
                              if method != "PushTensor"},
            "channels": self.transport.grpc.channels,
        }


def state_digest(shared: tuple[str, torch.Tensor] | None) -> dict | None:
    """{name, sha256, numel} of Algorithm.shared_state's tensor: equal digests, equal bits."""
    if shared is None:
        return None
    name, tensor = shared
    flat = tensor.detach().reshape(-1).contiguous().cpu()
    return {"name": name, "sha256": hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest(),
            "numel": flat.numel(), "dtype": str(flat.dtype).removeprefix("torch.")}


def run_node(config: NodeConfig) -> dict:
    """`p2ptrain node`: train the built-in model on this rank's shard end to end; returns (and
    writes) the summary."""
    torch.set_num_threads(config.threads)
    node = None
    try:
        # (the shard follows the members: asked once training runs, when `node` is there)
        loader, test_loader, model, device = training_setup(config, members=lambda: node.members())
        node = Node(config, device=device)
        node.start()
        try:
            trainer = DecentralizedTrainer(model, build_optimizer(config, model), node=node, loss_fn=F.nll_loss,
                                           slowdown=config.slowdown_schedule, inject_nan_at=config.nan_injection_step)
        except LeftCluster as left:  # asked to leave while joining: it never trained, and holds nothing
            return node.close(left_at=left.step)

        def evaluate(step: int, final: bool = False) -> None:  # every eval_every steps (if set), and at the end
            if final or (config.eval_every and step % config.eval_every == 0 and step < config.steps):
                with node.clock.off_the_clock() as spent:
                    test_loss, test_accuracy = trainer.evaluate(test_loader)
                node.evaluated(step, spent, test_loss=test_loss, test_accuracy=test_accuracy)

        result = trainer.fit(cycle(loader), config.steps, after_step=evaluate)
        evaluate(result.left_at or config.steps, final=True)
        return node.close(**({"left_at": result.left_at} if result.left_at is not None else {}))
    except BaseException as exc:
        if node is not None:
            node.fail(exc)
        raise


__all__ = ["Node", "NoClusterToRejoin", "run_node", "state_digest", "transport_options"]
