"""End-of-run verdicts of a run with faults (`p2ptrain launch --chaos`): did the cluster keep its
invariants while nodes were killed, stalled, left and joined?

    exits, finite   every process that should have finished exited 0; final models and losses finite
    identical       what a ring or DiLoCo keeps identical is the same bits on every final member
    mass            push-sum: Σ w of the final members = the units minus what went down with kills
    stall, memory   no step of a node not itself stalled took too long; no node's RSS grew too much
    accuracy        the mean test accuracy is within a margin of a fault-free run of the same seed

Pure functions of the report (with the launcher's outcomes and fault log) and the run folder, so each
is tested on files a test writes. A verdict that does not apply passes and says why ("n/a: ...").
"""
from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from . import report as run_report

FINE_OUTCOMES = ("done", "killed", "not rejoined", "not joined")  # killed for good, restarted too late: no failure
MASS_TOLERANCE = 1e-6     # float64 rounding of w over a run's thousands of multiplies and adds is ~1e-12
STALL_DEADLINES = 3       # the default stall bound allows this many link deadlines (a catch-up waits up to 3)
STALL_PACE_STEPS = 20     # ... and this many median steps
RESUME_SLACK_SECONDS = 1.0  # the launcher resumes a stalled node at its next poll (0.5 s) after its time
RSS_GROWTH_MB = 200.0
RSS_GROWTH_FRACTION = 0.5  # a node fails only above both: growth > max(MB bound, 50% of its warm RSS)
WARM_FRACTION = 0.1        # RSS after warm-up: the first record this far into the run (or incarnation)
ACCURACY_MARGIN = 0.03


@dataclass(frozen=True)
class VerdictOptions:
    """The bounds (None: derived from the run) and the fault-free baseline's accuracy, if any."""

    max_stall_seconds: float | None = None
    max_rss_growth_mb: float = RSS_GROWTH_MB
    baseline_accuracy: float | None = None
    baseline_source: str = ""
    accuracy_margin: float = ACCURACY_MARGIN


@dataclass
class Verdict:
    name: str
    ok: bool
    detail: str
    figures: dict = field(default_factory=dict)

    def line(self) -> str:
        return f"{'PASS' if self.ok else 'FAIL'} {self.name:<9} {self.detail}"


def judge(out_dir: Path, report: dict, options: VerdictOptions = VerdictOptions()) -> list[Verdict]:
    """Every verdict of the run in `out_dir` whose report (with outcomes and faults) is `report`."""
    faults = report.get("faults", [])
    return [exits(report), finite(out_dir, report), identical(report), mass(report, faults),
            stall(out_dir, report, faults, options.max_stall_seconds),
            memory(out_dir, report, faults, options.max_rss_growth_mb),
            accuracy(report, options.baseline_accuracy, options.accuracy_margin, options.baseline_source)]


def failed(verdicts: list[Verdict]) -> list[str]:
    return [v.name for v in verdicts if not v.ok]


def final_members(report: dict) -> list[dict]:
    """The nodes that trained to the end as members: finished (exited 0), did not leave."""
    return [n for n in report.get("nodes", []) if n.get("outcome", "done") == "done" and n.get("left_at") is None
            and isinstance(n.get("steps"), int)]


# --- the verdicts ---------------------------------------------------------------------------------

def exits(report: dict) -> Verdict:
    """Every node ended as planned: done, killed for good, restarted after the cluster had finished,
    or a planned joiner the run ended before; left nodes are done (they exited 0)."""
    outcomes: dict[str, int] = {}
    bad = []
    for node in report.get("nodes", []):
        outcome = node.get("outcome", "unknown")
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        if outcome not in FINE_OUTCOMES:
            bad.append({"rank": node.get("rank"), "outcome": outcome, "reason": node.get("outcome_reason", "")})
    failure = report.get("cluster", {}).get("failure")
    ok = not bad and not failure
    counts = ", ".join(f"{n} {outcome}" for outcome, n in sorted(outcomes.items()))
    detail = counts if ok else "; ".join([*(f"node {b['rank']} {b['outcome']}" for b in bad),
                                          *([failure] if failure and not bad else [])])
    return Verdict("exits", ok, detail, {"outcomes": outcomes, "bad": bad})


