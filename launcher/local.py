"""Run a cluster of `p2ptrain node` processes on this machine and watch it.

The launcher owns the node processes' lifetime: nothing it starts outlives it, whether the run
succeeds, a node fails, the run times out or the user presses Ctrl-C. Progress comes only from
the files nodes write into the run folder, so any node honouring that contract can be launched.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence, TextIO

from launcher.chaos import MIN_ALIVE
from p2ptrain.addresses import join_address
from p2ptrain.exit_codes import EXIT_NO_CLUSTER
from p2ptrain.settings.parsers import AtStep, LinkBurst, SlowWindow
from p2ptrain.train.mass_record import mass_path, read_mass_record

from . import prometheus as scrape_config
from . import report as run_report
from . import verdicts as chaos_verdicts
from .interrupts import sigint_interrupts
from .ports import free_ports

TERM_GRACE_SECONDS = 5.0        # SIGTERM -> SIGKILL delay when stopping nodes
STACK_DUMP_SECONDS = 1.0        # SIGUSR1 (stacks to the log) -> SIGKILL, for a node that ignored SIGTERM
POLL_SECONDS = 0.5              # progress / exit-status polling period
LOG_EVERY_SECONDS = 5.0         # non-TTY: at most one progress line per node this often
ERROR_EXIT_GRACE_SECONDS = 2.0  # after an error event, wait this long for the node's own exit code
LOG_TAIL_LINES = 20             # log lines quoted in a ClusterError
NETNS_NODE_PORT = 50051         # with one address per node (own namespace) every node uses these ports
NETNS_METRICS_PORT = 9400

# One thread per process: N nodes share this machine's cores, and unbuffered output keeps the
# logs current when a node is killed.
NODE_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


class ClusterError(RuntimeError):
    """The run failed: a node exited non-zero or reported an error, or the run timed out.

    `rank` / `returncode` are None when no single node is to blame (timeout).
    """

    def __init__(self, message: str, *, rank: int | None = None, returncode: int | None = None):
        super().__init__(message)
        self.rank = rank
        self.returncode = returncode


@dataclass
class NodeProcessSpec:
    """What is started for one rank; built before anything starts so it can be inspected."""
    rank: int
    argv: list[str]
    env: dict[str, str]
    name: str = ""  # log file stem; default node{rank}
    host: str = ""  # address the process is reached at when it differs per rank (netns); "" = the cluster's host

    @property
    def log_name(self) -> str:
        return f"{self.name or f'node{self.rank}'}.log"


def node_argv(rank: int, world_size: int, peers: list[str], metrics_port: int | None,
              out_dir: Path, extra_args: list[str], python: str = sys.executable) -> list[str]:
    """Command line of one `p2ptrain node` process."""
    argv = [python, "-m", "p2ptrain", "node", "--rank", str(rank), "--world-size", str(world_size),
            "--peers", ",".join(peers), "--out", str(out_dir)]
    if metrics_port is not None:
        argv += ["--metrics-port", str(metrics_port)]
    return [*argv, *extra_args]


def node_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The launcher's environment plus NODE_ENV."""
    return {**(os.environ if base is None else base), **NODE_ENV}


def script_cluster(script: list[str], settings_env: dict[str, str]) -> dict:
    """run_local_cluster keyword arguments that start `script` (a training script of your own,
    e.g. ["python", "train.py", "--epochs", "3"]) once per rank instead of `p2ptrain node`, like
    torchrun: RANK, WORLD_SIZE, LOCAL_RANK, the peers (P2PTRAIN_PEERS), the run folder
    (P2PTRAIN_OUT), the metrics port and every setting given to launch (P2PTRAIN_<SETTING>) are in
    its environment, where p2ptrain.init() finds them."""
    if not script:
        raise ValueError("nothing to run after --")

    def argv(rank, world_size, peers, metrics_port, out_dir, extra_args, python=sys.executable):
        return [python if script[0] in ("python", "python3") else script[0], *script[1:]]

    def env(rank, world_size, peers, metrics_port, out_dir):
        return {**settings_env, "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(world_size), "P2PTRAIN_PEERS": ",".join(peers), "P2PTRAIN_OUT": str(out_dir),
                **({"P2PTRAIN_METRICS_PORT": str(metrics_port)} if metrics_port is not None else {})}

    return {"argv_factory": argv, "env_factory": env}


def plan_cluster(nodes: int, out_dir: Path, extra_args: list[str], *, host: str = "127.0.0.1",
                 metrics: bool = True, argv_factory: Callable[..., list[str]] = node_argv,
                 hosts: list[str] | None = None, argv_prefixes: list[list[str]] | None = None,
                 env_factory: Callable[..., dict[str, str]] | None = None,
                 world_size: int | None = None) -> list[NodeProcessSpec]:
    """Assign ports and build every node's command line (and, with `env_factory`, its own
    environment variables: a script of your own learns its rank and peers there).

    `hosts` gives every rank its own address (its own network namespace, launcher/netns.py): ports
    there cannot be probed from here and are all free, so each node listens on its address with
    NETNS_NODE_PORT (metrics on NETNS_METRICS_PORT). `argv_prefixes[rank]` goes in front of the
    rank's command (`ip netns exec NS`). `world_size`: the nodes that start together (an elastic
    run plans `nodes` ranks, the ones beyond join later); default `nodes`.
    """
    if nodes < 1:
        raise ValueError(f"nodes must be >= 1, got {nodes}")
    for name, per_rank in (("hosts", hosts), ("argv_prefixes", argv_prefixes)):
        if per_rank is not None and len(per_rank) != nodes:
            raise ValueError(f"{name} needs one entry per node: {len(per_rank)} for {nodes} nodes")
    if hosts is None:
        ports = free_ports(2 * nodes if metrics else nodes, host)
        peers = [join_address(host, port) for port in ports[:nodes]]
        metrics_ports = ports[nodes:] if metrics else [None] * nodes
    else:
        peers = [join_address(h, NETNS_NODE_PORT) for h in hosts]
        metrics_ports = [NETNS_METRICS_PORT if metrics else None] * nodes
    specs = []
    world = world_size or nodes
    for rank in range(nodes):
        argv = argv_factory(rank, world, peers, metrics_ports[rank], Path(out_dir), list(extra_args))
        env = node_env()
        if env_factory is not None:
            env.update(env_factory(rank, world, peers, metrics_ports[rank], Path(out_dir)))
        if hosts is not None:
            if env_factory is not None:
                env["P2PTRAIN_LISTEN"] = peers[rank]
            else:
                argv += ["--listen", peers[rank]]
        specs.append(NodeProcessSpec(rank=rank, env=env, host=hosts[rank] if hosts else "",
                                     argv=[*(argv_prefixes[rank] if argv_prefixes else []), *argv]))
    return specs


