"""`p2ptrain pki`: a CA for one run and a certificate per node, naming it (mutual TLS identity)."""
from __future__ import annotations

import argparse

from p2ptrain.settings import ConfigError


def add_parser(subcommands) -> None:
    pki = subcommands.add_parser(
        "pki", help="make a run's CA and per-node certificates (mutual TLS with node identities)",
        description="Make the certificates of a mutual-TLS cluster without openssl recipes. `init` makes a CA "
                    "for one run; `issue` signs a certificate per node whose SAN URI p2ptrain://RUN-ID/RANK "
                    "names it, so a node can speak only as itself. Give the nodes --tls-ca DIR/ca.crt "
                    "--tls-cert DIR/node-R.crt --tls-key DIR/node-R.key --tls-require-client-cert.")
    commands = pki.add_subparsers(dest="pki_command", required=True, metavar="COMMAND")
    init = commands.add_parser("init", help="make a CA (ca.crt, ca.key) for one run",
                               description="Make a CA for run RUN-ID in DIR: ca.crt (give it to every node as "
                                           "--tls-ca) and ca.key (keep it off the nodes).")
    init.add_argument("--dir", default="pki", metavar="DIR", help="where to write (default pki)")
    init.add_argument("--run-id", default="p2ptrain", metavar="RUN-ID",
                      help="the run the certificates are for: the nodes' --run-id (default p2ptrain)")
    init.add_argument("--days", type=int, default=365, help="validity in days (default 365)")
    init.add_argument("--force", action="store_true", help="replace an existing CA")
    init.set_defaults(func=run_init)
    issue = commands.add_parser("issue", help="sign certificates for nodes (node-R.crt/.key, ps.crt/.key)",
                                description="Sign a certificate and key per node with the CA in DIR. Each names "
                                            "its node in a SAN URI p2ptrain://RUN-ID/RANK (or .../ps) and is "
                                            "valid for the server names given with --host.")
    issue.add_argument("--dir", default="pki", metavar="DIR", help="the CA's folder, and where to write")
    issue.add_argument("--rank", type=int, action="append", default=[], metavar="R",
                       help="a node rank (repeat for several)")
    issue.add_argument("--nodes", type=int, metavar="N", help="every rank 0..N-1")
    issue.add_argument("--ps", action="store_true", help="also the parameter server (ps.crt, ps.key)")
    issue.add_argument("--host", action="append", default=[], metavar="NAME",
                       help="a DNS name or IP address the certificates are valid for (repeat; '{rank}' is "
                            "replaced by the rank, e.g. --host 'node-{rank}')")
    issue.add_argument("--days", type=int, default=365, help="validity in days (default 365)")
    issue.add_argument("--force", action="store_true", help="replace existing certificates")
    issue.set_defaults(func=run_issue)
    show = commands.add_parser("show", help="print whom certificates name", description="Print the p2ptrain "
                               "identity, host names and expiry of each certificate file.")
    show.add_argument("files", nargs="+", metavar="CERT")
    show.set_defaults(func=run_show)


def run_init(args: argparse.Namespace) -> int:
    from p2ptrain.pki import PkiError, init_ca

    try:
        path = init_ca(args.dir, args.run_id, days=args.days, force=args.force)
    except PkiError as exc:
        raise ConfigError(str(exc)) from None
    print(f"CA for run {args.run_id}: {path} (key {path.parent / 'ca.key'}: keep it off the nodes)")
    return 0


def run_issue(args: argparse.Namespace) -> int:
    from p2ptrain.pki import PS_NAME, PkiError, describe, issue

    if args.nodes is not None and args.nodes < 1:
        raise ConfigError(f"--nodes must be >= 1, got {args.nodes}")
    names: list[int | str] = list(dict.fromkeys([*args.rank, *range(args.nodes or 0)]))
    if any(r < 0 for r in names):
        raise ConfigError("a rank is >= 0")
    names += [PS_NAME] if args.ps else []
    if not names:
        raise ConfigError("name the nodes to certify: --rank R (repeatable), --nodes N or --ps")
    try:
        for name in names:
            hosts = [h.replace("{rank}", str(name)) for h in args.host]
            cert, _ = issue(args.dir, name, hosts=hosts, days=args.days, force=args.force)
            print(describe(cert))
    except PkiError as exc:
        raise ConfigError(str(exc)) from None
    return 0


def run_show(args: argparse.Namespace) -> int:
    from p2ptrain.pki import PkiError, describe

    try:
        for path in args.files:
            print(describe(path))
    except PkiError as exc:
        raise ConfigError(str(exc)) from None
    return 0


__all__ = ["add_parser", "run_init", "run_issue", "run_show"]
