"""One process of a simulation (bench/simulate.py): k logical nodes, each a real Transport (its own
port and identity; all on the process's one event loop unless Plan.shared_loop is off) with its
Communicator, driving a vector of `dim` floats through the real algorithm, membership and engine
(DecentralizedOptimizer with lr 0: no model, no data).
Calls between nodes of a process go in-process (paths/local_calls.py) unless Plan.grpc_calls.
What it measures is protocol cost: calls by method (NodeMetrics.on_rpc), tensor messages,
open channels and lane connections, when each node was ready, and when each adopted the view
without the leaver (a watcher thread reads every node's latest view)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import faulthandler
import gc
import resource
import signal
import sys
import threading
import time
import traceback
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
from p2ptrain.transport.loop_thread import LoopThread
from p2ptrain.transport.paths.local_calls import LocalServices

DATA_METHOD = "PushTensor"  # every other gRPC method is membership or control
# Python's cyclic GC: with dozens of nodes a process holds millions of objects, and full collections
# took a third of its CPU at 64 nodes per process (perf), starving the loops. Collected rarely here.
GC_THRESHOLDS = (100_000, 50, 1000)
# The GIL's switch interval here (Python's default: 5 ms). Hundreds of node threads that wake to
# look at their Hellos each want the GIL for a moment; at 5 ms the loop thread, which does every
# node's I/O, waited behind dozens of them each time it let go.
SWITCH_INTERVAL = 0.05
WATCH_SECONDS = 0.005       # how often the watcher reads the nodes' views (the agreement time's resolution)
PROGRESS_SECONDS = 30.0     # how often each process says how far its nodes are
WATCH_SHARE = 10            # ... or, when a pass over them takes longer, pauses of this many passes
# A busy 2-core machine hosting a hundred nodes: long deadlines, so a slow peer is waited for, not
# declared dead (that would be a membership change of its own, and lost mass against the theory);
# and public by construction (on loopback), where a dial-back that times out would say private.
STOPPERS = 64  # transports stopped at once when a process ends
OPTIONS = TransportOptions(send_timeout=120.0, link_deadline=60.0, probe_timeout=20.0, reachability="public")


@dataclass(frozen=True)
class Plan:
    """What every process runs: `steps` steps measured for consensus, then `window` steps as a
    baseline, then `window` steps in which node `leaver` leaves (None: nobody), then `churn_steps`
    steps of churn: at each (step, leaving, joining) of `churn` one member leaves and a new node
    joins (ranks from `members` on: they start outside the cluster), then `window` steps more."""
    peers: tuple[str, ...]
    steps: int
    dim: int
    window: int
    leaver: int | None
    timeout: float
    meet: str = "neighbours"  # TransportOptions.meet
    members: int | None = None  # the initial members (None: every rank of peers)
    churn: tuple[tuple[int, int, int], ...] = ()
    churn_steps: int = 0
    # One event loop for every node of a process (False: a loop thread per node, as real nodes have).
    # Hundreds of loop threads starved each other on 2 cores: probes waited past their timeout.
    shared_loop: bool = True
    # Calls between the nodes of a process (Hello, Settle) by gRPC, as real nodes make them (False: on a
    # shared loop they go straight to the callee's service: paths/local_calls.py)
    grpc_calls: bool = False

    @property
    def nodes(self) -> int:
        """The initial members (n)."""
        return self.members if self.members is not None else len(self.peers)

    @property
    def world(self) -> int:
        """Every rank, joiners included."""
        return len(self.peers)

    @property
    def change_at(self) -> int:
        return self.steps + self.window

    @property
    def churn_at(self) -> int:
        return self.steps + 2 * self.window

    @property
    def end(self) -> int:
        """(After the churn, a window more: the last joiner's view switches, and it trains.)"""
        return self.churn_at + (self.churn_steps + self.window if self.churn else 0)

    def options(self) -> TransportOptions:
        return dataclasses.replace(OPTIONS, meet=self.meet, initial_members=self.members)

    def leaves_at(self, rank: int) -> int | None:
        """The step `rank` asks to leave at (None: it stays)."""
        if rank == self.leaver:
            return self.change_at
        return next((step for step, leaving, _ in self.churn if leaving == rank), None)


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
    the leaver, each view each node came to hold (its order, when, at which step of the node),
    and the most threads this process ran. Nodes may be added while it runs (joiners)."""

    def __init__(self, transports: list[Transport], leaver: int | None):
        self.transports = transports
        self.leaver = leaver
        self.adopted: dict[int, float] = {}
        self.views: dict[int, list[tuple[tuple[int, int], float, int]]] = {}
        self.peak_threads = threading.active_count()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="view-watcher", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        pause = WATCH_SECONDS
        while not self._done.wait(pause):
            began = time.monotonic()
            self.peak_threads = max(self.peak_threads, threading.active_count())
            for transport in list(self.transports):
                membership = transport.membership
                latest = membership.latest
                seen = self.views.setdefault(transport.rank, [])
                if not seen or seen[-1][0] != latest.order:
                    seen.append((latest.order, time.time(), membership.step))
                if transport.rank not in self.adopted and self.leaver is not None \
                        and self.leaver not in latest.members:
                    self.adopted[transport.rank] = time.time()
            # (a tenth of a core at most: with hundreds of nodes one pass takes milliseconds)
            pause = max(WATCH_SECONDS, WATCH_SHARE * (time.monotonic() - began))

    def stop(self) -> None:
        self._done.set()
        self._thread.join(5)


def make_optimizer(plan: Plan, comm: Communicator) -> tuple[DecentralizedOptimizer, SGP, Vector]:
    """The node's vector, SGP on the exponential graph over the members, and the engine (a joiner
    takes a member's state in here)."""
    model = Vector(initial_vector(comm.rank, plan.dim))
    algorithm = SGP(comm, member_topology("exponential", plan.world, comm.membership.placed), overlap=0)
    opt = DecentralizedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model=model, algorithm=algorithm,
                                 comm=comm)
    return opt, algorithm, model


