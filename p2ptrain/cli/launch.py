"""`p2ptrain launch`: run a local cluster of N node processes (or of your own script), with live
progress, planned faults (kill, restart, stall, join, leave) and a report."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from p2ptrain.algorithms import registry
from p2ptrain.cli.flags import add_node_arguments, config_from_args, flags_from_args, node_flags_as_argv
from p2ptrain.settings import ConfigError


def add_parser(subcommands) -> None:
    launch = subcommands.add_parser(
        "launch", help="run a local cluster of N node processes (or of your own script)",
        usage="p2ptrain launch --nodes N [flags] [-- python train.py ARGS]",
        description="Run N node processes on free loopback ports, show live per-node progress, write "
                    "OUT/report.json and OUT/plot.png. With `-- COMMAND ...` run your own training script N times "
                    "instead of `p2ptrain node`, like torchrun: RANK, WORLD_SIZE, LOCAL_RANK, P2PTRAIN_PEERS, "
                    "P2PTRAIN_OUT, the metrics port and every setting given here (P2PTRAIN_<SETTING>) are in its "
                    "environment, where p2ptrain.init() reads them.")
    launch.add_argument("--nodes", type=int, required=True, help="number of node processes")
    launch.add_argument("--out", default="runs/latest", help="run folder (default runs/latest)")
    launch.add_argument("--timeout", type=float, default=None, help="abort the run after this many seconds")
    launch.add_argument("--no-metrics", action="store_true", help="do not serve /metrics from the nodes")
    launch.add_argument("--live", dest="live", action="store_true", default=None,
                        help="redraw the progress table in place (default: when stderr is a terminal)")
    launch.add_argument("--no-live", dest="live", action="store_false", help="print plain progress lines")
    launch.add_argument("--kill", action="append", default=[], metavar="RANK@STEP",
                        help="SIGKILL node RANK once the cluster reaches STEP (repeatable); the others train on")
    launch.add_argument("--stall", action="append", default=[], metavar="RANK@STEP:SECONDS",
                        help="freeze node RANK (SIGSTOP, as a GC pause, swap storm or preempted VM would) once the "
                             "cluster reaches STEP, and let it go on (SIGCONT) SECONDS later (repeatable)")
    launch.add_argument("--restart", action="append", default=[], metavar="RANK@STEP",
                        help="start a killed node again at STEP: it fetches the model from a live peer and "
                             "rejoins (repeatable)")
    launch.add_argument("--join", dest="join_events", action="append", default=[], metavar="COUNT@STEP",
                        help="elastic run: start COUNT more nodes once the cluster reaches STEP; they join as new "
                             "members, nobody restarts (repeatable; ranks --nodes, --nodes+1, ...)")
    launch.add_argument("--leave", dest="leave_events", action="append", default=[], metavar="RANK@STEP",
                        help="elastic run: SIGTERM node RANK once the cluster reaches STEP; it hands over its "
                             "push-sum mass and leaves, the others go on (repeatable)")
    launch.add_argument("--netns", action="store_true",
                        help="run every node in its own Linux network namespace (veth + bridge, own IP; a "
                             "parameter server, --algorithm gem, gets one of its own after the workers'); "
                             "needs root or CAP_NET_ADMIN")
    launch.add_argument("--bandwidth", metavar="RATE",
                        help="with --netns: real per-node cap (tc tbf) on upload and download, e.g. 100mbit "
                             "or 12MB/s")
    launch.add_argument("--netns-subnet", metavar="CIDR",
                        help="with --netns: private IPv4 subnet for the nodes (default: a free 10.x.y.0/24)")
    launch.add_argument("--nat", metavar="RANKS[/RANKS...]",
                        help="with --netns: put these nodes behind NAT routers that drop every connection opened "
                             "from outside, one router per '/'-separated group: 3,4/5 = nodes 3 and 4 behind one, "
                             "node 5 behind another (they find themselves private and reach out)")
    launch.add_argument("--chaos", type=int, metavar="COUNT",
                        help="COUNT random faults (kill + restart, stall of 1 s to --chaos-max-stall, leave, join, "
                             "a link's drop burst or block, a slow node), seeded by --chaos-seed, keeping 2 nodes "
                             "alive and a route between every pair; each fired fault goes to OUT/faults.jsonl with "
                             "its step and wall time")
    launch.add_argument("--chaos-seed", type=int, default=0, metavar="SEED",
                        help="seed of the --chaos plan (default 0: the same plan every time)")
    launch.add_argument("--chaos-kinds", default=",".join(("kill", "stall", "leave", "join", "link", "slow")),
                        metavar="LIST", help="fault kinds --chaos draws from (default kill,stall,leave,join,link,slow)")
    launch.add_argument("--chaos-max-stall", type=float, default=30.0, metavar="SECONDS",
                        help="longest --chaos stall (default 30)")
    launch.add_argument("--chaos-max-stall-bound", type=float, metavar="SECONDS",
                        help="stall verdict: no step of a node that was not itself stalled or killed may take longer "
                             "(default: the longest stall fired + 3 link deadlines + 20 median steps)")
    launch.add_argument("--chaos-max-rss-growth", type=float, default=200.0, metavar="MB",
                        help="memory verdict: a node fails when its resident memory grew by more than MB and by more "
                             "than 50%% after warm-up (default 200)")
    launch.add_argument("--chaos-baseline", metavar="REPORT.json",
                        help="accuracy verdict: compare the mean test accuracy with this fault-free run's report")
    launch.add_argument("--chaos-compare", action="store_true",
                        help="accuracy verdict: first run the same command without faults into OUT/baseline and "
                             "compare with it")
    launch.add_argument("--chaos-accuracy-margin", type=float, default=0.03, metavar="M",
                        help="accuracy verdict: how far the mean test accuracy may fall below the baseline's "
                             "(default 0.03)")
    launch.add_argument("--pki", metavar="DIR",
                        help="mutual TLS with a certificate per node from a `p2ptrain pki init` folder (issued "
                             "there for 127.0.0.1 when missing): each node gets only its own, under the CA's run "
                             "id, so each can speak only as itself")
    add_node_arguments(launch, cluster_flags=False)
    launch.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from launcher.interrupts import sigint_interrupts

    with sigint_interrupts():  # the namespaces' set-up too, not only run_local_cluster
        if args.chaos is not None:
            _add_chaos(args)  # (the plan is checked before a --chaos-compare baseline runs)
        return _launch(args, verdicts=_verdict_options(args))


def _verdict_options(args: argparse.Namespace):
    """The chaos verdicts' bounds and baseline (launcher/verdicts.py); None where no chaos flag asks
    for them (a run with hand-written faults is still judged, with the default bounds)."""
    from launcher.verdicts import VerdictOptions

    asked = args.chaos_baseline or args.chaos_compare or args.chaos_max_stall_bound is not None
    if args.chaos is None and not asked:
        return None
    if args.chaos_accuracy_margin < 0 or args.chaos_max_rss_growth < 0 or \
            (args.chaos_max_stall_bound is not None and args.chaos_max_stall_bound <= 0):
        raise ConfigError("--chaos-accuracy-margin and --chaos-max-rss-growth must be >= 0, "
                          "--chaos-max-stall-bound > 0")
    if args.chaos_baseline and args.chaos_compare:
        raise ConfigError("--chaos-baseline and --chaos-compare both give the baseline: choose one")
    source, baseline = "", None
    if args.chaos_baseline:
        source, baseline = args.chaos_baseline, _baseline_accuracy(Path(args.chaos_baseline))
    elif args.chaos_compare:
        source = str(Path(args.out) / "baseline" / "report.json")
        fault_free = argparse.Namespace(**{**vars(args), "out": str(Path(args.out) / "baseline"), "chaos": None,
                                           "kill": [], "restart": [], "stall": [], "leave_events": [],
                                           "join_events": [], "link_bursts": None, "slow_windows": None})
        print(f"p2ptrain launch: --chaos-compare: the fault-free baseline first, into {fault_free.out}",
              file=sys.stderr)
        if _launch(fault_free) != 0:
            raise ConfigError(f"--chaos-compare: the fault-free baseline run failed (see {fault_free.out})")
        baseline = _baseline_accuracy(Path(source))
    return VerdictOptions(max_stall_seconds=args.chaos_max_stall_bound, max_rss_growth_mb=args.chaos_max_rss_growth,
                          baseline_accuracy=baseline, baseline_source=source,
                          accuracy_margin=args.chaos_accuracy_margin)


def _baseline_accuracy(path: Path) -> float:
    """A fault-free run's mean test accuracy, from its report.json."""
    import json

    try:
        value = json.loads(path.read_text())["cluster"]["mean_test_accuracy"]
    except OSError as exc:
        raise ConfigError(f"baseline report {path}: cannot read it ({exc.strerror or exc})") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"baseline report {path}: no cluster.mean_test_accuracy ({type(exc).__name__}: "
                          f"{exc})") from None
    if not isinstance(value, (int, float)):
        raise ConfigError(f"baseline report {path}: cluster.mean_test_accuracy is {value!r}, not a number")
    return float(value)


