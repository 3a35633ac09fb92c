"""`p2ptrain kubernetes`: write Kubernetes manifests (a StatefulSet of N nodes, or a parameter server
and N workers; Services, ConfigMap, probes, NetworkPolicy, ServiceMonitor; with --pki a certificate
Secret per pod)."""
from __future__ import annotations

import argparse
import shlex
import sys

from p2ptrain.cli.flags import add_node_arguments, flags_from_args, node_flags_as_argv
from p2ptrain.settings import ConfigError


def add_parser(subcommands) -> None:
    kube = subcommands.add_parser(
        "kubernetes", help="write Kubernetes manifests: a StatefulSet of N nodes (or a parameter server and N "
                           "workers), Services, ConfigMap, probes, ServiceMonitor",
        description="Write YAML manifests into --out DIR for `kubectl apply -f DIR`: a StatefulSet NAME of N nodes "
                    "(pod ordinal = rank) behind a headless Service giving each pod a stable DNS name (the peer "
                    "list); the node flags given here (and --config) as node.toml in a ConfigMap; TLS and token "
                    "files from the Secret --secret (created by you, see README: Kubernetes); gRPC health probes; "
                    "Prometheus annotations and a ServiceMonitor; a NetworkPolicy admitting only the run's own pods "
                    "and the Prometheus scraper. --ps: a parameter-server Deployment + Service and a StatefulSet of "
                    "N GEM workers instead. --pki DIR: mutual TLS with a certificate per pod, each rank a "
                    "single-pod StatefulSet mounting only its own kubernetes.io/tls Secret.")
    kube.add_argument("--nodes", type=int, required=True, help="number of nodes (or of parameter-server workers)")
    kube.add_argument("--out", required=True, metavar="DIR", help="folder for the manifests (one file per object)")
    kube.add_argument("--ps", action="store_true", help="a parameter server and N GEM workers (as --algorithm gem)")
    kube.add_argument("--name", default="p2ptrain", help="name of the StatefulSet, Services, ... (default p2ptrain)")
    kube.add_argument("--namespace", default="default", help="Kubernetes namespace (default default)")
    kube.add_argument("--image", default="p2ptrain:latest", help="container image (default p2ptrain:latest, built "
                                                                "from the Dockerfile)")
    kube.add_argument("--gpus", type=int, default=0, metavar="K", help="nvidia.com/gpu per pod (default 0)")
    kube.add_argument("--cpu", default="1", help="CPU requested per pod (default 1)")
    kube.add_argument("--cpu-limit", default=None, metavar="CPU",
                      help="CPU limit per pod (default: the --cpu request)")
    kube.add_argument("--memory", default="2Gi", help="memory requested per pod, also its limit (default 2Gi)")
    kube.add_argument("--storage", default="1Gi", help="each pod's volume for its run files (default 1Gi)")
    kube.add_argument("--secret", default="p2ptrain-secret",
                      help="Secret with the TLS / token files (keys tls.crt, tls.key, ca.crt, token), mounted when "
                           "--tls-* or --auth-token-file is given (default p2ptrain-secret)")
    kube.add_argument("--port", type=int, default=50051, help="gRPC port of every pod (default 50051)")
    kube.add_argument("--metrics-port", type=int, default=9100, help="/metrics port of every pod (default 9100)")
    kube.add_argument("--lane-port", type=int, default=50052,
                      help="TCP lane port of every peer pod (data plane auto or tcp; default 50052)")
    kube.add_argument("--pki", metavar="DIR", default=None,
                      help="folder of `p2ptrain pki init` (ca.crt, ca.key): a certificate per pod (issued there "
                           "when missing, for the pod's DNS name), each pod mounting only its own Secret; "
                           "mutual TLS, --run-id the CA's run id. The CA key never enters a manifest")
    kube.add_argument("--metrics-namespace", default="monitoring", metavar="NAMESPACE",
                      help="NetworkPolicy: namespace of the Prometheus pods allowed to scrape /metrics "
                           "(default monitoring)")
    kube.add_argument("--metrics-pods", default="app.kubernetes.io/name=prometheus", metavar="KEY=VALUE[,...]",
                      help="NetworkPolicy: labels of the Prometheus pods allowed to scrape /metrics "
                           "(default app.kubernetes.io/name=prometheus)")
    kube.add_argument("--no-network-policy", dest="network_policy", action="store_false",
                      help="leave out the NetworkPolicy (which admits only the run's own pods to gRPC and lanes, "
                           "only Prometheus to /metrics)")
    kube.add_argument("--no-service-monitor", dest="service_monitor", action="store_false",
                      help="leave out the ServiceMonitor (for clusters without the Prometheus Operator)")
    add_node_arguments(kube, cluster_flags=False)
    kube.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Generate the manifests and check every pod's command as the pod will run it (CLI parser and
    NodeConfig validation), so a bad flag fails here and not in N pods."""
    from launcher import kubernetes
    from p2ptrain.cli import build_parser

    options = kubernetes.KubernetesOptions(name=args.name, namespace=args.namespace, image=args.image, gpus=args.gpus,
                                           cpu=args.cpu, cpu_limit=args.cpu_limit, memory=args.memory,
                                           storage=args.storage, secret=args.secret, port=args.port,
                                           metrics_port=args.metrics_port, lane_port=args.lane_port,
                                           service_monitor=args.service_monitor, network_policy=args.network_policy,
                                           metrics_namespace=args.metrics_namespace, metrics_pods=args.metrics_pods,
                                           pki=args.pki)
    try:
        settings = kubernetes.load_settings(args.config_file, flags_from_args(args))
        objects = kubernetes.manifests(args.nodes, settings, ps=args.ps, options=options)
        kubernetes.check_pods(objects, settings, build_parser(), ps=args.ps, pki=args.pki)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    canonical = ["--nodes", str(args.nodes), *(["--ps"] if args.ps else []), *options.as_flags(),
                 *node_flags_as_argv(args)]
    paths = kubernetes.write(objects, args.out, " ".join(["p2ptrain kubernetes", *map(shlex.quote, canonical)]))
    print(f"wrote {len(paths)} manifests to {args.out}: kubectl apply -f {args.out}", file=sys.stderr)
    if args.pki:
        print(f"the pods mount their own certificate Secrets (NAME-...-tls, from {args.pki}): {args.out} holds "
              "their private keys (files 0600); keep it like a secret", file=sys.stderr)
    if secret := kubernetes.secret_command(settings, options):
        print(f"the pods mount Secret {args.secret!r}: create it first, e.g. {secret}", file=sys.stderr)
    return 0


__all__ = ["add_parser", "run"]