def run_node(plan: Plan, comm: Communicator, progress: dict[int, int], halt: threading.Event) -> dict:
    """One node's run: set up (every node ready), `plan.steps` recorded steps, the baseline
    window, the change window (the leaver asks to leave at its start), the churn, finish."""
    rank, transport = comm.rank, comm.transport
    opt, algorithm, model = make_optimizer(plan, comm)
    record = {"rank": rank, "ready": time.time(), "startup": transport.run_on_loop(counters, transport),
              "z": [], "w": [], "left": False}
    if rank == 0:
        print(f"node 0 ready, {record['startup']['control_messages']} control calls", file=sys.stderr, flush=True)
    marks = {plan.steps: "steady_from", plan.change_at: "change_from", plan.churn_at: "change_to"}
    leave_at = plan.leaves_at(rank)
    try:
        while opt.local_step < plan.end:
            if halt.is_set():
                raise TimeoutError(f"node {rank} halted at step {opt.local_step}: the run ended")
            step = progress[rank] = opt.local_step
            if step in marks:
                record[marks[step]] = transport.run_on_loop(counters, transport)
                record[marks[step] + "_time"] = time.time()
            if leave_at is not None and step >= leave_at:
                opt.request_leave()  # (>=: a node that caught up may have jumped over its step)
                leave_at = None
            opt.step()
            if step < plan.steps:  # (τ = 0: every share of this step is mixed in, nothing is in flight)
                record["z"].append(model.x.detach().tolist())
                record["w"].append(algorithm.w)
        if "change_to" not in record:  # (the window ends with the run: before finish()'s "finished" Hellos)
            record["change_to"] = transport.run_on_loop(counters, transport)
            record["change_to_time"] = time.time()
        record["trained"] = transport.run_on_loop(counters, transport)  # (the churn's end for this node)
        opt.finish()
    except LeftCluster:
        record["left"] = True
    progress.pop(rank, None)
    record["end"] = transport.run_on_loop(counters, transport)
    record["end_time"] = time.time()
    record.setdefault("change_to", record["end"])
    record.setdefault("trained", record["end"])  # (a leaver: its leave is the churn's)
    record["final_w"] = 0.0 if record["left"] else algorithm.w
    record["retired"] = algorithm.mass.retired_w  # (units it retired for leavers whose mass it took)
    record["in_flight"] = algorithm.stats().get("ps_in_flight", 0.0)  # (shares never acknowledged)
    return record