def run_local_cluster(nodes: int, out_dir: Path, extra_args: list[str], *, config: dict | None = None,
                      host: str = "127.0.0.1", metrics: bool = True, live: bool | None = None,
                      timeout: float | None = None, argv_factory: Callable[..., list[str]] = node_argv,
                      stream: TextIO = sys.stderr, services: list[NodeProcessSpec] = (),
                      service_grace: float = 30.0, hosts: list[str] | None = None,
                      argv_prefixes: list[list[str]] | None = None, faults: list["FaultEvent"] = (),
                      env_factory: Callable[..., dict[str, str]] | None = None, total_steps: int | None = None,
                      push_sum: bool = False, title: str = "", first: int | None = None,
                      verdicts: chaos_verdicts.VerdictOptions | None = None) -> dict:
    """Run `nodes` node processes to completion and return the run report.

    `services` (e.g. a parameter server) start first and may finish on their own once the nodes
    are done (they get `service_grace` seconds); one exiting non-zero fails the run.
    `hosts` / `argv_prefixes`: one address / command prefix per rank (see plan_cluster).
    `first`: an elastic run starts ranks below it; the others start at once too, and join by
    themselves when the cluster reaches their `join` event's step.
    `verdicts`: judge the run (launcher/verdicts.py) with these bounds; a run that fired faults is
    judged with the default ones anyway, but only a run given `verdicts` (--chaos) fails on them.
    The verdicts go into the report and are printed; a failed
    one raises ClusterError.
    Raises ClusterError on the first node failure or on timeout, after stopping every process;
    KeyboardInterrupt after the same cleanup on SIGINT, also where the launcher inherited SIGINT
    ignored (launcher/interrupts.py).
    """
    with sigint_interrupts():
        out_dir = Path(out_dir)
        log_dir = out_dir / "logs"
        stale = run_report.clear_earlier_run(out_dir)  # a reused folder: never judge this run by the last one's files
        log_dir.mkdir(parents=True, exist_ok=True)
        specs = plan_cluster(nodes, out_dir, extra_args, host=host, metrics=metrics, argv_factory=argv_factory,
                             hosts=hosts, argv_prefixes=argv_prefixes, env_factory=env_factory, world_size=first)
        scrape_config.write_launch_config(out_dir, [*services, *specs], host)  # OUT/prometheus.yml
        watcher = _ProgressWatcher(out_dir, nodes)
        for state in watcher.states[first if first is not None else nodes:]:
            state.down = state.joins = True  # joins later (its join event starts it)
        view = ProgressView(stream, stream.isatty() if live is None else live,
                            total_steps if total_steps is not None else steps_from_args(extra_args), push_sum=push_sum)
        processes = _NodeProcesses(specs, log_dir, out_dir)
        service_processes = _NodeProcesses(list(services), log_dir)

        print(f"launching {nodes} nodes{f' and {len(services)} service(s)' if services else ''}; run folder "
              f"{out_dir}, logs in {log_dir}", file=stream, flush=True)
        if stale:
            print(f"(removed {len(stale)} files of an earlier run in {out_dir})", file=stream, flush=True)
        start = time.monotonic()
        failure: ClusterError | None = None
        try:
            service_processes.start()
            processes.start(first)
            for event in faults:  # joiners start now (imports, data, server) and join at their step
                if event.action == "join":
                    processes.join(event.rank, event.at_step)
            _supervise(processes, watcher, view, start, timeout, log_dir, service_processes, faults=faults,
                       stream=stream, fault_log=out_dir / run_report.FAULT_LOG if faults else None)
            _wait_services(service_processes, service_grace, log_dir)
        except ClusterError as exc:  # the report is still written: which node failed, and why
            failure = exc
        finally:
            processes.stop()
            service_processes.stop()
            watcher.refresh(processes.returncodes(), final=True)
            view.finish(watcher.states, time.monotonic() - start)
        wall_seconds = time.monotonic() - start

        result = run_report.build_report(out_dir, nodes, config, wall_seconds)
        _record_outcomes(result, watcher.states, failure)
        judged = []
        if verdicts is not None or result.get("faults"):
            judged = chaos_verdicts.judge(out_dir, result, verdicts or chaos_verdicts.VerdictOptions())
            result["verdicts"] = chaos_verdicts.as_dicts(judged)
        report_path = run_report.write_report(result, out_dir)
        print(f"report: {report_path}", file=stream)
        try:
            print(f"plot:   {run_report.plot(result, out_dir)}", file=stream)
        except Exception as exc:  # a cosmetic failure must not fail a finished training run
            print(f"plot failed: {exc!r}", file=stream)
        for warning in result["warnings"]:
            print(f"warning: {warning}", file=stream)
        if judged:
            print("verdicts:\n" + "\n".join(f"  {v.line()}" for v in judged), file=stream)
        stream.flush()
        if failure is not None:
            raise failure
        nonfinite = [n for n in result["nodes"] if n.get("nonfinite_step") is not None]
        if nonfinite:
            first_bad = nonfinite[0]
            raise ClusterError(f"node {first_bad['rank']} went non-finite ({first_bad.get('nonfinite')}) from step "
                               f"{first_bad['nonfinite_step']}", rank=first_bad["rank"])
        if verdicts is not None and chaos_verdicts.failed(judged):  # (hand-written faults: judged, not enforced)
            raise ClusterError(f"verdicts failed: {', '.join(chaos_verdicts.failed(judged))} (see {report_path})")
        return result