def _add_chaos(args: argparse.Namespace) -> None:
    """Add the --chaos plan to the hand-written fault flags (validated with them)."""
    from launcher.chaos import chaos_plan, parse_kinds
    from p2ptrain.settings.sources import LIST_SEPARATORS

    steps = args.steps if args.steps is not None else config_from_args(
        args, world_size=max(args.nodes, 1), rank=0, peers=[f"127.0.0.1:{20000 + i}" for i in range(max(args.nodes, 1))]
    ).steps
    try:
        plan = chaos_plan(args.nodes, steps, args.chaos, seed=args.chaos_seed,
                          kinds=parse_kinds(args.chaos_kinds), max_stall=args.chaos_max_stall)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    args.kill += plan.kills
    args.restart += plan.restarts
    args.stall += plan.stalls
    args.leave_events += plan.leaves
    args.join_events += plan.joins
    for name, entries in (("link_bursts", plan.link_bursts), ("slow_windows", plan.slows)):  # node settings:
        joined = LIST_SEPARATORS[name].join(filter(None, [getattr(args, name), *entries]))  # one flag, as given
        setattr(args, name, joined or None)
    print(f"p2ptrain launch: --chaos {args.chaos} (seed {args.chaos_seed}): {len(plan.kills)} kill(s) with restart, "
          f"{len(plan.stalls)} stall(s), {len(plan.leaves)} leave(s), {len(plan.joins)} join(s), "
          f"{len(plan.link_bursts)} link burst(s), {len(plan.slows)} slow window(s)", file=sys.stderr)