def finite(out_dir: Path, report: dict) -> Verdict:
    """The final model (the last snapshot: all coordinates, or a fixed sample of a large model's)
    and the final loss of every final member are finite, and none went non-finite on the way."""
    members = final_members(report)
    bad = []
    for node in members:
        rank = node["rank"]
        why = _nonfinite(out_dir, node)
        if why:
            bad.append({"rank": rank, "why": why})
    if not members:
        return Verdict("finite", False, "no final member to check", {"checked": 0, "bad": []})
    ok = not bad
    detail = (f"{len(members)} final model(s) and losses finite" if ok else
              "; ".join(f"node {b['rank']}: {b['why']}" for b in bad))
    return Verdict("finite", ok, detail, {"checked": len(members), "bad": bad})


def identical(report: dict) -> Verdict:
    """The state the algorithm keeps the same bits on every member (Algorithm.shared_state: a
    ring's model, DiLoCo's anchor) has one digest across the final members, and so has the inner
    optimizer state where the algorithm keeps that equal too (rings averaging gradients). A node
    restarted so late that its view switched at or after the run's last step never trained as a
    member: it took a donor's state and ran the last steps alone, so it is not held to the
    members' bits. Nor is a node every other final member declared dead (it stalled past the
    peer timeout near the end, and they finished without it: it had nobody left to rejoin);
    the detail names it. Where that would leave nobody (each declared the other dead), all are
    held."""
    steps = report.get("config", {}).get("steps")
    members = [n for n in final_members(report)
               if not (isinstance(steps, int) and isinstance(n.get("start_step"), int) and n["start_step"] >= steps)]
    members, left_dead = _without_declared_dead(members)
    aside = f"; node(s) {left_dead} not held: the other final members declared them dead" if left_dead else ""
    states = {n["rank"]: n.get("shared_state") for n in members}
    if not any(states.values()):
        return Verdict("identical", True, "n/a: the algorithm keeps no state identical across members",
                       {"digests": {}})
    figures, problem = _one_digest(states)
    what = figures["what"]
    optimizer_states = {n["rank"]: n["optimizer_state"] for n in members if n.get("optimizer_state")}
    if optimizer_states:
        figures["optimizer_state"], optimizer_problem = _one_digest(optimizer_states)
        problem = problem or optimizer_problem
        what += " and optimizer state"
    figures["declared_dead"] = left_dead
    if problem:
        return Verdict("identical", False, problem + aside, figures)
    return Verdict("identical", True, f"{what} bit-identical on {len(states)} final members "
                                      f"(sha256 {next(iter(figures['digests'].values()))[:12]}){aside}", figures)


def _without_declared_dead(members: list[dict]) -> tuple[list[dict], list[int]]:
    """`members` without those every other one lists among its dead peers (Node.close:
    `dead_peers`), and their ranks; all of them where that would leave none."""
    dead = [n for n in members if len(members) > 1 and all(n["rank"] in (other.get("dead_peers") or [])
                                                           for other in members if other is not n)]
    kept = [n for n in members if all(n is not d for d in dead)]
    if not kept:
        return members, []
    return kept, sorted(n["rank"] for n in dead)


def _one_digest(states: dict[int, dict | None]) -> tuple[dict, str | None]:
    """Figures of state digests by rank (Node.close: {name, sha256, numel}), and what is wrong
    (None: one digest on every rank)."""
    digests = {rank: state["sha256"] for rank, state in states.items() if state}
    what = next(state["name"] for state in states.values() if state)
    groups: dict[str, list[int]] = {}
    for rank, digest in sorted(digests.items()):
        groups.setdefault(digest, []).append(rank)
    figures = {"what": what, "digests": {str(r): d[:16] for r, d in digests.items()}, "groups": len(groups),
               "numel": next(state["numel"] for state in states.values() if state)}
    missing = sorted(rank for rank, state in states.items() if not state)
    if missing:
        return figures, f"no {what} digest from node(s) {missing}"
    if len(groups) > 1:
        parts = " vs ".join(f"nodes {ranks} {digest[:12]}" for digest, ranks in groups.items())
        return figures, f"{what} differs across final members: {parts}"
    return figures, None


