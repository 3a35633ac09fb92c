"""Run report: combines what every node wrote into the run folder into one JSON report and a plot.

It reads only the run folder (never live processes), so a report can be rebuilt after the fact
from any run folder, including a partial one: missing or unreadable files become warnings in the
report instead of errors. A run on several hosts may have written into one folder per host:
`locate` finds which folder holds each node's files (`RunFiles`; a rank found in two folders is an
error, a missing rank a warning) and `merge_run` writes the report of the whole run
(`p2ptrain report DIR [DIR ...]`).
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

REPORT_NAME = "report.json"
PLOT_NAME = "plot.png"
PS_SUMMARY = "ps.json"
_NODE_FILE = re.compile(r"node(\d+)\.(?:json|progress\.jsonl|snapshots\.pt)")
# What a rebuilt report keeps of an earlier report.json of the same folder: only the launcher knew these.
_LAUNCHER_NODE_KEYS = ("outcome", "outcome_reason")
_LAUNCHER_CLUSTER_KEYS = ("failed", "failed_nodes", "failure")


class RunFolderError(ValueError):
    """The folders given do not hold one run: a node's (or the server's) files are in two of them."""


@dataclass(frozen=True)
class RunFiles:
    """Where the files of one run are: node{rank}.* of each rank in one folder, ps.json in one.
    Ranks without files are looked for in `default` (so warnings name a path)."""
    default: Path
    nodes: dict[int, Path] = field(default_factory=dict)
    ps: Path | None = None

    def folder(self, rank: int) -> Path:
        return self.nodes.get(rank, self.default)

    @property
    def ps_summary(self) -> Path:
        return (self.ps or self.default) / PS_SUMMARY


def locate(folders: Sequence[Path]) -> RunFiles:
    """Which of `folders` holds each node's files (and ps.json); RunFolderError when two do."""
    if not folders:
        raise ValueError("no run folder given")
    seen: dict[int, tuple[Path, str]] = {}
    ps: Path | None = None
    unique = list(dict.fromkeys(Path(f).resolve() for f in folders))
    for folder in unique:
        if not folder.is_dir():
            raise RunFolderError(f"{folder} is not a folder")
        for path in sorted(folder.iterdir()):
            match = _NODE_FILE.fullmatch(path.name)
            if match:
                rank = int(match.group(1))
                if rank in seen and seen[rank][0] != folder:
                    raise RunFolderError(f"node {rank} found twice: {seen[rank][0] / seen[rank][1]} and {path} (one "
                                         "run per report: were two runs, or a copied folder, given?)")
                seen.setdefault(rank, (folder, path.name))
            elif path.name == PS_SUMMARY:
                if ps is not None:
                    raise RunFolderError(f"two parameter-server summaries: {ps / PS_SUMMARY} and {path}")
                ps = folder
    return RunFiles(default=unique[0], nodes={rank: folder for rank, (folder, _) in seen.items()}, ps=ps)
_MAX_NOTED_PATHS = 10  # how many JSON paths a non-finite-number note lists before summarising


_RUN_FILE = re.compile(r"(?:node\d+|ps)\.(?:json|progress\.jsonl|snapshots\.pt)|node\d+\.mass|report\.json|plot\.png|"
                       r"faults\.jsonl")
FAULT_LOG = "faults.jsonl"  # one JSON line per fault the launcher fired (launcher/local.py)
FAULT_COLORS = {"kill": "tab:red", "restart": "tab:green", "stall": "tab:orange", "leave": "tab:gray",
                "join": "tab:blue"}