def _launch(args: argparse.Namespace, verdicts=None) -> int:
    from launcher import run_local_cluster
    from launcher.local import ClusterError, fault_plan

    if args.nodes < 1:
        raise ConfigError("--nodes must be >= 1")
    server = registry.runs_parameter_server(args.algorithm)  # one parameter server + --nodes workers
    netns = _netns_options(args, server)
    if server:
        config = config_from_args(args, world_size=args.nodes, rank=0, role="worker",
                                  ps_address="127.0.0.1:20000")  # validate early
    else:
        _elastic_launch(args)
        slots = args.max_nodes or args.nodes
        placeholder_peers = [f"127.0.0.1:{20000 + i}" for i in range(slots)]
        config = config_from_args(args, world_size=args.nodes, rank=0, peers=placeholder_peers)
    shown = {k: v for k, v in config.to_dict().items() if k not in ("rank", "peers", "listen", "out",
                                                                    "metrics_port", "role", "ps_address")}
    shown["topology"] = config.resolved_topology
    node_args = node_flags_as_argv(args)
    _pass_token_by_environment(args)
    script = getattr(args, "script", [])
    if script:
        if server:
            raise ConfigError(f"a script of your own runs peer nodes; --algorithm {args.algorithm} runs p2ptrain's "
                              "own workers")
        shown["script"] = script
    try:
        scheduled = () if server else (config.link_bursts, config.slow_windows)  # the nodes apply them; logged
        faults = fault_plan(args.kill, args.restart, args.nodes, args.stall, args.join_events, args.leave_events,
                            *scheduled)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if faults and server:
        raise ConfigError(f"--kill/--restart/--stall/--join/--leave apply to peer clusters, not to --algorithm "
                          f"{args.algorithm}")
    slots = config.slots if not server else args.nodes
    if args.pki:
        extra_pki = _certified_nodes(args, slots, server=server, script=bool(script), netns=netns is not None)
    extra_first = {"first": args.nodes} if slots > args.nodes else {}
    extra: dict = {"total_steps": config.steps, "verdicts": verdicts}
    if server and netns is None:
        from launcher.local import parameter_server_cluster

        extra.update(parameter_server_cluster(args.nodes, Path(args.out), node_args, metrics=not args.no_metrics))
    elif script:
        from launcher.local import script_cluster
        from p2ptrain.settings import env_variables

        extra.update(script_cluster(script, env_variables(flags_from_args(args))))
        extra["total_steps"] = args.steps  # what the script does with P2PTRAIN_STEPS is up to it
    if args.pki:
        extra.update(extra_pki)
    netns_errors: tuple = ()  # not root, or building / removing the namespaces failed
    if netns is not None:
        from launcher.netns import NetnsCluster, NetnsError, NetnsUnavailable

        netns_errors = (NetnsError, NetnsUnavailable)
    try:
        if netns is not None:
            # a parameter server gets a namespace of its own, after the workers' (public: they dial it)
            with NetnsCluster(slots + server, stream=sys.stderr, **netns) as namespaces:
                placed = namespaces.cluster_kwargs()
                if server:
                    from launcher.local import parameter_server_cluster

                    extra.update(parameter_server_cluster(args.nodes, Path(args.out), node_args,
                                                          metrics=not args.no_metrics, host=placed["hosts"][slots],
                                                          prefix=placed["argv_prefixes"][slots]))
                placed = {key: value[:slots] for key, value in placed.items()}
                report = run_local_cluster(slots, Path(args.out), node_args, config=shown,
                                           metrics=not args.no_metrics, live=args.live, timeout=args.timeout,
                                           faults=faults, **placed, **extra, **extra_first)
        else:
            report = run_local_cluster(slots, Path(args.out), node_args, config=shown,
                                       metrics=not args.no_metrics, live=args.live, timeout=args.timeout,
                                       faults=faults, **extra, **extra_first)
    except ClusterError as exc:
        print(f"p2ptrain launch: {exc}", file=sys.stderr)
        return 1
    except netns_errors as exc:
        print(f"p2ptrain launch: {exc}", file=sys.stderr)
        return 1
    print(_one_line(report.get("cluster", {})))
    return 0


