"""`p2ptrain report`: (re)build a run's report.json and plot.png, or merge one folder per host."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from p2ptrain.settings import ConfigError


def add_parser(subcommands) -> None:
    report = subcommands.add_parser(
        "report", help="(re)build the report of a run from its folder, or merge the folders of a run on several "
                       "hosts",
        description="Read node{rank}.progress.jsonl, node{rank}.json, node{rank}.snapshots.pt and ps.json of one "
                    "run from one folder, or from one folder per host, and write report.json and plot.png (as "
                    "`p2ptrain launch` does) into --out. A node whose files are in two folders is an error; "
                    "missing nodes are warnings.")
    report.add_argument("folders", nargs="+", metavar="DIR", help="the run's folder(s)")
    report.add_argument("--out", metavar="OUT", help="where to write report.json and plot.png (default: DIR, when "
                                                     "only one is given)")
    report.add_argument("--nodes", type=int, metavar="N",
                        help="the run's node count (default: the highest rank found + 1)")
    report.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
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


__all__ = ["add_parser", "run"]