def _record_outcomes(report: dict, states: list["NodeState"], failure: "ClusterError | None") -> None:
    """Per node how it ended (done, killed, failed, not rejoined ... with the reason) and, for the
    cluster, whether the run failed: a node crashed, or its loss or model went non-finite."""
    failed_nodes = []
    for summary, state in zip(report["nodes"], states):
        stopped = (failure is not None and state.rank != failure.rank and state.returncode is not None
                   and state.returncode < 0 and state.event != "error")
        summary["outcome"] = "stopped" if stopped else state.outcome  # by the launcher, after another failed
        if state.outcome_reason:
            summary["outcome_reason"] = state.outcome_reason
        if stopped:
            continue
        if summary.get("nonfinite_step") is not None:
            failed_nodes.append({"rank": state.rank, "reason": f"non-finite {summary.get('nonfinite', 'value')} "
                                                               f"from step {summary['nonfinite_step']}"})
        elif state.failed:
            failed_nodes.append({"rank": state.rank, "reason": state.message or state.status})
    cluster = report["cluster"]
    cluster["failed"] = failure is not None or bool(failed_nodes)
    cluster["failed_nodes"] = failed_nodes
    if failure is not None:
        cluster["failure"] = str(failure).splitlines()[0]


def steps_from_args(args: list[str]) -> int | None:
    """The value of `--steps` in the node arguments, used as the progress total."""
    for i, arg in enumerate(args):
        if arg == "--steps" and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith("--steps="):
            value = arg.split("=", 1)[1]
        else:
            continue
        try:
            return int(value)
        except ValueError:
            return None
    return None


def parameter_server_cluster(workers: int, out: Path, node_args: list[str], *, metrics: bool,
                             host: str = "127.0.0.1", prefix: Sequence[str] = ()) -> dict:
    """run_local_cluster keyword arguments for one `p2ptrain ps` process (a service) plus `workers`
    asynchronous `--role worker` nodes pointed at it (GEM and its baselines). `host` / `prefix`:
    where it listens and what runs it there (--netns: its own namespace's address and `ip netns exec`)."""
    ps_port, ps_metrics = free_ports(2)
    address = f"{host}:{ps_port}"
    ps_argv = [*prefix, sys.executable, "-m", "p2ptrain", "ps", "--world-size", str(workers), "--listen", address,
               "--out", str(out), *node_args]
    if metrics:
        ps_argv += ["--metrics-port", str(ps_metrics)]

    def worker_argv(rank, world_size, peers, metrics_port, out_dir, extra_args, python=sys.executable):
        argv = node_argv(rank, world_size, peers, metrics_port, out_dir, extra_args, python)
        at = argv.index("--peers")
        return [*argv[:at], *argv[at + 2:], "--role", "worker", "--ps-address", address]

    return {"services": [NodeProcessSpec(rank=-1, argv=ps_argv, env=node_env(), name="ps")],
            "argv_factory": worker_argv}


# --- faults: kill and restart nodes mid-run --------------------------------------------------------

@dataclass(frozen=True)
class FaultEvent:
    """Kill (SIGKILL, no goodbye), restart, or stall (SIGSTOP, then SIGCONT `seconds` later: a GC
    pause, swap storm or preempted VM) one node once the cluster reaches a step (the highest step
    any node reported), e.g. to check that the others train on and the node rejoins; or, in an
    elastic run, start a new node that joins (`join`) or ask one to leave (`leave`: SIGTERM). A link
    burst (`link`) or slow window (`slow`) is the nodes' own to apply at their steps: the launcher
    only logs it when the cluster gets there."""
    action: str  # "kill" | "restart" | "stall" | "join" | "leave" | "link" | "slow"
    rank: int    # (link: the sending end)
    at_step: int
    seconds: float = 0.0  # stall only
    peer: int | None = None  # link: the other end
    both_ways: bool = False  # link: SRC<->DST
    steps: int = 0  # link, slow: how many steps it lasts
    spec: str = ""  # link: the link spec; slow: the factor

    @classmethod
    def parse(cls, action: str, spec: str, nodes: int) -> "FaultEvent":
        stall = action == "stall"
        try:
            rank, step, seconds = AtStep.parse(spec, seconds=stall, example="2@100:20" if stall else "2@100")
        except ValueError as exc:
            raise ValueError(f"--{action} {spec!r}: {exc}") from None
        event = cls(action, rank, step, seconds or 0.0)
        if not 0 <= event.rank < nodes:
            raise ValueError(f"--{action} {spec!r}: rank {event.rank} outside 0..{nodes - 1}")
        return event

    @classmethod
    def scheduled(cls, action: str, entry: str, nodes: int) -> "FaultEvent":
        """A `link` (--link-burst SRC<->DST@STEP+STEPS:SPEC) or `slow` (--slow RANK@STEP+STEPS:FACTOR) entry."""
        flag = "--link-burst" if action == "link" else "--slow"
        try:
            if action == "link":
                burst = LinkBurst.parse(entry)
                event = cls(action, burst.src, burst.window.start, peer=burst.dst, both_ways=burst.both_ways,
                            steps=burst.window.steps, spec=burst.spec)
            else:
                window = SlowWindow.parse(entry)
                event = cls(action, window.rank, window.window.start, steps=window.window.steps,
                            spec=f"{window.factor:g}")
        except ValueError as exc:
            raise ValueError(f"{flag}: {exc}") from None
        if not all(0 <= r < nodes for r in (event.rank, event.peer or 0)):
            raise ValueError(f"{flag} {entry!r}: a rank outside 0..{nodes - 1}")
        return event

    @property
    def window(self) -> dict:
        """A link burst's or slow window's fields for OUT/faults.jsonl (other faults: none)."""
        if self.action == "link":
            return {"peer": self.peer, "both_ways": self.both_ways, "spec": self.spec, "steps": self.steps}
        return {"spec": self.spec, "steps": self.steps} if self.action == "slow" else {}

    @property
    def what(self) -> str:
        """A link burst or slow window in words, for the launcher's line (other faults: "")."""
        if self.action == "link":
            return f" {'<->' if self.both_ways else '->'} node {self.peer}: {self.spec} for {self.steps} steps"
        if self.action == "slow":
            return f": compute {self.spec}x slower for {self.steps} steps"
        return ""