def clear_earlier_run(out_dir: Path) -> list[Path]:
    """Remove what an earlier run left in `out_dir` (node and server files, report, plot, node logs),
    so that a new run into the same folder is never judged by the old one's files; the paths removed.
    Anything else in the folder is left alone."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return []
    stale = [p for p in out_dir.iterdir() if _RUN_FILE.fullmatch(p.name) and p.is_file()]
    logs = out_dir / "logs"
    if logs.is_dir():
        stale += [p for p in logs.iterdir() if re.fullmatch(r"(?:node\d+|ps)\.log", p.name) and p.is_file()]
    for path in stale:
        path.unlink()
    return stale


def progress_path(out_dir: Path, rank: int) -> Path:
    return Path(out_dir) / f"node{rank}.progress.jsonl"


def summary_path(out_dir: Path, rank: int) -> Path:
    return Path(out_dir) / f"node{rank}.json"


def snapshot_path(out_dir: Path, rank: int) -> Path:
    return Path(out_dir) / f"node{rank}.snapshots.pt"


def parse_progress_line(line: str | bytes) -> dict | None:
    """One progress record, or None for a blank or garbled line (a node killed mid-write)."""
    try:
        record = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return None
    return record if isinstance(record, dict) else None


def load_faults(out_dir: Path) -> list[dict]:
    """The faults the launcher fired (OUT/faults.jsonl), in order; [] when there were none."""
    try:
        data = (Path(out_dir) / FAULT_LOG).read_bytes()
    except FileNotFoundError:
        return []
    return [r for r in map(parse_progress_line, data.splitlines()) if r is not None]


def load_progress(out_dir: Path, rank: int) -> list[dict]:
    """All readable progress records of one node; [] when the node never wrote any."""
    try:
        data = progress_path(out_dir, rank).read_bytes()
    except FileNotFoundError:
        return []
    return [r for r in map(parse_progress_line, data.splitlines()) if r is not None]


def consensus_distance(params: torch.Tensor) -> float:
    """sqrt(mean_i ||z_i - zbar||^2) over the rows of `params` [n, d]: how far the node models
    are from agreeing. Computed in float64 so tiny distances near convergence are not lost."""
    if params.dim() != 2 or params.shape[0] == 0:
        raise ValueError(f"expected a non-empty [n, d] tensor, got shape {tuple(params.shape)}")
    z = params.detach().to(torch.float64)
    deviation = z - z.mean(dim=0, keepdim=True)
    return float(deviation.pow(2).sum(dim=1).mean().sqrt())


def build_report(out_dir: Path | RunFiles, nodes: int, config: dict | None, wall_seconds: float) -> dict:
    """Collect per-node summaries, cluster aggregates, loss and consensus histories from one run
    folder, or from the folders `locate` found."""
    files = out_dir if isinstance(out_dir, RunFiles) else RunFiles(default=Path(out_dir))
    warnings: list[str] = []
    summaries = [_load_summary(files.folder(rank), rank, warnings) for rank in range(nodes)]
    progress = {rank: load_progress(files.folder(rank), rank) for rank in range(nodes)}
    for rank, records in progress.items():
        if not any(r.get("event") == "done" for r in records):
            warnings.append(f"node {rank}: no 'done' event in {progress_path(files.folder(rank), rank).name}")

    steps, distances, mean_norm = _consensus_history(files, nodes, warnings)
    stayed = [n for n in summaries if not (n and n.get("left_at") is not None)]  # elastic: the final members
    final_distance = distances[-1] if distances else None
    relative = final_distance / mean_norm if final_distance is not None and mean_norm else None

    cluster = {
        "nodes": nodes,
        "wall_seconds": wall_seconds,
        "consensus_step": steps[-1] if steps else None,
        "consensus_distance": final_distance,
        "relative_consensus_distance": relative,
        "mean_test_accuracy": _mean(_numbers(stayed, "test_accuracy")),
        "min_test_accuracy": _min(_numbers(stayed, "test_accuracy")),
        "left_nodes": [n["rank"] for n in summaries if n and n.get("left_at") is not None],
        "mean_final_loss": _mean(_numbers(summaries, "final_loss")),
        "total_bytes_sent": _sum(_numbers(summaries, "bytes_sent")),
        "total_bytes_received": _sum(_numbers(summaries, "bytes_received")),
        "mean_step_seconds": _mean(_numbers(summaries, "mean_step_seconds")),
        **step_times(summaries),
    }
    loss_history = {
        str(rank): [[r["step"], r["loss"]] for r in records if "step" in r and "loss" in r]
        for rank, records in progress.items()
    }
    history = {"steps": steps, "consensus_distance": distances, "loss": loss_history}
    for name in sorted({n for s in summaries for n in s.get("reported", ()) if n not in ("loss", "test_loss")}):
        cluster[f"mean_{name}"] = _mean(_numbers(stayed, name))  # what scripts report: accuracy, perplexity
        series = {str(rank): [[r["step"], r[name]] for r in records if "step" in r and isinstance(r.get(name), float)]
                  for rank, records in progress.items()}
        if any(series.values()):
            history.setdefault("reported", {})[name] = series
    for key in ("staleness", "pi_median"):  # asynchronous parameter-server workers (GEM)
        series = {str(rank): [[r["step"], r[key]] for r in records if "step" in r and r.get(key) is not None]
                  for rank, records in progress.items()}
        if any(series.values()):
            history[key] = series
    result = {
        "config": dict(config or {}),
        "nodes": summaries,
        "cluster": cluster,
        "history": history,
        "warnings": warnings,
    }
    faults = load_faults(files.default)
    if faults:
        result["faults"] = faults
    ps_path = files.ps_summary
    if ps_path.exists():
        try:
            result["ps"] = json.loads(ps_path.read_text())
        except (OSError, ValueError) as exc:
            warnings.append(f"parameter server: cannot read {ps_path.name} ({exc})")
    return result


def step_times(summaries: Sequence[dict]) -> dict[str, float | None]:
    """The cluster's step times as users pay them, from the node summaries: after warm-up the mean
    (what speed ratios use), p50 and p95 (each a mean over nodes) and the slowest step of any node;
    and wall seconds per step, the slowest node's training time (warm-up included, evaluations
    excluded) over its steps. A median alone hides the tail that a run's wall time includes."""
    found = [s for s in summaries if s]
    return {"steady_step_seconds": _mean(_numbers(found, "steady_step_seconds")),
            "p50_step_seconds": _mean(_numbers(found, "median_step_seconds")),
            "p95_step_seconds": _mean(_numbers(found, "p95_step_seconds")),
            "max_step_seconds": _max(_numbers(found, "max_step_seconds")),
            "wall_seconds_per_step": _max(_numbers(found, "mean_step_seconds"))}