def mass(report: dict, faults: list[dict]) -> Verdict:
    """Push-sum: Σ w over the final members against the ledger. Units: the nodes that started, plus
    the new units fresh processes were given (joiners and restarted nodes: each incarnation's
    `ps_minted`, or its mass record's at a kill; older runs: one per join), minus the units retired
    for leavers (a leaver hands its w over and the member that takes it retires one unit, or less
    where its w would fall under a quarter; older runs: one per leave). Lost: what each
    SIGKILLed node held (its mass record, read by the launcher after the kill: w held is lost for
    certain; shares it had sent and not seen acknowledged may have landed, and shares acknowledged to
    their senders but not folded in are lost unless the ack never left: `mass_uncertain`). Shares a
    final member sent and never saw acknowledged by its end (`ps_in_flight`: to a node frozen past
    the end) are uncertain too. So Σ w must lie in [units - lost - uncertain, units - lost], give or
    take MASS_TOLERANCE.

    Where every incarnation recorded its flows of w (`ps_flows`, a kill's `mass_flows`), the
    uncertainty goes: the shares that never landed are what left the senders and did not come back
    minus what the receivers took delivery of, so Σ w must equal units - lost - inboxes - that, and
    that must lie in [0, what was in flight at the kills and unacknowledged at the end]
    (_exact_ledger)."""
    nodes = report.get("nodes", [])
    if not any(n.get("push_sum") for n in nodes):
        return Verdict("mass", True, "n/a: not a push-sum algorithm", {})
    members = final_members(report)
    fired = [f for f in faults if not f.get("skipped")]
    started = report.get("config", {}).get("world_size") or (len(nodes) - sum(f["action"] == "join" for f in fired))
    joins = sum(f["action"] == "join" for f in fired)
    leaves = sum(1 for n in nodes if n.get("left_at") is not None)
    kills = [f for f in fired if f["action"] == "kill"]
    minted = _minted(nodes, kills)
    retired = _retired(nodes, kills)
    lost = sum(float(f.get("mass_lost") or 0.0) for f in kills)
    uncertain_with_kills = sum(float(f.get("mass_uncertain") or 0.0) for f in kills)
    unacknowledged = sum(float(n.get("ps_in_flight") or 0.0) for n in members)
    uncertain = uncertain_with_kills + unacknowledged
    unrecorded = [f["rank"] for f in kills if "mass_lost" not in f]
    units = started + (joins if minted is None else minted) - (leaves if retired is None else retired)
    actual = sum(float(n.get("ps_weight") or 0.0) for n in members)
    low, high = units - lost - uncertain, units - lost
    difference = actual - high if actual > high else (actual - low if actual < low else 0.0)
    figures = {"units": units, "started": started, "joins": joins, "minted": minted, "leaves": leaves,
               "retired": retired,
               "kills": len(kills),
               "lost_with_kills": lost, "uncertain_with_kills": uncertain_with_kills,
               "unacknowledged_at_end": unacknowledged, "expected_low": low,
               "expected_high": high, "actual": actual, "difference": difference, "tolerance": MASS_TOLERANCE,
               "kills_without_record": unrecorded}
    ok = abs(difference) <= MASS_TOLERANCE
    exact = _exact_ledger(nodes, kills, members)
    if exact is not None:
        exact["actual"] = actual
        exact["difference"] = actual - exact["expected"]
        figures["exact"] = exact
        wire_ok = -MASS_TOLERANCE <= exact["never_landed"] <= exact["in_flight"] + MASS_TOLERANCE
        ok = abs(exact["difference"]) <= MASS_TOLERANCE and wire_ok
        left = f" - {exact['left_with_leavers']:.6f} left with leavers" if exact["left_with_leavers"] else ""
        detail = (f"Σ w {actual:.6f} over {len(members)} final members, expected {exact['expected']:.6f} = "
                  f"{exact['units']:.6g} units - {exact['held_by_killed']:.6f} held by {len(kills)} killed node(s) - "
                  f"{exact['inboxes']:.6f} in inboxes - {exact['never_landed']:.6f} sent and never landed (of "
                  f"{exact['in_flight']:.6f} in flight at kills and at the end){left}")
        if abs(exact["difference"]) > MASS_TOLERANCE:
            detail += f": off by {exact['difference']:+.3g}"
        elif not wire_ok:
            detail += ": more landed than was sent" if exact["never_landed"] < 0 else \
                ": more never landed than was in flight"
        return Verdict("mass", ok, detail, figures)
    expected = f"{high:.6f}" if uncertain == 0 else f"[{low:.6f}, {high:.6f}]"
    in_flight = "" if not uncertain else (
        f" (- up to {uncertain:.6f} in flight: {uncertain_with_kills:.6f} at kills, {unacknowledged:.6f} "
        "unacknowledged at the end)" if uncertain_with_kills and unacknowledged else
        f" (- up to {uncertain:.6f} in flight{' at the end' if unacknowledged else ''})")
    detail = (f"Σ w {actual:.6f} over {len(members)} final members, expected {expected} = {units:.6g} units - "
              f"{lost:.6f} lost with {len(kills)} kill(s){in_flight}" + ("" if ok else f": off by {difference:+.3g}"))
    return Verdict("mass", ok, detail, figures)