def join_plan(joins: list[str], nodes: int) -> list[FaultEvent]:
    """`--join COUNT@STEP` events: COUNT new nodes start at STEP, ranks nodes, nodes + 1, ... in step order."""
    parsed = []
    for spec in joins:
        try:
            count, step, _ = AtStep.parse(spec, number="COUNT", example="2@100")
        except ValueError as exc:
            raise ValueError(f"--join {spec!r}: {exc}") from None
        if count < 1:
            raise ValueError(f"--join {spec!r}: COUNT must be >= 1")
        parsed.append((step, count))
    events, rank = [], nodes
    for step, count in sorted(parsed):
        for _ in range(count):
            events.append(FaultEvent("join", rank, step))
            rank += 1
    return events


def fault_plan(kills: list[str], restarts: list[str], nodes: int, stalls: list[str] = (), joins: list[str] = (),
               leaves: list[str] = (), link_bursts: list[str] = (), slows: list[str] = ()) -> list[FaultEvent]:
    """Validated events in step order; a restart needs an earlier kill of the same rank; a node
    leaves (SIGTERM) once at most, after it joined, and at least one node stays. Link bursts and
    slow windows (the nodes apply them) are there to be logged."""
    joined = join_plan(list(joins), nodes)
    slots = nodes + len(joined)
    events = [FaultEvent.parse("kill", k, slots) for k in kills] + \
             [FaultEvent.parse("restart", r, slots) for r in restarts] + \
             [FaultEvent.parse("stall", s, slots) for s in stalls] + joined + \
             [FaultEvent.parse("leave", leave, slots) for leave in leaves] + \
             [FaultEvent.scheduled("link", b, slots) for b in link_bursts] + \
             [FaultEvent.scheduled("slow", w, slots) for w in slows]
    started = {e.rank: e.at_step for e in joined}
    left = [e.rank for e in events if e.action == "leave"]
    for event in events:
        if event.action == "leave" and event.at_step <= started.get(event.rank, -1):
            raise ValueError(f"--leave {event.rank}@{event.at_step}: node {event.rank} joins only at step "
                             f"{started[event.rank]}")
    if len(set(left)) != len(left):
        raise ValueError("a node leaves twice")
    if len(set(left)) >= slots:
        raise ValueError("the plan lets every node leave")
    events.sort(key=lambda e: (e.at_step, e.action != "kill"))
    down: set[int] = set()
    for event in events:
        if event.action in ("link", "slow"):  # the nodes' own, on whoever is up then
            continue
        if event.action in ("stall", "join", "leave"):
            if event.rank in down:
                raise ValueError(f"--{event.action} {event.rank}@{event.at_step}: node {event.rank} is killed then")
            continue
        if event.action == "kill":
            if event.rank in down:
                raise ValueError(f"node {event.rank} is killed twice without a restart in between")
            down.add(event.rank)
        else:
            if event.rank not in down:
                raise ValueError(f"--restart {event.rank}@{event.at_step}: node {event.rank} is not killed before")
            down.discard(event.rank)
    if len(down) >= nodes:
        raise ValueError("the fault plan leaves no node running")
    return events


def _apply_faults(events: list[FaultEvent], processes: "_NodeProcesses", watcher: "_ProgressWatcher",
                  stream: TextIO, log: Callable[[dict], None] = lambda entry: None) -> None:
    """Fire every due event (in order); fired events are removed from `events`, and each one is
    said on `stream` and given to `log` (what, which node, the planned and the actual step)."""
    cluster_step = max((s.step or 0 for s in watcher.states), default=0)
    for event in [e for e in events if e.at_step <= cluster_step]:
        state = watcher.states[event.rank]
        if event.action == "leave" and (state.step is None or state.joins):
            continue  # not training yet (a node that just joined): it leaves once it is
        if event.action in ("kill", "leave") and \
                _training_besides(watcher, event.rank) < min(MIN_ALIVE, len(watcher.states) - 1):
            continue  # the others are (re)starting: it waits until MIN_ALIVE of them train again
        if event.action == "restart" and not state.down:
            continue  # (its kill waits, above)
        events.remove(event)
        note, extra = "", {}
        if event.action == "kill":
            held = processes.kill(event.rank)
            state.down = True
            if held is not None:  # push-sum: what went down with it (launcher/verdicts.py's mass ledger)
                extra = {"mass_lost": held.w, "mass_uncertain": held.uncertain, "mass_in_flight": held.in_flight,
                         "mass_inbox": held.inbox, "mass_minted": held.minted, "mass_step": held.step,
                         "mass_flows": held.flows()}
        elif event.action == "join":  # (started at launch with --join-at: it joins by itself now)
            state.down = state.joins = False
            state.late = True
        elif event.action == "leave":
            processes.leave(event.rank)
        elif event.action == "stall":
            processes.stall(event.rank, event.seconds)
            note = f" for {event.seconds:g}s"
        elif event.action in ("link", "slow"):  # the nodes apply it at this step themselves
            note = event.what
        elif all(s.returncode is not None or s.down for s in watcher.states if s.rank != event.rank):
            state.note = "not rejoined: the cluster had finished when the restart was due"
            note = " skipped: every other node has finished"
        else:
            processes.restart(event.rank)
            # (no step until the new process reports one: a leave waits for it to train)
            state.down, state.returncode, state.event, state.message, state.step = False, None, None, None, None
            state.restarts += 1
            state.late = True
        print(f"fault: {event.action} node {event.rank}{note} at cluster step {cluster_step}", file=stream, flush=True)
        log({"action": event.action, "rank": event.rank, "planned_step": event.at_step,
             "cluster_step": cluster_step, "seconds": event.seconds, "skipped": "skipped" in note, **event.window,
             **extra})