def merge_run(folders: Sequence[Path], out_dir: Path | None = None, nodes: int | None = None) -> dict:
    """The report of a run whose files are in `folders` (one per host, or one), written with its
    plot into `out_dir` (default: the only folder). The node count is `nodes`, else the highest
    rank found + 1 (a missing rank is a warning, as a missing file is); the wall time is that of
    the progress records. An earlier report.json in `out_dir` lends what only the launcher knew:
    the config, the wall time, each node's outcome and the verdicts."""
    files = locate(folders)
    if out_dir is None:
        if len({Path(f).resolve() for f in folders}) > 1:
            raise ValueError("several run folders: give --out OUT for the merged report")
        out_dir = files.default
    out_dir = Path(out_dir)
    count = nodes if nodes is not None else max(files.nodes, default=-1) + 1
    previous = _previous_report(out_dir)
    report = build_report(files, count, previous.get("config"), _wall_seconds(files, count))
    missing = [rank for rank in range(count) if rank not in files.nodes]
    if missing:
        report["warnings"].insert(0, f"no files of node(s) {missing} in {', '.join(str(Path(f)) for f in folders)}")
    extra = sorted(rank for rank in files.nodes if rank >= count)
    if extra:
        report["warnings"].insert(0, f"files of node(s) {extra} beyond --nodes {count} left out")
    if previous.get("cluster", {}).get("wall_seconds") is not None:
        report["cluster"]["wall_seconds"] = previous["cluster"]["wall_seconds"]
    for key in _LAUNCHER_CLUSTER_KEYS:
        if key in previous.get("cluster", {}):
            report["cluster"][key] = previous["cluster"][key]
    if "verdicts" in previous:  # judged by the launcher, with its bounds
        report["verdicts"] = previous["verdicts"]
    earlier = {n.get("rank"): n for n in previous.get("nodes", []) if isinstance(n, dict)}
    for node in report["nodes"]:
        node.update({k: earlier[node["rank"]][k] for k in _LAUNCHER_NODE_KEYS if k in earlier.get(node["rank"], {})})
    out_dir.mkdir(parents=True, exist_ok=True)
    write_report(report, out_dir)
    plot(report, out_dir)
    return report