def stall(out_dir: Path, report: dict, faults: list[dict], bound: float | None = None) -> Verdict:
    """The longest step of any node while it was not itself stalled or killed (the slowest
    progress-line interval's longest step, max_step_seconds; the gap between the lines where an
    older node wrote no per-step maximum), in seconds and in median steps, against `bound`
    (default: the longest planned stall + STALL_DEADLINES link deadlines + STALL_PACE_STEPS median
    steps). The first interval of each incarnation (start-up, rejoining) is left out, and so is a
    leaver's last (it hands its mass over, which waits on the member that takes it; the others
    train on meanwhile)."""
    config = report.get("config", {})
    pace = _median([n.get("median_step_seconds") for n in report.get("nodes", [])]) or 0.0
    stalls = [float(f.get("seconds") or 0.0) for f in faults if f.get("action") == "stall"]
    if bound is None:
        bound = max(stalls, default=0.0) + STALL_DEADLINES * float(config.get("link_deadline") or 10.0) \
            + STALL_PACE_STEPS * pace
    windows = _own_fault_windows(faults)
    worst: dict | None = None
    longest_gap = 0.0
    for node in report.get("nodes", []):
        rank = node["rank"]
        lines = [r for r in run_report.load_progress(out_dir, rank) if "step_seconds" in r and _number(r.get("time"))]
        left_at = node["left_at"] if _number(node.get("left_at")) else math.inf
        for previous, line in zip(lines, lines[1:]):
            if line["step"] <= previous["step"] or _overlaps(windows.get(rank, []), previous["time"], line["time"]):
                continue  # the same step again (the final line), or this node was stalled or killed
            if line["step"] >= left_at:
                continue  # a leaver's hand-over
            gap = line["time"] - previous["time"]
            longest_gap = max(longest_gap, gap)
            seconds = line.get("max_step_seconds", gap)
            if _number(seconds) and (worst is None or seconds > worst["seconds"]):
                worst = {"rank": rank, "step": line["step"], "seconds": float(seconds)}
    if worst is None:
        return Verdict("stall", True, "n/a: no progress intervals to measure",
                       {"bound_seconds": bound, "longest_gap_seconds": longest_gap})
    steps = worst["seconds"] / pace if pace else None
    figures = {"longest_seconds": worst["seconds"], "longest_steps": steps, "rank": worst["rank"],
               "at_step": worst["step"], "bound_seconds": bound, "median_step_seconds": pace,
               "longest_gap_seconds": longest_gap}
    ok = worst["seconds"] <= bound
    in_steps = f" ({steps:.0f} median steps)" if steps is not None else ""
    detail = (f"longest step {worst['seconds']:.2f}s{in_steps} on node {worst['rank']} before step {worst['step']}, "
              f"bound {bound:.1f}s")
    return Verdict("stall", ok, detail, figures)