def _drop_unfired(events: list[FaultEvent], watcher: "_ProgressWatcher", stream: TextIO,
                  log: Callable[[dict], None]) -> None:
    """Every node has exited: the events still waiting (a kill that waited for enough others to
    train, the restart after it, a join of a node that gave up) can never fire. Each is said and
    logged as skipped, so the launcher ends instead of waiting for them forever."""
    cluster_step = max((s.step or 0 for s in watcher.states), default=0)
    for event in list(events):
        events.remove(event)
        print(f"fault: {event.action} node {event.rank} skipped: the cluster had finished", file=stream, flush=True)
        log({"action": event.action, "rank": event.rank, "planned_step": event.at_step, "cluster_step": cluster_step,
             "seconds": event.seconds, "skipped": True, **event.window})


def _training_besides(watcher: "_ProgressWatcher", rank: int) -> int:
    """Nodes other than `rank` that are training now: running, past their start (or rejoin), not
    killed. A kill or leave waits while fewer than MIN_ALIVE are: a plan counts a restarted node as
    back at its restart step, but it takes seconds (a process start, a state transfer) to train
    again, and overlapping kills then took every member down."""
    return sum(1 for s in watcher.states if s.rank != rank and s.returncode is None and not s.down
               and s.step is not None and not s.joins)


def _fault_logger(path: Path | None, start: float) -> Callable[[dict], None]:
    """Appends each fired fault to `path` (OUT/faults.jsonl) with the seconds since the launch and
    the unix time (the nodes' progress lines carry that: the verdicts line them up)."""
    def log(entry: dict) -> None:
        if path is not None:
            with path.open("a", encoding="utf-8") as out:
                out.write(json.dumps({**entry, "wall_s": round(time.monotonic() - start, 3),
                                      "time": round(time.time(), 3)}) + "\n")
    return log


# --- supervision ---------------------------------------------------------------------------------

def _supervise(processes: "_NodeProcesses", watcher: "_ProgressWatcher", view: "ProgressView",
               start: float, timeout: float | None, log_dir: Path,
               services: "_NodeProcesses | None" = None, faults: list[FaultEvent] = (),
               stream: TextIO = sys.stderr, fault_log: Path | None = None) -> None:
    """Poll until every node exited 0 (or was killed for good by the fault plan); raise
    ClusterError on the first failure or on timeout."""
    faults = list(faults)
    log = _fault_logger(fault_log, start)
    while True:
        _check_services(services, log_dir)
        watcher.refresh(processes.returncodes())
        processes.resume_stalled()
        if faults:
            _apply_faults(faults, processes, watcher, stream, log)
        if faults and all(s.returncode is not None or s.down for s in watcher.states):
            _drop_unfired(faults, watcher, stream, log)
        elapsed = time.monotonic() - start
        view.update(watcher.states, elapsed)
        failed = [s for s in watcher.states if s.failed]
        if failed:
            raise _failure_error(failed, processes, watcher, log_dir)
        if all(s.returncode == 0 or s.down or (s.returncode is not None and s.outcome_reason)
               for s in watcher.states) and not any(e.action in ("restart", "join") for e in faults):
            processes.resume_stalled(everything=True)
            return
        if timeout is not None and elapsed >= timeout:
            running = [s.rank for s in watcher.states if s.returncode is None]
            raise ClusterError(f"cluster timed out after {timeout:g} s; still running: ranks "
                               f"{', '.join(map(str, running))}\n" + _log_excerpt(log_dir, running[0]))
        time.sleep(POLL_SECONDS if timeout is None else max(0.0, min(POLL_SECONDS, timeout - elapsed)))


def _check_services(services: "_NodeProcesses | None", log_dir: Path) -> None:
    if services is None:
        return
    for spec, code in zip(services.specs, services.returncodes()):
        if code not in (None, 0):
            raise ClusterError(f"{spec.name} exited with code {code}\n" + _log_excerpt(log_dir, spec.log_name))


def _wait_services(services: "_NodeProcesses", grace: float, log_dir: Path) -> None:
    """After the nodes: let services finish on their own (a parameter server stops once every
    worker said done), then check how they ended."""
    deadline = time.monotonic() + grace
    while any(code is None for code in services.returncodes()) and time.monotonic() < deadline:
        time.sleep(0.1)
    _check_services(services, log_dir)