def write_report(report: dict, out_dir: Path) -> Path:
    """Write OUT/report.json as strict JSON: NaN/Infinity (e.g. a diverged loss) become null and
    a note lists where, because most JSON readers reject the non-standard tokens."""
    bad_paths: list[str] = []
    clean = _json_safe(report, "", bad_paths)
    if bad_paths:
        shown = ", ".join(bad_paths[:_MAX_NOTED_PATHS])
        more = len(bad_paths) - _MAX_NOTED_PATHS
        note = f"non-finite numbers (NaN/Infinity) written as null at: {shown}"
        clean["notes"] = [*clean.get("notes", []), note + (f" (+{more} more)" if more > 0 else "")]
    path = Path(out_dir) / REPORT_NAME
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(clean, indent=2, allow_nan=False) + "\n")
    os.replace(tmp, path)  # readers never see a half-written report
    return path


def plot(report: dict, out_dir: Path) -> Path:
    """OUT/plot.png: training loss per node and consensus distance, side by side.

    Uses matplotlib's object API (a bare Figure renders with the Agg canvas) rather than pyplot,
    so it needs no display and never switches the backend of a program that imports us.
    """
    from matplotlib.figure import Figure

    history = report.get("history", {})
    cluster = report.get("cluster", {})
    titles = {"staleness": "commit staleness τ (mean per log interval)", "pi_median": "median GEM scaling π"}
    extra = {key: history[key] for key in titles if history.get(key)}
    extra.update(list(history.get("reported", {}).items())[:2])  # what the script reported (accuracy, ...)
    fig = Figure(figsize=(5 * (2 + len(extra)), 4), dpi=100, layout="constrained")
    loss_ax, consensus_ax, *extra_axes = fig.subplots(1, 2 + len(extra))
    for (key, series), ax in zip(extra.items(), extra_axes):
        for rank, points in sorted(series.items(), key=lambda kv: int(kv[0])):
            if points:  # (markers: a value reported once, at the end, is a single point)
                ax.plot(*zip(*points), linewidth=1, marker="o", markersize=3,
                        label=f"{'worker' if key in titles else 'node'} {rank}")
        ax.set_xlabel("step")
        ax.set_title(titles.get(key, key.replace("_", " ")))
        ax.grid(True, alpha=0.3)
    _plot_loss(loss_ax, history.get("loss", {}), report.get("faults", []))
    _plot_consensus(consensus_ax, history.get("steps", []), history.get("consensus_distance", []),
                    cluster.get("relative_consensus_distance"))
    fig.suptitle(_plot_title(cluster, report.get("config", {})))
    path = Path(out_dir) / PLOT_NAME
    fig.savefig(path, format="png")
    return path


# --- helpers -------------------------------------------------------------------------------------