def _certified_nodes(args: argparse.Namespace, slots: int, *, server: bool, script: bool, netns: bool) -> dict:
    """run_local_cluster's argv_factory for `--pki DIR`: each node its own certificate (issued for
    127.0.0.1 when missing), the CA, mutual TLS and the CA's run id."""
    from launcher.certificates import ca_certificate, node_certificate
    from launcher.local import node_argv
    from p2ptrain.pki import PkiError, ca_run_id

    if server or script or netns:
        raise ConfigError("--pki applies to peer clusters of p2ptrain nodes on loopback (not with a parameter "
                          "server, a script of your own or --netns: give those their certificates per node)")
    if args.tls_cert or args.tls_key or args.tls_ca:
        raise ConfigError("--pki gives every node its own certificate: drop --tls-cert/--tls-key/--tls-ca")
    try:
        run_id = ca_run_id(args.pki)
    except PkiError as exc:
        raise ConfigError(str(exc)) from None
    if getattr(args, "run_id", None) not in (None, run_id):
        raise ConfigError(f"--run-id {args.run_id} differs from the run the CA in {args.pki} was made for ({run_id})")
    ca = str(ca_certificate(args.pki))

    def certified_argv(rank, world_size, peers, metrics_port, out_dir, extra_args, python=sys.executable):
        try:
            cert, key = node_certificate(args.pki, rank, ["127.0.0.1"])
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        return [*node_argv(rank, world_size, peers, metrics_port, out_dir, extra_args, python),
                "--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca", ca, "--tls-require-client-cert",
                "--run-id", run_id]

    for rank in range(slots):  # every certificate now: a bad one stops nothing mid-run
        certified_argv(rank, 1, [], None, Path(args.out), [])
    return {"argv_factory": certified_argv}