def _failure_error(failed: list["NodeState"], processes: "_NodeProcesses", watcher: "_ProgressWatcher",
                   log_dir: Path) -> ClusterError:
    """Describe the first failed node; nodes that reported an error get a moment to exit so
    the message can carry their real exit code."""
    culprit = failed[0]
    if culprit.returncode is None:
        processes.wait(culprit.rank, ERROR_EXIT_GRACE_SECONDS)
        watcher.refresh(processes.returncodes())
    if culprit.returncode is None:
        how = "reported an error and was still running (stopped by the launcher)"
    else:
        how = f"exited with code {culprit.returncode}"
    lines = [f"node {culprit.rank} failed: {how}"]
    if culprit.message:
        lines.append(f"error event: {culprit.message}")
    if len(failed) > 1:
        lines.append(f"also failed: ranks {', '.join(str(s.rank) for s in failed[1:])}")
    lines.append(_log_excerpt(log_dir, culprit.rank))
    return ClusterError("\n".join(lines), rank=culprit.rank, returncode=culprit.returncode)


def _log_excerpt(log_dir: Path, rank: int | str) -> str:
    path = log_dir / (rank if isinstance(rank, str) else f"node{rank}.log")
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 64 * 1024))
            tail = f.read().decode(errors="replace").splitlines()[-LOG_TAIL_LINES:]
    except OSError as exc:
        return f"(cannot read {path}: {exc})"
    body = "\n".join(f"  {line}" for line in tail) if tail else "  (empty)"
    return f"last {len(tail)} lines of {path}:\n{body}"