def _load_summary(out_dir: Path, rank: int, warnings: list[str]) -> dict:
    path = summary_path(out_dir, rank)
    try:
        summary = json.loads(path.read_text())
        if not isinstance(summary, dict):
            raise ValueError("not a JSON object")
    except FileNotFoundError:
        warnings.append(f"node {rank}: {path.name} missing")
        return {"rank": rank}
    except (OSError, ValueError) as exc:
        warnings.append(f"node {rank}: cannot read {path.name} ({exc})")
        return {"rank": rank}
    return {"rank": rank, **summary}


def _previous_report(out_dir: Path) -> dict:
    try:
        previous = json.loads((out_dir / REPORT_NAME).read_text())
    except (OSError, ValueError):
        return {}
    return previous if isinstance(previous, dict) else {}


def _wall_seconds(files: RunFiles, nodes: int) -> float:
    """From the first to the last progress record of any node."""
    times = [r["time"] for rank in range(nodes) for r in load_progress(files.folder(rank), rank)
             if isinstance(r.get("time"), (int, float))]
    return max(times) - min(times) if times else 0.0


def _load_snapshots(files: RunFiles, nodes: int, warnings: list[str]) -> list[dict[int, torch.Tensor]] | None:
    """Per node {step: flat params}; None (with warnings) if any node's snapshots are unusable,
    since a consensus distance over a subset of nodes would be misleading."""
    per_node: list[dict[int, torch.Tensor]] = []
    for rank in range(nodes):
        path = snapshot_path(files.folder(rank), rank)
        if not path.exists():
            warnings.append(f"node {rank}: {path.name} missing; consensus distance unavailable")
            continue
        try:
            blob = torch.load(path, map_location="cpu", weights_only=True)
            steps = [int(s) for s in blob["steps"]]
            params = torch.as_tensor(blob["params"])
            if params.dim() != 2 or params.shape[0] != len(steps):
                raise ValueError(f"params shape {tuple(params.shape)} does not match {len(steps)} steps")
        except Exception as exc:  # any unreadable file is a warning, never a crash
            warnings.append(f"node {rank}: cannot read {path.name} ({exc}); consensus distance unavailable")
            continue
        per_node.append(dict(zip(steps, params)))
        coordinates = blob.get("coordinates")
        if isinstance(coordinates, list) and len(coordinates) == 2 and coordinates[0] != coordinates[1]:
            note = f"consensus distance estimated from {coordinates[0]:,} of {coordinates[1]:,} coordinates"
            if note not in warnings:
                warnings.append(note)
    if len(per_node) != nodes:
        return None
    dims = {row.shape[0] for snaps in per_node for row in snaps.values()}
    if len(dims) > 1:
        warnings.append(f"snapshot parameter sizes differ between nodes ({sorted(dims)}); "
                        "consensus distance unavailable")
        return None
    return per_node


def _consensus_history(files: RunFiles, nodes: int, warnings: list[str]) -> tuple[list[int], list[float], float | None]:
    """Consensus distance at each snapshot step all nodes share, and ||zbar|| at the last one."""
    per_node = _load_snapshots(files, nodes, warnings) if nodes > 0 else None
    if per_node is None:
        return [], [], None
    steps = sorted(set.intersection(*(set(snaps) for snaps in per_node)))
    if not steps:
        warnings.append("nodes share no snapshot step; consensus distance unavailable")
        return [], [], None
    stacks = {step: torch.stack([snaps[step] for snaps in per_node]) for step in steps}
    distances = [consensus_distance(stacks[step]) for step in steps]
    mean_norm = float(stacks[steps[-1]].to(torch.float64).mean(dim=0).norm())
    return steps, distances, mean_norm


def _numbers(summaries: Iterable[dict], key: str) -> list[float]:
    return [s[key] for s in summaries
            if isinstance(s.get(key), (int, float)) and not isinstance(s.get(key), bool)]


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _min(values: list[float]) -> float | None:
    return min(values) if values else None


def _max(values: list[float]) -> float | None:
    return max(values) if values else None


def _sum(values: list[float]) -> float | None:
    return sum(values) if values else None


