"""`p2ptrain compose`: write a docker-compose file (N nodes, a parameter server, Prometheus, Grafana)."""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from p2ptrain.cli.flags import add_node_arguments, flags_from_args, node_flags_as_argv
from p2ptrain.settings import ConfigError, NodeConfig


def add_parser(subcommands) -> None:
    compose = subcommands.add_parser(
        "compose", help="write a docker-compose file: N nodes, Prometheus, Grafana",
        description="Print (or write to --out) a docker-compose file: services node0..node{N-1} running "
                    "`p2ptrain node` with the node flags given here, addressed by service name; with --ps also a "
                    "parameter server and N GEM workers in the `ps` profile (with --algorithm gem they are the "
                    "whole cluster); Prometheus scraping every process and Grafana with the p2ptrain "
                    "dashboard. Run it from the repository (the build context).")
    compose.add_argument("--nodes", type=int, required=True, help="number of nodes (and of ps workers)")
    compose.add_argument("--ps", action="store_true",
                         help="add the parameter server and GEM workers as profile `ps` "
                              "(docker compose --profile ps up)")
    compose.add_argument("--out", help="write the file here (paths in it are relative to its folder); default stdout")
    compose.add_argument("--port", type=int, default=50051, help="gRPC port of every container (default 50051)")
    compose.add_argument("--metrics-port", type=int, default=9100,
                         help="/metrics port of every container (default 9100)")
    compose.add_argument("--pki", metavar="DIR", default=None,
                         help="folder of `p2ptrain pki init` (ca.crt, ca.key): mutual TLS, each container mounting "
                              "only its own certificate and key (node-R, ps; issued there when missing, for the "
                              "service names) and ca.crt, --run-id the CA's run id")
    add_node_arguments(compose, cluster_flags=False)
    compose.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Generate the compose file, then check every service's command the way the container will
    parse it (CLI parser + NodeConfig validation), so a bad flag fails here and not in N containers."""
    from launcher import compose
    from p2ptrain.cli import build_parser

    if getattr(args, "auth_token", None) is not None:
        raise ConfigError("p2ptrain compose does not write secrets into the compose file: give --auth-token-file "
                          "FILE (mounted into every container) instead of --auth-token")
    node_args = node_flags_as_argv(args)
    canonical = ["--nodes", str(args.nodes), *(["--ps"] if args.ps else []),
                 *([] if args.port == 50051 else ["--port", str(args.port)]),
                 *([] if args.metrics_port == 9100 else ["--metrics-port", str(args.metrics_port)]),
                 *(["--pki", args.pki] if args.pki else []), *node_args]
    base_dir = Path(args.out).parent if args.out else Path.cwd()
    try:
        spec = compose.compose_spec(args.nodes, node_args, ps=args.ps, port=args.port,
                                    metrics_port=args.metrics_port, base_dir=base_dir, pki=args.pki)
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


__all__ = ["add_parser", "run"]
