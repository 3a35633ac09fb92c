"""One process of a simulation (bench/simulate.py): k logical nodes, each a real Transport (its own
port, identity and loop thread) with its Communicator, driving a vector of `dim` floats through the
real algorithm, membership and engine (DecentralizedOptimizer with lr 0: no model, no data).
What it measures is protocol cost: gRPC calls by method (NodeMetrics.on_rpc), tensor messages,
open channels and lane connections, when each node was ready, and when each adopted the view
without the leaver (a watcher thread reads every node's latest view)."""
from __future__ import annotations

import concurrent.futures
import faulthandler
import gc
import resource
import signal
import sys
import threading
import time
from dataclasses import dataclass

import torch
from torch import nn

from p2ptrain.algorithms.sgp import SGP
from p2ptrain.bench.consensus import initial_vector
from p2ptrain.communicator import Communicator
from p2ptrain.metrics import NodeMetrics
from p2ptrain.topology import member_topology
from p2ptrain.train.errors import LeftCluster
from p2ptrain.train.optimizer import DecentralizedOptimizer
from p2ptrain.transport import Transport, TransportOptions

DATA_METHOD = "PushTensor"  # every other gRPC method is membership or control
# Python's cyclic GC: with dozens of nodes a process holds millions of objects, and full collections
# took a third of its CPU at 64 nodes per process (perf), starving the loops. Collected rarely here.
GC_THRESHOLDS = (100_000, 50, 1000)
WATCH_SECONDS = 0.005       # how often the watcher reads the nodes' views (the agreement time's resolution)
# A busy 2-core machine hosting a hundred nodes: long deadlines, so a slow peer is waited for, not
# declared dead (that would be a membership change of its own, and lost mass against the theory);
# and public by construction (on loopback), where a dial-back that times out would say private.
OPTIONS = TransportOptions(send_timeout=120.0, link_deadline=60.0, probe_timeout=20.0, reachability="public")


@dataclass(frozen=True)
class Plan:
    """What every process runs: `steps` steps measured for consensus, then `window` steps as a
    baseline, then `window` steps in which node `leaver` leaves (None: nobody)."""
    peers: tuple[str, ...]
    steps: int
    dim: int
    window: int
    leaver: int | None
    timeout: float

    @property
    def nodes(self) -> int:
        return len(self.peers)

    @property
    def change_at(self) -> int:
        return self.steps + self.window

    @property
    def end(self) -> int:
        return self.steps + 2 * self.window


class Vector(nn.Module):
    """The model-free workload: one parameter vector."""

    def __init__(self, start: torch.Tensor):
        super().__init__()
        self.x = nn.Parameter(start)


def counters(transport: Transport) -> dict:
    """(On the loop thread.) What the node sent so far, and the connections it holds."""
    metrics = transport.metrics
    methods = {method: list(totals) for method, totals in metrics.rpc_totals.items()}
    control = [totals for method, totals in methods.items() if method != DATA_METHOD]
    return {"control_messages": sum(c for c, _ in control), "control_bytes": sum(b for _, b in control),
            "methods": methods, "data_messages": metrics.messages_sent_total, "data_bytes": metrics.bytes_sent_total,
            "channels": transport.grpc.channels,
            "lane_connections": transport.lanes.connections if transport.lanes is not None else 0}


class ViewWatcher:
    """Reads each node's latest view every WATCH_SECONDS: the first time each held a view without
    the leaver, and the most threads this process ran."""

    def __init__(self, transports: list[Transport], leaver: int | None):
        self.transports = transports
        self.leaver = leaver
        self.adopted: dict[int, float] = {}
        self.peak_threads = threading.active_count()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="view-watcher", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._done.wait(WATCH_SECONDS):
            self.peak_threads = max(self.peak_threads, threading.active_count())
            for transport in self.transports:
                if transport.rank not in self.adopted and self.leaver is not None \
                        and self.leaver not in transport.membership.latest.members:
                    self.adopted[transport.rank] = time.time()

    def stop(self) -> None:
        self._done.set()
        self._thread.join(5)