def memory(out_dir: Path, report: dict, faults: list[dict], max_growth_mb: float = RSS_GROWTH_MB) -> Verdict:
    """Each final member's RSS at its last progress line against its RSS after warm-up (the first
    line WARM_FRACTION of the run's steps into its incarnation): it fails when it grew by more
    than `max_growth_mb` and by more than RSS_GROWTH_FRACTION of the warm RSS."""
    steps = int(report.get("config", {}).get("steps") or 0)
    restarts = {}
    for fault in faults:
        if fault.get("action") == "restart" and not fault.get("skipped") and _number(fault.get("time")):
            restarts[fault["rank"]] = max(restarts.get(fault["rank"], 0.0), fault["time"])
    growth = []
    for node in final_members(report):
        rank = node["rank"]
        lines = [r for r in run_report.load_progress(out_dir, rank) if _number(r.get("rss_mb")) and "step" in r
                 and r.get("time", math.inf) >= restarts.get(rank, -math.inf)]  # its last incarnation
        if len(lines) < 2:
            continue
        warm_at = lines[0]["step"] + max(1, int(steps * WARM_FRACTION))
        warm = next((r for r in lines if r["step"] >= warm_at), lines[0])
        end = lines[-1]
        grew = end["rss_mb"] - warm["rss_mb"]
        allowed = max(max_growth_mb, RSS_GROWTH_FRACTION * warm["rss_mb"])
        growth.append({"rank": rank, "warm_mb": warm["rss_mb"], "warm_step": warm["step"], "end_mb": end["rss_mb"],
                       "growth_mb": grew, "allowed_mb": allowed})
    if not growth:
        return Verdict("memory", True, "n/a: no resident-memory records (rss_mb)", {"nodes": []})
    worst = max(growth, key=lambda g: g["growth_mb"] - g["allowed_mb"])
    bad = [g for g in growth if g["growth_mb"] > g["allowed_mb"]]
    detail = (f"largest growth {worst['growth_mb']:+.1f} MB on node {worst['rank']} ({worst['warm_mb']:.0f} -> "
              f"{worst['end_mb']:.0f} MB after step {worst['warm_step']}), allowed {worst['allowed_mb']:.0f} MB")
    return Verdict("memory", not bad, detail, {"nodes": growth, "failed": [g["rank"] for g in bad]})


def accuracy(report: dict, baseline: float | None, margin: float = ACCURACY_MARGIN, source: str = "") -> Verdict:
    """The mean final test accuracy of the final members is at most `margin` below the fault-free
    baseline's (a run that does better under faults passes)."""
    value = report.get("cluster", {}).get("mean_test_accuracy")
    if baseline is None:
        return Verdict("accuracy", True, "n/a: no fault-free baseline (--chaos-baseline or --chaos-compare)",
                       {"accuracy": value})
    figures = {"accuracy": value, "baseline": baseline, "margin": margin, "baseline_source": source}
    if not _number(value):
        return Verdict("accuracy", False, "no test accuracy in this run's report", figures)
    figures["difference"] = value - baseline
    ok = value >= baseline - margin
    return Verdict("accuracy", ok, f"mean test accuracy {value:.4f}, fault-free {baseline:.4f} "
                                   f"({value - baseline:+.4f}, margin {margin:g})", figures)


# --- helpers --------------------------------------------------------------------------------------

def _exact_ledger(nodes: list[dict], kills: list[dict], members: list[dict]) -> dict | None:
    """Every flow of w, summed over the incarnations: the killed ones (their mass records, read at
    the kill) and the ones that ended as planned (their summaries); None where one of them did not
    record its flows (an older run). Each incarnation holds started + taken - sent + reabsorbed -
    retired - dropped; what it took delivery of (received, the new units it was given aside) and
    what left the senders for good (sent - reabsorbed) differ by the mass that never landed."""
    killed = [f for f in kills if "mass_lost" in f]
    ended = [n for n in nodes if n.get("outcome", "done") == "done" and isinstance(n.get("steps"), int)]
    if any("mass_flows" not in f for f in killed) or any(not n.get("ps_flows") for n in ended):
        return None
    flows = [f["mass_flows"] for f in killed] + [n["ps_flows"] for n in ended]
    if not flows:
        return None

    def total(name: str) -> float:
        return sum(float(f.get(name) or 0.0) for f in flows)

    units = total("started") + total("minted") - total("retired")
    never_landed = (total("sent") - total("reabsorbed")) - (total("received") - total("minted"))
    held_by_killed = sum(float(f["mass_lost"]) for f in killed)
    inboxes = sum(max(0.0, float(f.get("received") or 0.0) - float(f.get("taken") or 0.0)) for f in flows)
    final = {id(n) for n in members}
    left_with_leavers = sum(float(n.get("ps_weight") or 0.0) for n in ended if id(n) not in final)
    in_flight = sum(float(f.get("mass_in_flight") or 0.0) for f in killed) + \
        sum(float(n.get("ps_in_flight") or 0.0) for n in members)
    expected = units - total("dropped") - held_by_killed - inboxes - never_landed - left_with_leavers
    return {"units": units, "dropped": total("dropped"), "held_by_killed": held_by_killed, "inboxes": inboxes,
            "never_landed": never_landed, "in_flight": in_flight, "left_with_leavers": left_with_leavers,
            "expected": expected, "incarnations": len(flows)}


