"""`p2ptrain health`: ask a node or parameter server whether it is serving (grpc.health.v1)."""
from __future__ import annotations

import argparse
import sys

from p2ptrain.settings import ConfigError


def add_parser(subcommands) -> None:
    health = subcommands.add_parser(
        "health", help="ask a node or parameter server whether it is serving (grpc.health.v1)",
        description="Ask the standard gRPC health service of a node or parameter server once and print its "
                    "status: exit 0 when SERVING, 1 otherwise (NOT_SERVING: not set up yet or shutting down; "
                    "SERVICE_UNKNOWN), 2 when it does not answer. Needs no token; give the TLS flags when the "
                    "server uses TLS.")
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
    health.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the status; 0 SERVING, 1 anything else, 2 no answer (one line on stderr)."""
    from p2ptrain.transport.errors import SendFailure
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
    except SendFailure as exc:  # no answer: "CODE: details" in one line
        print(f"p2ptrain health: {args.address}: {exc.detail}", file=sys.stderr)
        return 2
    print(status)
    return 0 if status == SERVING else 1


__all__ = ["add_parser", "run"]