def run_joiner(plan: Plan, transport: Transport, progress: dict[int, int], halt: threading.Event) -> dict:
    """A node that joins the running cluster: it takes a member's state (and its share of mass),
    is admitted by a view, trains to the end (or leaves, if the churn says so)."""
    began = time.time()
    transport.membership.joining = True
    comm = Communicator(transport, "cpu", peer_timeout=plan.timeout)
    opt, algorithm, _ = make_optimizer(plan, comm)
    record = {"rank": transport.rank, "began": began, "member_from": opt.local_step,
              "join_seconds": time.time() - began, "left": False}
    leave_at = plan.leaves_at(transport.rank)
    try:
        while opt.local_step < plan.end:
            if halt.is_set():
                raise TimeoutError(f"node {transport.rank} halted at step {opt.local_step}: the run ended")
            step = progress[transport.rank] = opt.local_step
            if leave_at is not None and step >= leave_at:
                opt.request_leave()  # (>=: a node that caught up may have jumped over its step)
                leave_at = None
            opt.step()
        record["trained"] = transport.run_on_loop(counters, transport)
        opt.finish()
    except LeftCluster:
        record["left"] = True
    finally:
        progress.pop(transport.rank, None)
        comm.close()
    record["end"] = transport.run_on_loop(counters, transport)
    record["end_time"] = time.time()
    record.setdefault("trained", record["end"])
    record["final_w"] = 0.0 if record["left"] else algorithm.w
    record["minted"] = algorithm.stats().get("ps_minted", 0.0)
    record["retired"] = algorithm.mass.retired_w
    record["in_flight"] = algorithm.stats().get("ps_in_flight", 0.0)
    return record


def in_daemon_thread(name: str, fn, *args) -> concurrent.futures.Future:
    """Run fn(*args) in a daemon thread; its result as a future. A node that never ends (waiting
    on peers that are gone) then cannot keep its process alive past the run's timeout, as a
    ThreadPoolExecutor's worker would: the interpreter joins those at exit."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # (handed to whoever waits on the future)
            future.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


class Churn:
    """Starts this process's joiners when its nodes reach their join steps (each joins as a member
    leaves: Plan.churn)."""

    def __init__(self, plan: Plan, ranks: list[int], transports: list[Transport], progress: dict[int, int],
                 halt: threading.Event, loop: LoopThread | None, local: LocalServices | None = None):
        self.plan, self.transports, self.progress, self.halt, self.loop = plan, transports, progress, halt, loop
        self.local = local
        self.due = sorted((step, joining) for step, _, joining in plan.churn if joining in ranks)
        self.futures: list[concurrent.futures.Future] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="churn", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while self.due and not self._done.wait(WATCH_SECONDS * 4):
            if max(self.progress.values(), default=-1) >= self.due[0][0]:
                _, rank = self.due.pop(0)
                plan = self.plan
                transport = Transport(rank, plan.world, list(plan.peers), listen=plan.peers[rank],
                                      options=plan.options(), metrics=NodeMetrics(rank, "sgp"),
                                      loop=self.loop, local=self.local).start()
                self.transports.append(transport)
                self.futures.append(in_daemon_thread(f"node-{rank}", run_joiner, plan, transport, self.progress,
                                                     self.halt))

    def results(self, deadline: float) -> list[dict]:
        """The joiners' records, waiting for them until `deadline` (time.monotonic()) in all."""
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self.due:
            raise TimeoutError(f"joiners {[rank for _, rank in self.due]} never started: the members did not reach "
                               f"their join steps in time")
        done, waiting = concurrent.futures.wait(self.futures, max(0.0, deadline - time.monotonic()))
        if waiting:
            raise TimeoutError(f"{len(waiting)} joiner(s) unfinished at the timeout")
        return [future.result() for future in self.futures]

    def stop(self) -> None:
        self._done.set()


def report_progress(ranks: list[int], progress: dict[int, int], end: int, halt: threading.Event) -> None:
    """Every PROGRESS_SECONDS until the run ends, one line on stderr: how many of this process's
    nodes are stepping and their slowest and fastest step (a long simulation shows it is moving)."""
    began = time.monotonic()
    while not halt.wait(PROGRESS_SECONDS):
        steps = list(progress.values())
        where = f"steps {min(steps)}..{max(steps)} of {end}" if steps else "setting up"
        print(f"[{time.monotonic() - began:.0f}s] nodes {ranks[0]}, {ranks[1] if len(ranks) > 1 else ''}...: "
              f"{len(steps)} of {len(ranks)} stepping, {where}", file=sys.stderr, flush=True)


