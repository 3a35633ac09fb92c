"""The `p2ptrain` command: node, ps, launch, compose, kubernetes, report, health, bench, reproduce.

  p2ptrain node    run one node (flags, env RANK/WORLD_SIZE/P2PTRAIN_*, or --config FILE.toml);
                   --role worker --ps HOST:PORT: an asynchronous parameter-server worker (GEM)
  p2ptrain ps      run a parameter server for --world-size workers (GEM, seed 001)
  p2ptrain launch  run a local cluster of N node processes with live progress and a report
  p2ptrain compose write a docker-compose file: N nodes (+ parameter server), Prometheus, Grafana
  p2ptrain kubernetes  write Kubernetes manifests: StatefulSet (or parameter server + workers), Services, ...
  p2ptrain report  (re)build a run's report.json and plot.png from its folder, or merge one folder per host
  p2ptrain health  ask a node or parameter server whether it is serving (grpc.health.v1); exit 0 if so
  p2ptrain bench   benchmarks (transport, algorithms, peers)
  p2ptrain reproduce  re-run a figure of the source documents (relaysgd, gem, diloco)
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from p2ptrain.config import ConfigError, NodeConfig
from p2ptrain.exit_codes import EXIT_CONFIG, EXIT_NO_CLUSTER, EXIT_NON_FINITE
from p2ptrain.flags import add_node_arguments, flags_from_args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="p2ptrain", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    node = sub.add_parser("node", help="run one training node",
                          description="Run one p2ptrain node. Settings: defaults < --config TOML < "
                                      "environment (RANK, WORLD_SIZE, P2PTRAIN_<SETTING>) < flags.")
    add_node_arguments(node)
    node.set_defaults(func=cmd_node)

    ps = sub.add_parser("ps", help="run a parameter server (GEM) for --world-size workers",
                        description="Serve the central variable θ (θ_0 from --model/--hidden/--dataset/--seed) "
                                    "to --world-size asynchronous workers (`p2ptrain node --role worker`), "
                                    "listening on --listen or the port of --ps-address; stop once every "
                                    "worker is done, or after --peer-timeout seconds without any call. "
                                    "Writes OUT/ps.json, OUT/ps.progress.jsonl, OUT/ps.snapshots.pt.")
    add_node_arguments(ps)
    ps.set_defaults(func=cmd_ps)

    launch = sub.add_parser("launch", help="run a local cluster of N node processes (or of your own script)",
                            usage="p2ptrain launch --nodes N [flags] [-- python train.py ARGS]",
                            description="Run N node processes on free loopback ports, show live per-node progress, "
                                        "write OUT/report.json and OUT/plot.png. With `-- COMMAND ...` run your own "
                                        "training script N times instead of `p2ptrain node`, like torchrun: RANK, "
                                        "WORLD_SIZE, LOCAL_RANK, P2PTRAIN_PEERS, P2PTRAIN_OUT, the metrics port and "
                                        "every setting given here (P2PTRAIN_<SETTING>) are in its environment, where "
                                        "p2ptrain.init() reads them.")
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
                        help="run every node in its own Linux network namespace (veth + bridge, own IP); "
                             "needs root or CAP_NET_ADMIN")
    launch.add_argument("--bandwidth", metavar="RATE",
                        help="with --netns: real per-node cap (tc tbf) on upload and download, e.g. 100mbit "
                             "or 12MB/s")
    launch.add_argument("--netns-subnet", metavar="CIDR",
                        help="with --netns: private IPv4 subnet for the nodes (default: a free 10.x.y.0/24)")
    add_node_arguments(launch, cluster_flags=False)
    launch.set_defaults(func=cmd_launch)

    compose = sub.add_parser("compose", help="write a docker-compose file: N nodes, Prometheus, Grafana",
                             description="Print (or write to --out) a docker-compose file: services node0..node{N-1} "
                                         "running `p2ptrain node` with the node flags given here, addressed by "
                                         "service name; with --ps also a parameter server and N GEM workers in "
                                         "the `ps` profile (with --algorithm gem they are the whole cluster); "
                                         "Prometheus scraping every process and Grafana with the p2ptrain "
                                         "dashboard. Run it from the repository (the build context).")
    compose.add_argument("--nodes", type=int, required=True, help="number of nodes (and of ps workers)")
    compose.add_argument("--ps", action="store_true",
                         help="add the parameter server and GEM workers as profile `ps` "
                              "(docker compose --profile ps up)")
    compose.add_argument("--out", help="write the file here (paths in it are relative to its folder); default stdout")
    compose.add_argument("--port", type=int, default=50051, help="gRPC port of every container (default 50051)")
    compose.add_argument("--metrics-port", type=int, default=9100,
                         help="/metrics port of every container (default 9100)")
    add_node_arguments(compose, cluster_flags=False)
    compose.set_defaults(func=cmd_compose)

    kube = sub.add_parser("kubernetes", help="write Kubernetes manifests: a StatefulSet of N nodes (or a parameter "
                                             "server and N workers), Services, ConfigMap, probes, ServiceMonitor",
                          description="Write YAML manifests into --out DIR for `kubectl apply -f DIR`: a StatefulSet "
                                      "NAME of N nodes (pod ordinal = rank) behind a headless Service giving each "
                                      "pod a stable DNS name (the peer list); the node flags given here (and "
                                      "--config) as node.toml in a ConfigMap; TLS and token files from the Secret "
                                      "--secret (created by you, see README: Kubernetes); gRPC health probes; "
                                      "Prometheus annotations and a ServiceMonitor. --ps: a parameter-server "
                                      "Deployment + Service and a StatefulSet of N GEM workers instead.")
    kube.add_argument("--nodes", type=int, required=True, help="number of nodes (or of parameter-server workers)")
    kube.add_argument("--out", required=True, metavar="DIR", help="folder for the manifests (one file per object)")
    kube.add_argument("--ps", action="store_true", help="a parameter server and N GEM workers (as --algorithm gem)")
    kube.add_argument("--name", default="p2ptrain", help="name of the StatefulSet, Services, ... (default p2ptrain)")
    kube.add_argument("--namespace", default="default", help="Kubernetes namespace (default default)")
    kube.add_argument("--image", default="p2ptrain:latest", help="container image (default p2ptrain:latest, built "
                                                                "from the Dockerfile)")
    kube.add_argument("--gpus", type=int, default=0, metavar="K", help="nvidia.com/gpu per pod (default 0)")
    kube.add_argument("--cpu", default="1", help="CPU requested per pod (default 1)")
    kube.add_argument("--memory", default="2Gi", help="memory requested per pod, also its limit (default 2Gi)")
    kube.add_argument("--storage", default="1Gi", help="each pod's volume for its run files (default 1Gi)")
    kube.add_argument("--secret", default="p2ptrain-secret",
                      help="Secret with the TLS / token files (keys tls.crt, tls.key, ca.crt, token), mounted when "
                           "--tls-* or --auth-token-file is given (default p2ptrain-secret)")
    kube.add_argument("--port", type=int, default=50051, help="gRPC port of every pod (default 50051)")
    kube.add_argument("--metrics-port", type=int, default=9100, help="/metrics port of every pod (default 9100)")
    kube.add_argument("--no-service-monitor", dest="service_monitor", action="store_false",
                      help="leave out the ServiceMonitor (for clusters without the Prometheus Operator)")
    add_node_arguments(kube, cluster_flags=False)
    kube.set_defaults(func=cmd_kubernetes)

    report = sub.add_parser("report", help="(re)build the report of a run from its folder, or merge the folders "
                                           "of a run on several hosts",
                            description="Read node{rank}.progress.jsonl, node{rank}.json, node{rank}.snapshots.pt and "
                                        "ps.json of one run from one folder, or from one folder per host, and write "
                                        "report.json and plot.png (as `p2ptrain launch` does) into --out. A node "
                                        "whose files are in two folders is an error; missing nodes are warnings.")
    report.add_argument("folders", nargs="+", metavar="DIR", help="the run's folder(s)")
    report.add_argument("--out", metavar="OUT", help="where to write report.json and plot.png (default: DIR, when "
                                                     "only one is given)")
    report.add_argument("--nodes", type=int, metavar="N",
                        help="the run's node count (default: the highest rank found + 1)")
    report.set_defaults(func=cmd_report)

    health = sub.add_parser("health", help="ask a node or parameter server whether it is serving (grpc.health.v1)",
                            description="Ask the standard gRPC health service of a node or parameter server once "
                                        "and print its status: exit 0 when SERVING, 1 otherwise (NOT_SERVING: not "
                                        "set up yet or shutting down; SERVICE_UNKNOWN), 2 when it does not answer. "
                                        "Needs no token; give the TLS flags when the server uses TLS.")
    health.add_argument("address", metavar="HOST:PORT", help="the server's gRPC address")
    health.add_argument("--service", default="", metavar="NAME",
                        help="service to ask about: '' = the whole server (default), p2ptrain.v1.Peer or "
                             "p2ptrain.v1.ParameterServer")
    health.add_argument("--timeout", type=float, default=5.0, metavar="S", help="seconds to wait (default 5)")
    health.add_argument("--tls-ca", metavar="PEM",
                        help="talk TLS, trusting this CA bundle for the server's certificate")
    health.add_argument("--tls-server-name", metavar="NAME",
                        help="name to expect in the server certificate when it differs from HOST")
    health.add_argument("--tls-cert", metavar="PEM",
                        help="client certificate, for servers that require one (mutual TLS); also turns on TLS")
    health.add_argument("--tls-key", metavar="PEM", help="private key of --tls-cert")
    health.set_defaults(func=cmd_health)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    transport = bench_sub.add_parser(
        "transport", help="p2ptrain gRPC streaming and TCP lane vs torch.distributed gloo vs raw TCP",
        description="Move the same float32 payload between two processes with p2ptrain's gRPC streaming "
                    "(grpc), its TCP lane (lane), gloo send/recv and a raw TCP socket; print MB/s, CPU-s/GB "
                    "and ratios.")
    transport.add_argument("--size-mb", type=float, default=64.0, help="payload size in MB (default 64)")
    transport.add_argument("--reps", type=int, default=10, help="timed transfers per method (default 10)")
    transport.add_argument("--rounds", type=int, default=3,
                           help="interleaved rounds per method, medians reported (default 3)")
    transport.add_argument("--chunk-mb", type=float, default=None, help="gRPC streaming's chunk size in MiB")
    transport.add_argument("--methods", default="grpc,lane,gloo,tcp",
                           help="comma-separated subset of grpc,lane,gloo,tcp (default all; p2ptrain = grpc)")
    transport.add_argument("--json", action="store_true", help="print JSON instead of a table")
    transport.set_defaults(func=cmd_bench_transport)

    from p2ptrain.bench import algorithms as bench_algorithms

    algorithms = bench_sub.add_parser(
        "algorithms", help="every algorithm on the same model, data and emulated links",
        description=bench_algorithms.__doc__.split("\n\n")[1].replace("\n", " "))
    bench_algorithms.add_arguments(algorithms)
    algorithms.set_defaults(func=cmd_bench_algorithms)

    from p2ptrain.bench import peers as bench_peers

    peers = bench_sub.add_parser(
        "peers", help="p2ptrain's algorithms vs torch DDP (gloo) and hivemind: same model, data, batch, nodes",
        description=bench_peers.__doc__.split("\n\n")[1].replace("\n", " "))
    bench_peers.add_arguments(peers)
    peers.set_defaults(func=cmd_bench_peers)

    from p2ptrain.bench import reproduce

    repro = sub.add_parser("reproduce", help="re-run a figure of the source documents",
                           description="Re-run an experiment of the seeds at a size that runs here in minutes.")
    repro_sub = repro.add_subparsers(dest="experiment", required=True, metavar="EXPERIMENT")
    relay = repro_sub.add_parser("relaysgd", help="seed 003 fig. 5.2: AllReduce vs D-PSGD vs RelaySGD over "
                                                  "Dirichlet alpha", description=reproduce.__doc__)
    reproduce.add_arguments(relay)
    relay.set_defaults(func=cmd_reproduce_relaysgd)

    from p2ptrain.bench import reproduce_gem

    gem = repro_sub.add_parser("gem", help="seed 001 §4.1-4.2: GEM vs DOWNPOUR vs adaptive staleness vs the "
                                           "synchronous proxy over worker counts", description=reproduce_gem.__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    reproduce_gem.add_arguments(gem)
    gem.set_defaults(func=cmd_reproduce_gem)

    from p2ptrain.bench import reproduce_diloco

    diloco = repro_sub.add_parser("diloco", help="issue 15: AllReduce vs DiLoCo, Streaming DiLoCo, compressed "
                                                 "pseudo-gradients and gossip-DiLoCo over emulated WAN links",
                                  description=reproduce_diloco.__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    reproduce_diloco.add_arguments(diloco)
    diloco.set_defaults(func=cmd_reproduce_diloco)
    return parser


def _config_from_args(args: argparse.Namespace, **overrides) -> NodeConfig:
    flags = flags_from_args(args)
    flags.update(overrides)
    spelled = {"world_size": "--nodes"} if getattr(args, "command", None) == "launch" else {}
    return NodeConfig.from_sources(toml_path=getattr(args, "config_file", None), flags=flags, spelled=spelled)


def cmd_node(args: argparse.Namespace) -> int:
    config = _config_from_args(args)
    _check_ports(config)  # before importing torch: a taken port is said at once
    from p2ptrain.node import run_node

    if config.role == "ps":
        return _serve_ps(config)
    if config.role == "worker":
        from p2ptrain.ps.worker import run_worker

        summary = run_worker(config)
        print(f"worker {config.rank} ({config.algorithm_options.ps_policy}): test accuracy "
              f"{summary['test_accuracy']:.4f}, final "
              f"loss {summary['final_loss']}, mean staleness {summary.get('mean_staleness')}, "
              f"median pi {summary.get('pi_median')}")
        return 0
    from p2ptrain.node import NoClusterToRejoin
    from p2ptrain.train.optimizer import NonFiniteError
    from p2ptrain.transport.rendezvous import RendezvousError, assign_rank

    try:
        if config.uses_rendezvous:
            config = assign_rank(config)  # the store hands out a rank when no source gave one
        summary = run_node(config)
    except RendezvousError as exc:
        print(f"p2ptrain node: {exc}", file=sys.stderr)
        return 1
    except NoClusterToRejoin as exc:
        print(f"p2ptrain node: {exc}", file=sys.stderr)
        return EXIT_NO_CLUSTER
    except NonFiniteError as exc:
        print(f"p2ptrain node: run failed: {exc}", file=sys.stderr)
        return EXIT_NON_FINITE
    print(f"node {config.rank}: test accuracy {_fmt(summary.get('test_accuracy'), '.4f')}, final loss "
          f"{_fmt(summary.get('final_loss'), '.4f')}, {_fmt(summary.get('mean_step_seconds'), '.1f', 1000)} ms/step"
          + (f", left the cluster at step {summary['left_at']}" if summary.get("left_at") is not None else ""))
    return 0


def _fmt(value, spec: str, scale: float = 1.0) -> str:
    """`value` formatted, or "-" when the run has none (a node that joined after the last step)."""
    return format(value * scale, spec) if isinstance(value, (int, float)) else "-"


def _check_ports(config: NodeConfig) -> None:
    """Fail at once, in one line, when this node's gRPC or metrics port is taken (not after
    loading data and building the model, with a long gRPC traceback)."""
    import socket

    wanted = []
    listen = config.listen or (config.peers[config.rank] if config.peers and config.role == "peer" else None)
    if listen and not listen.startswith("unix"):
        host, _, port = listen.rpartition(":")
        wanted.append(("listen", host.strip("[]"), int(port)))
    if config.metrics_port:
        wanted.append(("metrics", config.metrics_bind_host, config.metrics_port))
    for what, host, port in wanted:
        if port == 0:
            continue
        if host in ("", "*", "0.0.0.0", "::"):  # a wildcard: taken if taken on the IPv4 wildcard
            bind_host, family = "0.0.0.0", socket.AF_INET
        else:
            bind_host, family = host, socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((bind_host, port))
            except OSError as exc:
                raise ConfigError(f"cannot {'listen' if what == 'listen' else 'serve metrics'} on {host}:{port}: "
                                  f"{exc.strerror or exc}") from None


def cmd_ps(args: argparse.Namespace) -> int:
    config = _config_from_args(args, role="ps")
    _check_ports(config)
    return _serve_ps(config)


def _serve_ps(config: NodeConfig) -> int:
    from p2ptrain.ps.run import run_ps

    summary = run_ps(config)
    print(f"parameter server: {summary['commits']} commits from {summary['workers_done']}/{summary['workers']} "
          f"workers, mean staleness {summary['mean_staleness']}, test accuracy {summary['test_accuracy']:.4f}")
    return 0 if summary["complete"] else 1


def _node_flags_as_argv(args: argparse.Namespace) -> list[str]:
    """Re-emit the node flags the user gave to `launch`, for every node process."""
    parser = argparse.ArgumentParser(add_help=False)
    add_node_arguments(parser, cluster_flags=False)
    argv: list[str] = []
    for action in parser._actions:  # the one place that knows flag spellings
        if not action.option_strings:
            continue
        value = getattr(args, action.dest, None)
        if value is None or action.dest == "auth_token":  # the token goes by environment (_pass_token_by_environment)
            continue
        if action.nargs == 0:  # a switch (store_true): the flag alone
            argv += [action.option_strings[0]] if value else []
        else:
            argv += [action.option_strings[0], str(value)]
    return argv


def _pass_token_by_environment(args: argparse.Namespace) -> None:
    """Hand --auth-token to the node processes as P2PTRAIN_AUTH_TOKEN, which (unlike argv) other
    users cannot read from the process table."""
    if getattr(args, "auth_token", None) is not None:
        os.environ["P2PTRAIN_AUTH_TOKEN"] = args.auth_token


def cmd_launch(args: argparse.Namespace) -> int:
    from launcher.interrupts import sigint_interrupts

    with sigint_interrupts():  # the namespaces' set-up too, not only run_local_cluster
        return _launch(args)


def _launch(args: argparse.Namespace) -> int:
    from launcher import run_local_cluster
    from launcher.local import ClusterError

    if args.nodes < 1:
        raise ConfigError("--nodes must be >= 1")
    gem = args.algorithm == "gem"
    netns = _netns_options(args, gem)
    if gem:  # one parameter server + --nodes workers
        config = _config_from_args(args, world_size=args.nodes, rank=0, role="worker",
                                   ps_address="127.0.0.1:20000")  # validate early
    else:
        _elastic_launch(args)
        slots = args.max_nodes or args.nodes
        placeholder_peers = [f"127.0.0.1:{20000 + i}" for i in range(slots)]
        config = _config_from_args(args, world_size=args.nodes, rank=0, peers=placeholder_peers)
    shown = {k: v for k, v in config.to_dict().items() if k not in ("rank", "peers", "listen", "out",
                                                                    "metrics_port", "role", "ps_address")}
    shown["topology"] = config.resolved_topology
    node_args = _node_flags_as_argv(args)
    _pass_token_by_environment(args)
    script = getattr(args, "script", [])
    if script:
        if gem:
            raise ConfigError("a script of your own runs peer nodes; --algorithm gem runs p2ptrain's own workers")
        shown["script"] = script
    from launcher.local import fault_plan

    try:
        faults = fault_plan(args.kill, args.restart, args.nodes, args.stall, args.join_events, args.leave_events)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if faults and gem:
        raise ConfigError("--kill/--restart/--stall/--join/--leave apply to peer clusters, not to --algorithm gem")
    slots = config.slots if not gem else args.nodes
    extra_first = {"first": args.nodes} if slots > args.nodes else {}
    extra: dict = {"total_steps": config.steps}
    if gem:
        from launcher.local import parameter_server_cluster

        extra.update(parameter_server_cluster(args.nodes, Path(args.out), node_args, metrics=not args.no_metrics))
    elif script:
        from launcher.local import script_cluster
        from p2ptrain.flags import settings_to_env

        extra.update(script_cluster(script, settings_to_env(flags_from_args(args))))
        extra["total_steps"] = args.steps  # what the script does with P2PTRAIN_STEPS is up to it
    netns_errors: tuple = ()  # not root, or building / removing the namespaces failed
    if netns is not None:
        from launcher.netns import NetnsCluster, NetnsError, NetnsUnavailable

        netns_errors = (NetnsError, NetnsUnavailable)
    try:
        if netns is not None:
            with NetnsCluster(slots, stream=sys.stderr, **netns) as namespaces:
                report = run_local_cluster(slots, Path(args.out), node_args, config=shown,
                                           metrics=not args.no_metrics, live=args.live, timeout=args.timeout,
                                           faults=faults, **namespaces.cluster_kwargs(), **extra, **extra_first)
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


def _elastic_launch(args: argparse.Namespace) -> None:
    """--join / --leave make the run elastic: --max-nodes covers the nodes that join (set here when
    not given; too small a value is an error); the node flags passed on carry it."""
    joins = sum(int(spec.partition("@")[0]) for spec in args.join_events if spec.partition("@")[0].strip().isdigit())
    if not (args.join_events or args.leave_events):
        return
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


def _netns_options(args: argparse.Namespace, gem: bool) -> dict | None:
    """NetnsCluster keyword arguments from --netns/--bandwidth/--netns-subnet (None without --netns),
    validated before anything starts."""
    if not args.netns:
        if args.bandwidth is not None or args.netns_subnet is not None:
            raise ConfigError("--bandwidth and --netns-subnet need --netns (without namespaces, emulate a cap "
                              "with --link bandwidth=RATE)")
        return None
    if gem:
        raise ConfigError("--netns does not run a parameter server (--algorithm gem) yet")
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
    return {"bandwidth": bandwidth, "subnet": args.netns_subnet}


def cmd_compose(args: argparse.Namespace) -> int:
    """Generate the compose file, then check every service's command the way the container will
    parse it (CLI parser + NodeConfig validation), so a bad flag fails here and not in N containers."""
    import shlex

    from launcher import compose

    if getattr(args, "auth_token", None) is not None:
        raise ConfigError("p2ptrain compose does not write secrets into the compose file: give --auth-token-file "
                          "FILE (mounted into every container) instead of --auth-token")
    node_args = _node_flags_as_argv(args)
    canonical = ["--nodes", str(args.nodes), *(["--ps"] if args.ps else []),
                 *([] if args.port == 50051 else ["--port", str(args.port)]),
                 *([] if args.metrics_port == 9100 else ["--metrics-port", str(args.metrics_port)]), *node_args]
    base_dir = Path(args.out).parent if args.out else Path.cwd()
    try:
        spec = compose.compose_spec(args.nodes, node_args, ps=args.ps, port=args.port,
                                    metrics_port=args.metrics_port, base_dir=base_dir)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    parser = build_parser()
    for name, service in spec["services"].items():
        if "command" in service:
            parsed = parser.parse_args(service["command"])
            try:
                NodeConfig.from_sources(toml_path=parsed.config_file, env=service.get("environment", {}), flags={
                    **flags_from_args(parsed), **({"role": "ps"} if parsed.command == "ps" else {})})
            except ConfigError as exc:
                raise ConfigError(f"service {name}: {exc}") from None
        if "healthcheck" in service:  # ["CMD", "p2ptrain", "health", ...]: must parse the same way
            parser.parse_args(service["healthcheck"]["test"][2:])
    if not (compose.REPO / "Dockerfile").exists():
        print(f"warning: build context {compose.REPO} has no Dockerfile; run `p2ptrain compose` from a checkout "
              "of the repository", file=sys.stderr)
    text = compose.render(spec, " ".join(["p2ptrain compose", *map(shlex.quote, canonical)]))
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}: {len(spec['services'])} services", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def cmd_kubernetes(args: argparse.Namespace) -> int:
    """Generate the manifests and check every pod's command as the pod will run it (CLI parser and
    NodeConfig validation), so a bad flag fails here and not in N pods."""
    import shlex

    from launcher import kubernetes

    options = kubernetes.KubernetesOptions(name=args.name, namespace=args.namespace, image=args.image, gpus=args.gpus,
                                           cpu=args.cpu, memory=args.memory, storage=args.storage, secret=args.secret,
                                           port=args.port, metrics_port=args.metrics_port,
                                           service_monitor=args.service_monitor)
    try:
        settings = kubernetes.load_settings(args.config_file, flags_from_args(args))
        objects = kubernetes.manifests(args.nodes, settings, ps=args.ps, options=options)
        kubernetes.check_pods(objects, settings, build_parser(), ps=args.ps)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    canonical = ["--nodes", str(args.nodes), *(["--ps"] if args.ps else []), *options.as_flags(),
                 *_node_flags_as_argv(args)]
    paths = kubernetes.write(objects, args.out, " ".join(["p2ptrain kubernetes", *map(shlex.quote, canonical)]))
    print(f"wrote {len(paths)} manifests to {args.out}: kubectl apply -f {args.out}", file=sys.stderr)
    if secret := kubernetes.secret_command(settings, options):
        print(f"the pods mount Secret {args.secret!r}: create it first, e.g. {secret}", file=sys.stderr)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from launcher import report as run_report

    if args.nodes is not None and args.nodes < 1:
        raise ConfigError("--nodes must be >= 1")
    out = Path(args.out) if args.out else None
    try:
        result = run_report.merge_run([Path(d) for d in args.folders], out, nodes=args.nodes)
    except ValueError as exc:  # RunFolderError: a node found twice; not a folder; several folders, no --out
        print(f"p2ptrain report: {exc}", file=sys.stderr)
        return 2
    out = out or Path(args.folders[0])
    cluster = result["cluster"]
    accuracy = cluster.get("mean_test_accuracy")
    print(f"report: {out / run_report.REPORT_NAME}, plot: {out / run_report.PLOT_NAME}: {cluster['nodes']} nodes, "
          f"mean test accuracy {'-' if accuracy is None else f'{accuracy:.4f}'}")
    for warning in result["warnings"]:
        print(f"warning: {warning}", file=sys.stderr)
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    """Print the status; 0 SERVING, 1 anything else, 2 no answer (one line on stderr)."""
    import grpc

    from p2ptrain.transport.health import SERVING, check
    from p2ptrain.transport.security import Security, SecurityError

    if not args.timeout > 0:
        raise ConfigError(f"--timeout must be > 0 seconds, got {args.timeout}")
    if args.tls_server_name and not (args.tls_ca or args.tls_cert):
        raise ConfigError("--tls-server-name only applies to TLS: give --tls-ca (or --tls-cert/--tls-key)")
    try:
        security = Security(tls_cert=args.tls_cert, tls_key=args.tls_key, tls_ca=args.tls_ca,
                            tls_server_name=args.tls_server_name)
        status = check(args.address, args.service, timeout=args.timeout, security=security)
    except SecurityError as exc:
        print(f"p2ptrain health: {args.address}: {exc}", file=sys.stderr)
        return 2
    except grpc.RpcError as exc:
        details = " ".join((exc.details() or "").split())  # one line, whatever gRPC put in it
        print(f"p2ptrain health: {args.address}: {exc.code().name}: {details}", file=sys.stderr)
        return 2
    print(status)
    return 0 if status == SERVING else 1


def cmd_bench_transport(args: argparse.Namespace) -> int:
    from p2ptrain.bench.transport import main as bench_main

    return bench_main(args)


def cmd_bench_algorithms(args: argparse.Namespace) -> int:
    from p2ptrain.bench.algorithms import main as bench_main

    return bench_main(args)


def cmd_bench_peers(args: argparse.Namespace) -> int:
    from p2ptrain.bench.peers import main as bench_main

    return bench_main(args)


def cmd_reproduce_relaysgd(args: argparse.Namespace) -> int:
    from p2ptrain.bench.reproduce import main as reproduce_main

    return reproduce_main(args)


def cmd_reproduce_diloco(args: argparse.Namespace) -> int:
    from p2ptrain.bench.reproduce_diloco import main as reproduce_main

    return reproduce_main(args)


def cmd_reproduce_gem(args: argparse.Namespace) -> int:
    from p2ptrain.bench.reproduce_gem import main as reproduce_main

    return reproduce_main(args)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    script: list[str] = []
    if "--" in argv:  # `p2ptrain launch [flags] -- python train.py ARGS`: everything after is the script
        at = argv.index("--")
        argv, script = argv[:at], argv[at + 1:]
    args = parser.parse_args(argv)
    args.script = script
    if script and args.command != "launch":
        parser.error(f"only `p2ptrain launch` runs a script after --, not `p2ptrain {args.command}`")
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ConfigError as exc:
        parser.exit(EXIT_CONFIG, f"p2ptrain: configuration error: {exc}\n")
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