def run_node(plan: Plan, comm: Communicator) -> dict:
    """One node's run: set up (every node ready), `plan.steps` recorded steps, the baseline
    window, the change window (the leaver asks to leave at its start), finish."""
    rank, transport = comm.rank, comm.transport
    model = Vector(initial_vector(rank, plan.dim))
    algorithm = SGP(comm, member_topology("exponential", plan.nodes, comm.membership.placed), overlap=0)
    opt = DecentralizedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model=model, algorithm=algorithm,
                                 comm=comm)
    record = {"rank": rank, "ready": time.time(), "startup": transport.run_on_loop(counters, transport),
              "z": [], "w": [], "left": False}
    if rank == 0:
        print(f"node 0 ready, {record['startup']['control_messages']} control calls", file=sys.stderr, flush=True)
    try:
        while opt.local_step < plan.end:
            step = opt.local_step
            if step == plan.steps:
                record["steady_from"] = transport.run_on_loop(counters, transport)
            if step == plan.change_at:
                record["change_from"] = transport.run_on_loop(counters, transport)
                if rank == plan.leaver:
                    opt.request_leave()
            opt.step()
            if step < plan.steps:  # (τ = 0: every share of this step is mixed in, nothing is in flight)
                record["z"].append(model.x.detach().tolist())
                record["w"].append(algorithm.w)
        record["change_to"] = transport.run_on_loop(counters, transport)
        opt.finish()
    except LeftCluster:
        record["change_to"] = transport.run_on_loop(counters, transport)
        record["left"] = True
    record["final_w"] = 0.0 if record["left"] else algorithm.w
    return record


def host(plan: Plan, ranks: list[int]) -> dict:
    """Run the nodes `ranks` of `plan` in this process; their records, the process's start time
    and its thread count."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # every node holds a channel to every peer
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: where a slow process waits
    gc.freeze()  # (what is imported by now lives to the end: never scanned again)
    gc.set_threshold(*GC_THRESHOLDS)
    torch.set_num_threads(1)
    began = time.time()
    transports: list[Transport] = []
    comms: list[Communicator] = []
    watcher = None
    pool = concurrent.futures.ThreadPoolExecutor(len(ranks), thread_name_prefix="node")
    try:
        for rank in ranks:
            transports.append(Transport(rank, plan.nodes, list(plan.peers), listen=plan.peers[rank], options=OPTIONS,
                                        metrics=NodeMetrics(rank, "sgp")).start())
        comms = [Communicator(t, "cpu", peer_timeout=plan.timeout) for t in transports]
        watcher = ViewWatcher(transports, plan.leaver)
        futures = [pool.submit(run_node, plan, comm) for comm in comms]
        done, _ = concurrent.futures.wait(futures, plan.timeout, return_when=concurrent.futures.FIRST_EXCEPTION)
        for future in done:  # the first failure ends the run at once (the finally stops every node)
            if future.exception() is not None:
                raise future.exception()
        if len(done) < len(futures):
            raise TimeoutError(f"{len(futures) - len(done)} nodes of {ranks[:3]}... unfinished after {plan.timeout}s")
        records = [future.result() for future in futures]
        watcher.stop()
        print(f"nodes {ranks[0]}, {ranks[1] if len(ranks) > 1 else ''}...: done in {time.time() - began:.1f}s",
              file=sys.stderr, flush=True)
        for record in records:
            record["adopted"] = watcher.adopted.get(record["rank"])
        return {"began": began, "threads": watcher.peak_threads, "records": records}
    finally:
        if watcher is not None:
            watcher.stop()
        for transport in transports:
            transport.stop()
        for comm in comms:
            comm.close()
        pool.shutdown(wait=False, cancel_futures=True)


__all__ = ["DATA_METHOD", "OPTIONS", "Plan", "Vector", "counters", "host", "run_node"]