class _NodeProcesses:
    """The node processes and their log files.

    Each node runs in its own session, so Ctrl-C in the terminal reaches only the launcher, and
    stopping a node signals its whole process group (helpers it forked included).
    """

    def __init__(self, specs: list[NodeProcessSpec], log_dir: Path, out_dir: Path | None = None):
        self.specs = specs
        self.log_dir = log_dir
        self.out_dir = out_dir  # where push-sum nodes keep their mass record (kill reads it)
        self.procs: list[subprocess.Popen] = []
        self._logs: list = []
        self._swept: set[int] = set()
        self._stalled: dict[int, float] = {}  # rank -> monotonic time to resume it (SIGCONT)
        self._joined: set[int] = set()        # ranks started by join(): beyond the starting nodes

    def start(self, count: int | None = None) -> None:
        """Start the first `count` nodes (all by default; the others join later: join())."""
        for index, spec in enumerate(self.specs[:count]):
            self._spawn(index, spec.env, "wb")

    def _spawn(self, index: int, env: dict[str, str], mode: str) -> None:
        """Start specs[index] (ranks index the specs; a service's rank is -1, its index is its place)."""
        spec = self.specs[index]
        log = open(self.log_dir / spec.log_name, mode)
        self._logs.append(log)
        proc = subprocess.Popen(spec.argv, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        if index < len(self.procs):
            self.procs[index] = proc
        else:
            self.procs.append(proc)

    def returncodes(self) -> list[int | None]:
        """Exit codes, None while running (or not started). Reaps exited nodes and sweeps their
        process groups at once, while their pid cannot have been recycled yet."""
        codes = [p.poll() for p in self.procs]
        for proc, code in zip(self.procs, codes):
            if code is not None:
                self._sweep(proc)
        return codes + [None] * (len(self.specs) - len(codes))

    def join(self, rank: int, at_step: int) -> None:
        """Start node `rank`, outside the first ones, as a new member of the running cluster
        (P2PTRAIN_JOIN=1: it takes a live peer's state and starts at the agreed step) once the
        cluster reaches `at_step` (P2PTRAIN_JOIN_AT: it starts up now, so it joins at that step and
        not the seconds of its start-up later)."""
        self._joined.add(rank)
        self._spawn(rank, {**self.specs[rank].env, "P2PTRAIN_JOIN": "1", "P2PTRAIN_JOIN_AT": str(at_step)}, "wb")

    def leave(self, rank: int) -> None:
        """Ask node `rank` to leave gracefully: SIGTERM to it alone (not its group), as docker stop,
        kubectl delete or a Slurm preemption would."""
        if rank < len(self.procs) and self.procs[rank].poll() is None:
            self.procs[rank].send_signal(signal.SIGTERM)

    def kill(self, rank: int):
        """SIGKILL node `rank`'s process group, as a crash would; returns the push-sum mass it held
        then (its mass record, p2ptrain/train/mass_record.py; None for other algorithms), and takes
        the record away so that its next incarnation starts its own."""
        proc = self.procs[rank]
        _signal_group(proc, signal.SIGKILL)
        proc.wait()
        self._sweep(proc)
        if self.out_dir is None:
            return None
        path = mass_path(self.out_dir, rank)
        held = read_mass_record(path)
        path.unlink(missing_ok=True)
        return held

    def stall(self, rank: int, seconds: float) -> None:
        """SIGSTOP node `rank`'s process group for `seconds` (resume_stalled sends SIGCONT)."""
        _signal_group(self.procs[rank], signal.SIGSTOP)
        self._stalled[rank] = time.monotonic() + seconds

    def resume_stalled(self, everything: bool = False) -> None:
        """SIGCONT the stalled nodes whose time is up (all of them with `everything`)."""
        now = time.monotonic()
        for rank, until in list(self._stalled.items()):
            if everything or now >= until:
                _signal_group(self.procs[rank], signal.SIGCONT)
                del self._stalled[rank]

    def restart(self, rank: int) -> None:
        """Start node `rank` again with the same command and P2PTRAIN_REJOIN=1 (it takes a live
        peer's state, or exits at once if the cluster has finished); its log continues in the same
        file."""
        spec = self.specs[rank]
        with open(self.log_dir / spec.log_name, "ab") as log:
            log.write(b"\n--- restarted by the launcher ---\n")
        joined = {"P2PTRAIN_JOIN": "1"} if rank in self._joined else {}  # a rank beyond the starting nodes
        self._spawn(rank, {**spec.env, "P2PTRAIN_REJOIN": "1", **joined}, "ab")

    def wait(self, rank: int, seconds: float) -> None:
        try:
            self.procs[rank].wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            pass

    def stop(self) -> None:
        """SIGTERM every running node, SIGKILL what is left after TERM_GRACE_SECONDS, then kill
        whatever any node left behind. Idempotent."""
        self.resume_stalled(everything=True)  # a stopped process cannot act on SIGTERM
        running = [p for p in self.procs if p.poll() is None]
        for proc in running:
            _signal_group(proc, signal.SIGTERM)
        interrupted = False
        deadline = time.monotonic() + TERM_GRACE_SECONDS
        try:
            for proc in running:
                try:
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        except KeyboardInterrupt:  # a second Ctrl-C skips the grace period, not the cleanup
            interrupted = True
        hung = [proc for proc in running if proc.poll() is None]
        for proc in hung:  # its thread stacks go to its log first (faulthandler, see cli/node.py)
            _signal_process(proc, signal.SIGUSR1)
        if hung:
            time.sleep(STACK_DUMP_SECONDS)
            print(f"p2ptrain launch: {len(hung)} node(s) ignored SIGTERM for {TERM_GRACE_SECONDS:.0f}s; "
                  "their thread stacks are in their logs", file=sys.stderr)
        for proc in hung:
            if proc.poll() is None:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
        for proc in self.procs:
            self._sweep(proc)
        for log in self._logs:
            log.close()
        self._logs.clear()
        if interrupted:
            raise KeyboardInterrupt

    def _sweep(self, proc: subprocess.Popen) -> None:
        """SIGKILL what is left of an exited node's process group (orphaned helpers)."""
        if proc.pid not in self._swept:
            self._swept.add(proc.pid)
            _signal_group(proc, signal.SIGKILL)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # pgid == pid because of start_new_session
    except (ProcessLookupError, PermissionError):
        pass


def _signal_process(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.kill(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# --- progress ------------------------------------------------------------------------------------

class ProgressTail:
    """Incremental reader of one progress.jsonl: each poll reads only new bytes and keeps a
    partial last line until the node finishes writing it."""

    def __init__(self, path: Path):
        self.path = path
        self._offset = 0
        self._partial = b""

    def poll(self, final: bool = False) -> list[dict]:
        """New complete records; with final=True (writer has exited) an unterminated last line
        counts as complete."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            data = b""
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = b"" if final else lines.pop()
        return [r for r in map(run_report.parse_progress_line, lines) if r is not None]


@dataclass
class NodeState:
    """Latest known state of one node, from its progress records and its exit code."""
    rank: int
    step: int | None = None
    loss: float | None = None
    bytes_sent: int | None = None
    bytes_received: int | None = None
    ps_weight: float | None = None
    reach: str | None = None  # reachability and peers not reached directly: "private 2v" (Node.reach)
    event: str | None = None
    message: str | None = None
    returncode: int | None = None
    down: bool = False   # killed by the fault plan (not a failure), or not joined yet
    joins: bool = False  # an elastic run's node that starts later (its join event)
    restarts: int = 0
    late: bool = False   # started after the others: restarted, or joined (it may find the run over)
    note: str | None = None  # why a planned fault did not happen (e.g. a restart after the end)
    first_seen: tuple[int, float] | None = None  # (step, time) of the first and latest progress lines
    last_seen: tuple[int, float] | None = None

    def apply(self, record: dict) -> None:
        if "event" in record:
            self.event = record["event"]
            self.message = record.get("message", self.message)
            return
        for key in ("step", "loss", "bytes_sent", "bytes_received", "ps_weight", "reach"):
            if key in record:
                setattr(self, key, record[key])
        if isinstance(record.get("step"), int) and isinstance(record.get("time"), (int, float)):
            if self.first_seen is None or record["step"] < self.first_seen[0]:
                self.first_seen = (record["step"], record["time"])  # (a restarted node starts over)
            self.last_seen = (record["step"], record["time"])

    @property
    def steps_per_second(self) -> float | None:
        """Steps per second between the first and the latest progress line."""
        if self.first_seen is None or self.last_seen is None or self.last_seen[1] <= self.first_seen[1]:
            return None
        return (self.last_seen[0] - self.first_seen[0]) / (self.last_seen[1] - self.first_seen[1])

    @property
    def found_run_over(self) -> bool:
        """Restarted or joined while the others finished: nothing left to train, not a failure."""
        return self.late and (self.returncode == EXIT_NO_CLUSTER or self.event == "not_rejoined")

    @property
    def failed(self) -> bool:
        if self.found_run_over:
            return False
        return not self.down and (self.event == "error" or self.returncode not in (None, 0))

    @property
    def outcome_reason(self) -> str | None:
        if self.found_run_over:
            return (f"not {'re' if self.restarts else ''}joined: no live member had a state to give "
                    "(the cluster had finished)")
        return self.note

    @property
    def outcome(self) -> str:
        """How the node ended, for the report."""
        if self.outcome_reason:
            return "not joined" if self.late and not self.restarts else "not rejoined"
        if self.joins:
            return "not joined"
        if self.down:
            return "killed"
        if self.failed:
            return "failed"
        return "done" if self.returncode == 0 else self.status

    @property
    def status(self) -> str:
        if self.joins:
            return "to join"
        if self.down:
            return "killed"
        if self.returncode not in (None, 0):
            return f"exited {self.returncode}"
        if self.event in ("error", "done"):
            return self.event
        if self.returncode == 0:
            return "exited 0"
        return "starting" if self.step is None else "running"


class _ProgressWatcher:
    """NodeState for every rank, kept current from the progress files and exit codes."""

    def __init__(self, out_dir: Path, nodes: int):
        self.states = [NodeState(rank) for rank in range(nodes)]
        self._tails = [ProgressTail(run_report.progress_path(out_dir, rank)) for rank in range(nodes)]

    def refresh(self, returncodes: list[int | None], final: bool = False) -> None:
        # Exit codes are taken before reading, so an exited node's records are all on disk.
        for state, tail, code in zip(self.states, self._tails, returncodes):
            for record in tail.poll(final=final or code is not None):
                state.apply(record)
            state.returncode = code


class ProgressView:
    """Shows node states: a table redrawn in place on a terminal (with steps/s and the run's ETA);
    otherwise (CI, files) one aggregated line for the whole cluster at most every
    LOG_EVERY_SECONDS and a final table, so logs stay short. The push-sum weight column appears
    for push-sum algorithms only; the reach column where a node is not public or reaches a peer
    otherwise than directly (r: down a reverse stream, v: via a relay)."""

    COLUMNS = (("rank", 4), ("step", 13), ("loss", 10), ("steps/s", 8), ("MB sent", 9), ("MB recv", 9),
               ("ps-weight", 9), ("reach", 12), ("status", 10))

    def __init__(self, stream: TextIO, live: bool, total_steps: int | None, *, push_sum: bool = False):
        self.stream = stream
        self.live = live
        self.total_steps = total_steps
        self.push_sum = push_sum
        self._drawn_lines = 0
        self._last_log = 0.0

    def update(self, states: list[NodeState], elapsed: float) -> None:
        if self.live:
            self._redraw(self._table(states, elapsed))
        elif elapsed - self._last_log >= LOG_EVERY_SECONDS:
            self._last_log = elapsed
            self._write([f"[{elapsed:7.1f}s] {self._summary_line(states)}"])

    def finish(self, states: list[NodeState], elapsed: float) -> None:
        if self.live:
            self._redraw(self._table(states, elapsed))
        else:
            self._write(self._table(states, elapsed))

    def _columns(self, states: list[NodeState]) -> tuple:
        shown = {"ps-weight": self.push_sum or any(s.ps_weight is not None for s in states),
                 "reach": any(s.reach not in (None, "public") for s in states)}
        return tuple(c for c in self.COLUMNS if shown.get(c[0], True))

    def _cells(self, state: NodeState) -> dict[str, str]:
        total = f"/{self.total_steps}" if self.total_steps is not None else ""
        return {
            "rank": str(state.rank),
            "step": "-" if state.step is None else f"{state.step}{total}",
            "loss": _fmt(state.loss, "{:.4f}"),
            "steps/s": _fmt(state.steps_per_second, "{:.1f}"),
            "MB sent": _fmt(state.bytes_sent, "{:.1f}", 1e-6),
            "MB recv": _fmt(state.bytes_received, "{:.1f}", 1e-6),
            "ps-weight": _fmt(state.ps_weight, "{:.3f}"),
            "reach": state.reach if isinstance(state.reach, str) else "-",
            "status": state.status,
        }

    def eta(self, states: list[NodeState]) -> float | None:
        """Seconds until the slowest running node reaches the last step, at its current rate."""
        running = [s for s in states if s.returncode is None and not s.down and s.step is not None]
        if self.total_steps is None or not running:
            return None
        slowest = min(running, key=lambda s: s.step)
        rate = slowest.steps_per_second
        return max(0.0, (self.total_steps - slowest.step) / rate) if rate else None

    def _summary_line(self, states: list[NodeState]) -> str:
        """The whole cluster in one line (fields without data are left out, never printed as '-')."""
        steps = [s.step for s in states if s.step is not None]
        parts = []
        if steps:
            total = f"/{self.total_steps}" if self.total_steps is not None else ""
            parts.append(f"step {min(steps)}{total}" if min(steps) == max(steps) else
                         f"steps {min(steps)}-{max(steps)}{total}")
        rates = [s.steps_per_second for s in states if s.steps_per_second]
        if rates:
            parts.append(f"{min(rates):.1f} steps/s")
        losses = [s.loss for s in states if isinstance(s.loss, (int, float))]
        if losses:
            parts.append(f"loss {sum(losses) / len(losses):.4f}")
        sent = [s.bytes_sent for s in states if s.bytes_sent is not None]
        if sent:
            parts.append(f"sent {sum(sent) * 1e-6:.1f} MB")
        weights = [s.ps_weight for s in states if s.ps_weight is not None]
        if weights:
            parts.append(f"ps-weight {min(weights):.3f}..{max(weights):.3f}")
        eta = self.eta(states)
        if eta is not None:
            parts.append(f"ETA {eta:.0f}s")
        counts: dict[str, int] = {}
        for s in states:
            counts[s.status] = counts.get(s.status, 0) + 1
        parts.append(", ".join(f"{n} {status}" for status, n in counts.items()))
        return ", ".join(parts)

    def _table(self, states: list[NodeState], elapsed: float) -> list[str]:
        columns = self._columns(states)

        def row(values: dict[str, str]) -> str:
            return "  ".join(values[name].rjust(width) for name, width in columns)
        eta = self.eta(states)
        lines = [f"p2ptrain cluster: {len(states)} nodes, {elapsed:.1f} s" + (f", ETA {eta:.0f} s" if eta else ""),
                 row({name: name for name, _ in columns})]
        lines += [row(self._cells(s)) for s in states]
        return lines

    def _redraw(self, lines: list[str]) -> None:
        # Cursor-up cannot reach lines scrolled off the screen, so the table must fit.
        fit = max(3, shutil.get_terminal_size().lines - 1)
        if len(lines) > fit:
            lines = lines[:fit - 1] + [f"... {len(lines) - fit + 1} more nodes not shown"]
        up = f"\x1b[{self._drawn_lines}F" if self._drawn_lines else ""  # to column 0, n lines up
        self.stream.write(up + "".join(f"\x1b[2K{line}\n" for line in lines))
        self.stream.flush()
        self._drawn_lines = len(lines)

    def _write(self, lines: list[str]) -> None:
        self.stream.write("".join(f"{line}\n" for line in lines))
        self.stream.flush()


def _fmt(value, pattern: str, scale: float = 1.0) -> str:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return "-"
    return pattern.format(value * scale)