def _json_safe(obj: Any, path: str, bad_paths: list[str]) -> Any:
    """Copy of `obj` that json.dumps(allow_nan=False) accepts; records where NaN/Inf were."""
    if isinstance(obj, dict):
        return {str(k): _json_safe(v, f"{path}.{k}" if path else str(k), bad_paths) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v, f"{path}[{i}]", bad_paths) for i, v in enumerate(obj)]
    if isinstance(obj, float):
        if math.isfinite(obj):
            return obj
        bad_paths.append(path)
        return None
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if hasattr(obj, "tolist"):  # numpy / torch scalars and arrays
        return _json_safe(obj.tolist(), path, bad_paths)
    return str(obj)


def _finite_or_nan(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) else math.nan


def _plot_loss(ax, loss_history: dict, faults: list[dict] = ()) -> None:
    ranks = sorted(loss_history, key=int)
    for rank in ranks:
        points = loss_history[rank]
        ax.plot([p[0] for p in points], [_finite_or_nan(p[1]) for p in points],
                linewidth=1.2, label=f"node {rank}")
    curves = list(ax.lines)
    marks = _mark_faults(ax, faults)
    ax.set_title("Training loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (log scale)")
    ax.grid(True, alpha=0.3)
    values = [p[1] for rank in ranks for p in loss_history[rank] if isinstance(p[1], (int, float))]
    if values and all(math.isfinite(v) and v > 0 for v in values):
        ax.set_yscale("log")
    if not any(loss_history.get(rank) for rank in ranks):
        _no_data(ax, "no progress data")
    elif len(ranks) <= 12:
        ax.legend(fontsize="small", ncol=2 if len(ranks) + len(marks) > 6 else 1)
    else:  # one entry per node would hide the curves
        ax.legend([curves[0], *marks.values()], [f"{len(ranks)} nodes", *marks], fontsize="small")


def _mark_faults(ax, faults: list[dict]) -> dict:
    """A dashed vertical line at the cluster step of every fault fired (a restart skipped is not
    one), coloured by kind; returns {legend label: one line of it}."""
    marks: dict = {}
    for fault in faults:
        step, action = fault.get("cluster_step"), fault.get("action")
        if not isinstance(step, (int, float)) or fault.get("skipped"):
            continue
        label = f"{action} (fault)"
        line = ax.axvline(step, color=FAULT_COLORS.get(action, "black"), linestyle="--", linewidth=0.9, alpha=0.7,
                          label=label if label not in marks else None)
        marks.setdefault(label, line)
    return marks


def _plot_consensus(ax, steps: list, distances: list, relative: float | None) -> None:
    values = [_finite_or_nan(d) for d in distances]
    ax.set_title("Consensus distance")
    ax.set_xlabel("step")
    ax.set_ylabel("RMS distance to the mean model")
    ax.grid(True, alpha=0.3)
    if not values:
        _no_data(ax, "no snapshot data")
        return
    label = f"final {values[-1]:.3g}"
    if isinstance(relative, (int, float)):
        label += f" (relative {relative:.3g})"
    ax.plot(steps, values, marker="o", markersize=3, color="tab:purple", label=label)
    if all(v > 0 for v in values):
        ax.set_yscale("log")
    ax.legend(fontsize="small")


def _no_data(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="gray")


def _plot_title(cluster: dict, config: dict) -> str:
    parts = [f"{cluster.get('nodes', '?')} nodes"]
    if config.get("algorithm"):
        parts.append(f"{config['algorithm']} on {config.get('topology') or 'its default graph'}")
    wall = cluster.get("wall_seconds")
    if isinstance(wall, (int, float)):
        parts.append(f"wall {wall:.1f} s")
    accuracy = cluster.get("mean_test_accuracy")
    if isinstance(accuracy, (int, float)) and math.isfinite(accuracy):
        parts.append(f"mean test accuracy {accuracy:.3f}")
    return " · ".join(parts)