def stop_all(transports: list[Transport]) -> None:
    """Stop the transports together: each waits out its grace period (and, on a loop busy with
    hundreds of nodes, its shutdown's timeout), so one after another took hours at 512 nodes."""
    if transports:
        with concurrent.futures.ThreadPoolExecutor(min(len(transports), STOPPERS), "stop") as pool:
            list(pool.map(Transport.stop, transports))


def host(plan: Plan, ranks: list[int]) -> dict:
    """Run the nodes `ranks` of `plan` in this process (joiners among them start when the churn
    says); their records, the joiners', the views each node held, the process's start time and
    its thread count."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # every node holds a channel to every peer
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: where a slow process waits
    gc.freeze()  # (what is imported by now lives to the end: never scanned again)
    gc.set_threshold(*GC_THRESHOLDS)
    sys.setswitchinterval(SWITCH_INTERVAL)
    torch.set_num_threads(1)
    began = time.time()
    deadline = time.monotonic() + plan.timeout  # for the members and the joiners together
    transports: list[Transport] = []
    comms: list[Communicator] = []
    watcher = churn = None
    members = [rank for rank in ranks if rank < plan.nodes]
    progress: dict[int, int] = {}
    halt = threading.Event()  # set when the run ends early: every node thread stops at its next step
    loop = LoopThread("p2ptrain-nodes", "simulated nodes' loop") if plan.shared_loop else None
    local = LocalServices() if loop is not None and not plan.grpc_calls else None
    try:
        for rank in members:
            transports.append(Transport(rank, plan.world, list(plan.peers), listen=plan.peers[rank],
                                        options=plan.options(), metrics=NodeMetrics(rank, "sgp"), loop=loop,
                                        local=local).start())
        comms = [Communicator(t, "cpu", peer_timeout=plan.timeout) for t in transports]
        watcher = ViewWatcher(transports, plan.leaver)
        threading.Thread(target=report_progress, args=(ranks, progress, plan.end, halt), name="progress",
                         daemon=True).start()
        churn = Churn(plan, ranks, transports, progress, halt, loop, local)
        futures = [in_daemon_thread(f"node-{comm.rank}", run_node, plan, comm, progress, halt) for comm in comms]
        done, _ = concurrent.futures.wait(futures, max(0.0, deadline - time.monotonic()),
                                          return_when=concurrent.futures.FIRST_EXCEPTION)
        for future in done:  # the first failure ends the run at once (the finally stops every node)
            if future.exception() is not None:
                failure = "".join(traceback.format_exception(future.exception())[-4:]).rstrip()
                print(f"nodes {ranks[0]}...: a node failed; stopping them all:\n{failure}", file=sys.stderr, flush=True)
                raise future.exception()
        if len(done) < len(futures):
            raise TimeoutError(f"{len(futures) - len(done)} nodes of {ranks[:3]}... unfinished after {plan.timeout}s")
        records = [future.result() for future in futures]
        joiners = churn.results(deadline)
        watcher.stop()
        print(f"nodes {ranks[0]}, {ranks[1] if len(ranks) > 1 else ''}...: done in {time.time() - began:.1f}s",
              file=sys.stderr, flush=True)
        for record in records:
            record["adopted"] = watcher.adopted.get(record["rank"])
        return {"began": began, "threads": watcher.peak_threads, "records": records, "joiners": joiners,
                "views": {rank: seen for rank, seen in watcher.views.items()}}
    finally:
        halt.set()
        if churn is not None:
            churn.stop()
        if watcher is not None:
            watcher.stop()
        stop_all(transports)
        for comm in comms:
            comm.close()
        if loop is not None:
            loop.stop(lambda: asyncio.sleep(0), grace=0.0)


__all__ = ["DATA_METHOD", "OPTIONS", "Churn", "Plan", "Vector", "counters", "host", "in_daemon_thread",
           "make_optimizer", "report_progress", "run_joiner", "run_node", "stop_all"]
