"""Run one local cluster per experiment variant and boil each run down to a few numbers.

Shared by `p2ptrain bench algorithms` and `p2ptrain reproduce ...`: every variant is a real
`p2ptrain launch`-style cluster of node processes on loopback, differing only in node flags.
"""
from __future__ import annotations

import io
import math
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass
class VariantResult:
    name: str
    args: list[str]
    nodes: int
    steps: int
    step_seconds: float          # mean step time after warm-up, mean over nodes (what ratios use)
    bytes_per_step: float        # payload bytes sent per step per node
    test_accuracy: float         # mean over nodes
    min_test_accuracy: float
    consensus_distance: float | None
    wall_seconds: float
    error: str | None = None
    final_loss: float = math.nan  # mean over nodes of the training loss of the last steps
    step_p50: float = math.nan    # median step time after warm-up, mean over nodes
    step_p95: float = math.nan    # 95th percentile step time after warm-up, mean over nodes
    step_max: float = math.nan    # the slowest step after warm-up of any node
    wall_per_step: float = math.nan  # the slowest node's training seconds (warm-up included) over its steps

    def to_dict(self) -> dict:
        return asdict(self)


def run_variant(name: str, nodes: int, steps: int, node_args: list[str], out_dir: Path, *,
                timeout: float | None = None, keep: bool = True, echo=None,
                parameter_server: bool = False, stalls: list[str] = (), script: list[str] = ()) -> VariantResult:
    """Run one cluster; a failed run comes back with `error` set rather than aborting the sweep.
    With `parameter_server` the nodes are asynchronous workers around one `p2ptrain ps`, and the
    test accuracy is that of the server's final θ. `stalls`: `launch --stall RANK@STEP:SECONDS`.
    `script`: run this training script of your own per rank (`launch -- SCRIPT`), the node flags
    handed to it as P2PTRAIN_<SETTING> variables."""
    from launcher import run_local_cluster
    from launcher.local import ClusterError, fault_plan, parameter_server_cluster, script_cluster
    from launcher.report import step_times

    run_dir = variant_dir(out_dir, name)
    if run_dir.exists():
        shutil.rmtree(run_dir)
    args = ["--steps", str(steps), *node_args]
    log = io.StringIO()
    extra = parameter_server_cluster(nodes, run_dir, args, metrics=False) if parameter_server else {}
    if script:
        from p2ptrain.cli import build_parser
        from p2ptrain.cli.flags import flags_from_args
        from p2ptrain.settings import env_variables

        extra.update(script_cluster(list(script), env_variables(flags_from_args(build_parser().parse_args(
            ["node", *args])))))
    if stalls:
        extra["faults"] = fault_plan([], [], nodes, list(stalls))
    try:
        report = run_local_cluster(nodes, run_dir, args, metrics=False, live=False, timeout=timeout, stream=log,
                                   **extra)
    except ClusterError as exc:
        if echo:
            echo(log.getvalue()[-2000:])
        return VariantResult(name, args, nodes, steps, math.nan, math.nan, math.nan, math.nan, None, math.nan,
                             error=str(exc).splitlines()[0])
    summaries = [s for s in report["nodes"] if s]
    cluster = report["cluster"]

    def mean(key: str) -> float:
        values = [s[key] for s in summaries if isinstance(s.get(key), (int, float))]
        return sum(values) / len(values) if values else math.nan

    times = step_times(summaries)
    result = VariantResult(
        name=name, args=args, nodes=nodes, steps=steps,
        step_seconds=nan_if_none(times["steady_step_seconds"]),
        step_p50=nan_if_none(times["p50_step_seconds"]), step_p95=nan_if_none(times["p95_step_seconds"]),
        step_max=nan_if_none(times["max_step_seconds"]), wall_per_step=nan_if_none(times["wall_seconds_per_step"]),
        bytes_per_step=mean("bytes_sent") / steps,
        test_accuracy=mean("test_accuracy"),
        min_test_accuracy=min((s["test_accuracy"] for s in summaries if s.get("test_accuracy") is not None),
                              default=math.nan),
        consensus_distance=cluster.get("relative_consensus_distance"),
        wall_seconds=cluster.get("wall_seconds", math.nan), final_loss=mean("final_loss"))
    if parameter_server and isinstance(report.get("ps"), dict):
        accuracy = report["ps"].get("test_accuracy")
        result.test_accuracy = result.min_test_accuracy = math.nan if accuracy is None else accuracy
    if not keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    return result


def variant_dir(out_dir: Path, name: str) -> Path:
    """The run folder of the variant `name` under `out_dir` (what run_variant writes to)."""
    return Path(out_dir) / _slug(name)


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-").replace("--", "-")


def print_table(rows: list[list[str]], headers: list[str], stream=sys.stdout) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
    line = lambda cells: "  ".join(str(c).rjust(w) if i else str(c).ljust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    print(line(headers), file=stream)
    print("  ".join("-" * w for w in widths), file=stream)
    for row in rows:
        print(line(row), file=stream)


def nan_if_none(value: float | None) -> float:
    return math.nan if value is None else value


def fmt(value, pattern: str = "{:.3f}") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return pattern.format(value)