def _minted(nodes: list[dict], kills: list[dict]) -> float | None:
    """The new units every incarnation started with: the killed ones' mass records and the nodes
    that ended as planned (finished, or left); None for a run that recorded none (older runs)."""
    ended = [n for n in nodes if n.get("outcome", "done") == "done" and "ps_minted" in n]
    killed = [f for f in kills if "mass_minted" in f]
    if not ended and not killed:
        return None
    return sum(float(n["ps_minted"] or 0.0) for n in ended) + sum(float(f["mass_minted"] or 0.0) for f in killed)


def _retired(nodes: list[dict], kills: list[dict]) -> float | None:
    """The units taken out for leavers, as recorded: a member retires one unit per leaver, or less
    where that would leave its w under a quarter (PushSum.take_over); None where some incarnation did
    not record its flows (older runs: one unit per leave is assumed)."""
    ended = [n for n in nodes if n.get("outcome", "done") == "done" and isinstance(n.get("steps"), int)]
    killed = [f for f in kills if "mass_lost" in f]
    if any(not n.get("ps_flows") for n in ended) or any("mass_flows" not in f for f in killed):
        return None
    return sum(float(n["ps_flows"].get("retired") or 0.0) for n in ended) + \
        sum(float(f["mass_flows"].get("retired") or 0.0) for f in killed)


def as_dicts(verdicts: list[Verdict]) -> list[dict]:
    return [asdict(v) for v in verdicts]


def _nonfinite(out_dir: Path, node: dict) -> str:
    """Why this node's end is not finite ("" if it is)."""
    if node.get("nonfinite_step") is not None:
        return f"non-finite {node.get('nonfinite', 'value')} from step {node['nonfinite_step']}"
    if "loss" in node.get("reported", ["loss"]) and node.get("steps", 0) > 0 and not _number(node.get("final_loss")):
        return "final loss not finite"  # (a script that reports no loss has none to check)
    path = run_report.snapshot_path(out_dir, node["rank"])
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
        last = torch.as_tensor(blob["params"])[-1]
    except Exception as exc:  # any unreadable snapshot: the model cannot be shown finite
        return f"no final snapshot ({path.name}: {type(exc).__name__})"
    bad = int((~torch.isfinite(last)).sum())
    return f"final model has {bad} non-finite coordinate(s)" if bad else ""


def _own_fault_windows(faults: list[dict]) -> dict[int, list[tuple[float, float]]]:
    """Per rank, the unix-time windows it was stalled (stall start to its resume) or down (kill to
    restart, or to the end)."""
    windows: dict[int, list[tuple[float, float]]] = {}
    down: dict[int, float] = {}
    for fault in faults:
        at, rank = fault.get("time"), fault.get("rank")
        if not _number(at):
            continue
        if fault.get("action") == "stall":
            windows.setdefault(rank, []).append((at, at + float(fault.get("seconds") or 0.0) + RESUME_SLACK_SECONDS))
        elif fault.get("action") == "kill":
            down[rank] = at
        elif fault.get("action") == "restart" and rank in down:
            windows.setdefault(rank, []).append((down.pop(rank), at))
    for rank, at in down.items():
        windows.setdefault(rank, []).append((at, math.inf))
    return windows


def _overlaps(windows: list[tuple[float, float]], start: float, end: float) -> bool:
    return any(a < end and start < b for a, b in windows)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _median(values: list) -> float | None:
    numbers = [v for v in values if _number(v)]
    return statistics.median(numbers) if numbers else None


__all__ = ["ACCURACY_MARGIN", "MASS_TOLERANCE", "Verdict", "VerdictOptions", "accuracy", "as_dicts", "exits",
           "failed", "final_members", "finite", "identical", "judge", "mass", "memory", "stall"]