def _pass_token_by_environment(args: argparse.Namespace) -> None:
    """Hand --auth-token to the node processes as P2PTRAIN_AUTH_TOKEN, which (unlike argv) other
    users cannot read from the process table."""
    if getattr(args, "auth_token", None) is not None:
        os.environ["P2PTRAIN_AUTH_TOKEN"] = args.auth_token


def _elastic_launch(args: argparse.Namespace) -> None:
    """--join / --leave make the run elastic: --max-nodes covers the nodes that join (set here when
    not given; too small a value is an error); the node flags passed on carry it."""
    from launcher.local import join_plan

    if not (args.join_events or args.leave_events):
        return
    try:
        joins = len(join_plan(args.join_events, args.nodes))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    needed = args.nodes + joins
    if args.max_nodes is None:
        args.max_nodes = needed
    elif args.max_nodes < needed:
        raise ConfigError(f"--max-nodes {args.max_nodes} is below --nodes {args.nodes} plus {joins} joining")


def _one_line(cluster: dict) -> str:
    """The launch's result in one line: what was measured (accuracy, else loss), agreement, time."""
    acc, loss, cd = cluster.get("mean_test_accuracy"), cluster.get("mean_final_loss"), cluster.get("consensus_distance")
    quality = f"mean test accuracy {acc:.4f}" if acc is not None else \
        (f"mean final loss {loss:.4f}" if loss is not None else "no accuracy or loss reported")
    agreement = f", consensus distance {cd:.3g}" if cd is not None else ""
    return f"{quality}{agreement}, wall {cluster.get('wall_seconds', 0):.1f}s"


def _netns_options(args: argparse.Namespace, server: bool) -> dict | None:
    """NetnsCluster keyword arguments from --netns/--bandwidth/--netns-subnet (None without --netns),
    validated before anything starts."""
    if not args.netns:
        if args.bandwidth is not None or args.netns_subnet is not None or args.nat is not None:
            raise ConfigError("--bandwidth, --netns-subnet and --nat need --netns (without namespaces, emulate a "
                              "cap with --link bandwidth=RATE)")
        return None
    from launcher.netns import parse_subnet
    from p2ptrain.transport.faults import parse_bandwidth

    try:
        bandwidth = None if args.bandwidth is None else parse_bandwidth(args.bandwidth)
    except ValueError as exc:
        raise ConfigError(f"--bandwidth: {exc}") from None
    try:
        if args.netns_subnet is not None:
            parse_subnet(args.netns_subnet, args.nodes)
        elif args.nodes > 253:
            raise ValueError(f"{args.nodes} nodes do not fit the automatic /24: give a larger --netns-subnet")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    nat: tuple[tuple[int, ...], ...] = ()
    if args.nat is not None:
        try:
            nat = tuple(tuple(int(rank) for rank in group.split(",")) for group in args.nat.split("/"))
        except ValueError:
            raise ConfigError(f"--nat {args.nat!r}: give ranks, e.g. 3,4/5") from None
        behind = [rank for group in nat for rank in group]
        if len(set(behind)) != len(behind) or not all(0 <= rank < args.nodes for rank in behind):
            raise ConfigError(f"--nat {args.nat!r}: each rank below --nodes {args.nodes} at most once")
        if len(behind) == args.nodes:
            raise ConfigError("--nat: at least one node must stay public (the private ones reach out to it)")
    return {"bandwidth": bandwidth, "subnet": args.netns_subnet, "nat": nat}


__all__ = ["add_parser", "run"]
