"""`p2ptrain simulate`: many logical nodes in a few processes, to measure protocol costs, not speed.

Each process hosts its share of the nodes (bench/simulate_host.py), every node a real Transport on
loopback that knows every address. Per node it reports the gRPC calls for membership and control
(Hello, Settle, DialBack) against tensor messages, open channels and lane connections, the time
until every node is ready, push-sum's consensus distance after each step against the exact theory
(bench/consensus.py) and Σ w; then one node leaves, and the calls per node that change cost (less
a baseline window of the same length) and the time until every node holds the view without it.
`--sweep` repeats it over several n and fits the exponent of the change's calls per node in n.
"""
from __future__ import annotations

import dataclasses
import json
import math
import multiprocessing
import random
import sys
import time
from pathlib import Path

import torch

from launcher.interrupts import sigint_interrupts
from launcher.ports import free_ports
from p2ptrain.bench.clusters import fmt, print_table
from p2ptrain.bench.consensus import consensus_distance, initial_vector, push_sum_trace
from p2ptrain.bench.simulate_host import DATA_METHOD, Plan, host
from p2ptrain.topology import build_topology

RESULT_NAME = "simulate.json"
MIXED = 1e-9  # consensus distance, relative to the start's, counted as mixed (exact on 2^k nodes: rounding)
# curves fitted as n^exponent per node: (name, key path in a run)
FITTED = (("change_calls", ("change", "control_messages_per_node")),
          ("change_bytes", ("change", "control_bytes_per_node")),
          ("start_calls", ("startup", "control_messages_per_node")),
          ("channels", ("connections", "channels_per_node")))
PLOT_NAME = "scale.png"
HOST_GRACE_SECONDS = 60  # past --timeout, for a host to start (spawn, imports) and report its own timeout
HOST_EXIT_SECONDS = 10  # for the processes to exit by themselves once their hosts returned


def simulate(nodes: int, processes: int, steps: int, dim: int, window: int, timeout: float,
             meet: str = "neighbours", churn: int = 0, churn_steps: int = 0, seed: int = 0,
             shared_loop: bool = True, grpc_calls: bool = False) -> dict:
    """One simulation of `nodes` nodes in `processes` processes, meeting `meet` at start
    (TransportOptions.meet), with `churn` leaves and as many joins over `churn_steps` steps at
    the end; its summary (see summarize). `shared_loop`: one event loop per process for all its
    nodes (False: a loop thread per node). `grpc_calls`: the nodes of a process call each other by
    gRPC (False: on a shared loop, in-process: paths/local_calls.py)."""
    processes = max(1, min(processes, nodes))
    world = nodes + churn
    plan = Plan(tuple(f"127.0.0.1:{port}" for port in free_ports(world)), steps, dim, window,
                leaver=nodes - 1 if nodes > 2 else None, timeout=timeout, meet=meet,
                members=nodes if churn else None, churn_steps=churn_steps if churn else 0, shared_loop=shared_loop,
                grpc_calls=grpc_calls)
    plan = dataclasses.replace(plan, churn=churn_schedule(plan, churn, seed))
    groups = [list(range(world))[p::processes] for p in range(processes)]
    # A pool that can be killed: on a timeout, Ctrl-C or a failed host the others are stopped at
    # once (a ProcessPoolExecutor waits for its workers on the way out, and a stuck node held it)
    pool = multiprocessing.get_context("spawn").Pool(processes)
    try:
        pending = [pool.apply_async(host, (plan, group)) for group in groups]
        end = time.monotonic() + timeout + HOST_GRACE_SECONDS  # (each host stops itself at `timeout`)
        parts = []
        for part in pending:
            try:
                parts.append(part.get(max(0.0, end - time.monotonic())))
            except multiprocessing.TimeoutError:
                raise TimeoutError(f"a process of {nodes} simulated nodes still ran {timeout:.0f}s + "
                                   f"{HOST_GRACE_SECONDS}s after the start") from None
            except Exception:  # (a host's own error or timeout: the others end theirs, or are stopped)
                end_processes(pool, HOST_EXIT_SECONDS)
                raise
    except BaseException:  # Ctrl-C, SIGTERM, a host that hangs: stop them all now
        end_processes(pool, 0.0)
        raise
    end_processes(pool, HOST_EXIT_SECONDS)
    return summarize(plan, parts)


def end_processes(pool, patience: float) -> None:
    """Let the pool's processes exit by themselves for up to `patience` seconds, then terminate
    the rest. A process killed while it holds the pool's locks makes multiprocessing's resource
    tracker print tracebacks after our one-line error; one that returned from its host exits cleanly."""
    pool.close()
    deadline = time.monotonic() + patience
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    pool.terminate()
    pool.join()


def churn_schedule(plan: Plan, events: int, seed: int) -> tuple[tuple[int, int, int], ...]:
    """`events` (step, leaving, joining) spread evenly over the churn steps: a random initial member
    (not node 0, nor the change window's leaver) leaves as the next new rank joins."""
    if not events:
        return ()
    stayers = [rank for rank in range(1, plan.nodes) if rank != plan.leaver]
    if events > len(stayers) or plan.churn_steps < events:
        raise ValueError(f"{events} churn events need {events}+ members that may leave and as many churn steps")
    leaving = random.Random(seed).sample(stayers, events)
    return tuple((plan.churn_at + (2 * k + 1) * plan.churn_steps // (2 * events), leaver, plan.nodes + k)
                 for k, leaver in enumerate(leaving))


def per_node(records: list[dict], key: str, since: str | None = None, field: str = "control_messages") -> list[int]:
    """Each node's `field` at snapshot `key`, less its value at snapshot `since`."""
    return [r[key][field] - (r[since][field] if since else 0) for r in records]


def calls(record: dict, key: str, method: str) -> int:
    """The calls of `method` a node had made by snapshot `key`."""
    return record[key]["methods"].get(method, [0, 0])[0]


def methods_of(records: list[dict], key: str) -> list[str]:
    """The control methods any node had called by snapshot `key`."""
    return sorted({m for r in records for m in r[key]["methods"]} - {DATA_METHOD})


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def summarize(plan: Plan, parts: list[dict]) -> dict:
    """The numbers of one simulation, per node where it says so."""
    records = sorted((r for part in parts for r in part["records"]), key=lambda r: r["rank"])
    n = plan.nodes
    methods = sorted({m for r in records for m in r["startup"]["methods"]})
    startup = {"control_messages_per_node": mean(per_node(records, "startup")),
               "control_bytes_per_node": mean(per_node(records, "startup", field="control_bytes")),
               "calls_per_node": {m: mean(calls(r, "startup", m) for r in records) for m in methods}}
    steady = {key: mean(per_node(records, "change_from", "steady_from", field)) / plan.window
              for key, field in (("control_messages_per_node_step", "control_messages"),
                                 ("data_messages_per_node_step", "data_messages"),
                                 ("data_bytes_per_node_step", "data_bytes"))}
    steady["control_calls_per_node"] = {m: mean(calls(r, "change_from", m) - calls(r, "steady_from", m)
                                                for r in records) for m in methods_of(records, "change_from")}
    connections = {"channels_per_node": mean(r["change_from"]["channels"] for r in records),
                   "channels_max": max(r["change_from"]["channels"] for r in records),
                   "lane_connections_per_node": mean(r["change_from"]["lane_connections"] for r in records)}
    return {"nodes": n, "processes": len(parts), "algorithm": "sgp", "meet": plan.meet, "dim": plan.dim,
            "steps": plan.steps,
            "window": plan.window, "started": sum(1 for r in records if r.get("ready")),
            "threads_per_process": max(part["threads"] for part in parts),
            "start_seconds": max(r["ready"] for r in records) - min(part["began"] for part in parts),
            "startup": startup, "steady": steady, "connections": connections,
            "consensus": consensus(plan, records), "change": change(plan, records),
            "churn": churn_costs(plan, records, [j for part in parts for j in part["joiners"]],
                                 {rank: seen for part in parts for rank, seen in part["views"].items()})}


def churn_costs(plan: Plan, records: list[dict], joiners: list[dict], views: dict) -> dict | None:
    """What the churn cost: control calls and bytes per node per event (every node's calls in the
    churn phase up to its last step, the joiners' whole runs included; the "finished" Hellos of
    finish(), which tell every peer met that the run is over, come after and are reported apart,
    per final member), the churn rate it came to (per minute, of the
    members), how long each view took to reach every node that was there when it came (in seconds
    and in the steps of the node it reached last, against the proposer's), and Σ w of the final
    members against the units there are: n, plus each joiner's new one, less each leaver's, retired
    where its mass went (one per final member)."""
    if not plan.churn:
        return None
    events = len(plan.churn)
    began = min(r["change_to_time"] for r in records if "change_to_time" in r)
    ended = max(r["end_time"] for r in records + joiners)
    cost = {}
    final = [r for r in records + joiners if not r["left"]]
    for field in ("control_messages", "control_bytes"):
        total = sum(r["trained"][field] - r["change_to"][field] for r in records) + \
            sum(j["trained"][field] for j in joiners)
        cost[field + "_per_node_per_event"] = total / events / plan.nodes
        cost[field + "_per_node_at_finish"] = mean(r["end"][field] - r["trained"][field] for r in final)
    spreads = view_spreads(views)
    units = plan.nodes + math.fsum(j["minted"] for j in joiners) - math.fsum(r["retired"] for r in records + joiners)
    sum_w = math.fsum(r["final_w"] for r in final)
    in_flight = math.fsum(r["in_flight"] for r in records + joiners)
    return {"events": events, "joined": len(joiners), "left": sum(r["left"] for r in records + joiners),
            "seconds": ended - began, "rate_per_minute": events / plan.nodes / ((ended - began) / 60), **cost,
            "views": len(spreads), "agreement_seconds_max": max((s for s, _ in spreads), default=None),
            "agreement_steps_max": max((k for _, k in spreads), default=None),
            "join_seconds_max": max((j["join_seconds"] for j in joiners), default=None),
            "final_members": len(final), "units": units, "sum_w": sum_w, "in_flight_w": in_flight,
            "sum_w_error": abs(sum_w - units)}


def view_spreads(views: dict) -> list[tuple[float, int]]:
    """For each view any node came to hold after its first: the seconds from the first node holding
    it or a later one (its proposer) until the last one did, and that last node's step then less
    the first one's, over the nodes watched since before it came (a joiner that starts later takes
    the latest view at once) that came to hold it."""
    seen = {rank: [(tuple(order), when, step) for order, when, step in entries] for rank, entries in views.items()}
    orders = sorted({order for entries in seen.values() for order, _, _ in entries[1:]})
    spreads = []
    for order in orders:
        holders = [(next((when, step) for o, when, step in entries if o >= order), entries[0][1])
                   for entries in seen.values() if entries[-1][0] >= order]
        first = min(held for held, _ in holders)
        last = max(held for held, since in holders if since <= first[0])
        spreads.append((last[0] - first[0], last[1] - first[1]))
    return spreads


def consensus(plan: Plan, records: list[dict]) -> dict:
    """Consensus distance after each recorded step, measured and in theory, and Σ w after the last."""
    start = torch.stack([initial_vector(r["rank"], plan.dim) for r in records])
    average = start.mean(dim=0)
    theory = push_sum_trace(build_topology("exponential", plan.nodes), start, plan.steps)
    measured = [torch.tensor([r["z"][k] for r in records], dtype=torch.float64) for k in range(plan.steps)]
    sum_w = math.fsum(r["w"][-1] for r in records)
    distance = [consensus_distance(z, average) for z in [start, *measured]]
    expected = [consensus_distance(z, average) for z in [start, *theory]]
    return {"distance": distance, "theory": expected, "mixing_steps": mixing_steps(distance),
            "theory_mixing_steps": mixing_steps(expected),
            "max_error_vs_theory": max(float((z - t).abs().max()) for z, t in zip(measured, theory)),
            "sum_w": sum_w, "sum_w_error": abs(sum_w - plan.nodes)}


def mixing_steps(distance: list[float], factor: float = MIXED) -> int | None:
    """The first step after which the distance is below `factor` of the starting one (None: never)."""
    return next((k for k, d in enumerate(distance) if d <= factor * distance[0]), None)


def change(plan: Plan, records: list[dict]) -> dict | None:
    """What node `plan.leaver` leaving cost: control calls and bytes per node in the change window
    less those of the baseline window before it, and seconds from its proposal (it adopts its own
    view first) until every node held the view without it."""
    if plan.leaver is None:
        return None
    n = plan.nodes
    cost = {}
    for field in ("control_messages", "control_bytes"):
        during = sum(per_node(records, "change_to", "change_from", field))
        before = sum(per_node(records, "change_from", "steady_from", field))
        cost[field + "_per_node"] = (during - before) / n
        cost["baseline_" + field + "_per_node"] = before / n
    methods = methods_of(records, "change_to")
    cost["calls_per_node"] = {m: sum(calls(r, "change_to", m) - 2 * calls(r, "change_from", m) +
                                     calls(r, "steady_from", m) for r in records) / n for m in methods}
    adopted = [r["adopted"] for r in records if r.get("adopted") is not None]
    proposed = records[plan.leaver].get("adopted")
    stays = [r for r in records if not r["left"]]
    return {"kind": "leave", "node": plan.leaver, **cost, "adopted_by": len(adopted),
            "agreement_seconds": max(adopted) - proposed if proposed is not None and len(adopted) == n else None,
            "final_members": len(stays), "final_sum_w": math.fsum(r["final_w"] for r in stays)}


def fit_exponent(sizes: list[int], values: list[float]) -> float | None:
    """The slope of log(value) against log(n), least squares: value ~ n^slope."""
    points = [(math.log(n), math.log(v)) for n, v in zip(sizes, values) if v and v > 0]
    if len(points) < 2:
        return None
    mx, my = mean(x for x, _ in points), mean(y for _, y in points)
    return sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)


def plot(runs: list[dict], path: Path) -> None:
    """Log-log curves per node against n: calls per membership change, calls at start, channels."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [run["nodes"] for run in runs]
    fig, ax = plt.subplots(figsize=(6, 4))
    labels = {"change_calls": "control calls per change", "change_bytes": "control KB per change",
              "start_calls": "control calls at start", "channels": "open channels"}
    for name, (group, key) in FITTED:
        scale = 1e-3 if name.endswith("bytes") else 1.0
        ax.plot(sizes, [run[group][key] * scale for run in runs], marker="o", label=labels[name])
    ax.set(xscale="log", yscale="log", xlabel="nodes n", ylabel="per node",
           title=f"Membership cost (sgp, meeting {runs[0]['meet']})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_runs(runs: list[dict], stream=sys.stdout) -> None:
    headers = ["n", "procs", "threads/proc", "start s", "start calls/node", "channels/node", "steady calls/node/step",
               "change calls/node",
               "change KB/node", "agree s", "mixed after", "theory", "|Σw-n|"]
    rows = []
    for run in runs:
        moved, dist = run["change"] or {}, run["consensus"]
        rows.append([run["nodes"], run["processes"], run["threads_per_process"], fmt(run["start_seconds"], "{:.1f}"),
                     fmt(run["startup"]["control_messages_per_node"], "{:.1f}"),
                     fmt(run["connections"]["channels_per_node"], "{:.1f}"),
                     fmt(run["steady"]["control_messages_per_node_step"], "{:.2f}"),
                     fmt(moved.get("control_messages_per_node"), "{:.1f}"),
                     fmt(moved.get("control_bytes_per_node", 0) / 1e3, "{:.1f}"),
                     fmt(moved.get("agreement_seconds"), "{:.2f}"), fmt(dist["mixing_steps"], "{} steps"),
                     fmt(dist["theory_mixing_steps"], "{} steps"), fmt(dist["sum_w_error"], "{:.1e}")])
    print_table(rows, headers, stream)
    churned = [run for run in runs if run.get("churn")]
    if churned:
        print_table([[run["nodes"], run["churn"]["events"], fmt(run["churn"]["seconds"], "{:.0f}"),
                      fmt(100 * run["churn"]["rate_per_minute"], "{:.2f}%"),
                      fmt(run["churn"]["control_messages_per_node_per_event"], "{:.2f}"),
                      fmt(run["churn"]["control_bytes_per_node_per_event"] / 1e3, "{:.2f}"),
                      fmt(run["churn"].get("control_messages_per_node_at_finish"), "{:.1f}"),
                      run["churn"]["views"], fmt(run["churn"]["agreement_seconds_max"], "{:.2f}"),
                      fmt(run["churn"]["agreement_steps_max"], "{}"), fmt(run["churn"]["join_seconds_max"], "{:.1f}"),
                      run["churn"]["final_members"], fmt(run["churn"]["sum_w_error"], "{:.1e}")] for run in churned],
                    ["n", "churn events", "seconds", "per minute", "calls/node/event", "KB/node/event",
                     "finish calls/node", "views",
                     "agree s (max)", "agree steps (max)", "join s (max)", "final members", "|Σw-units|"], stream)


def main(args) -> int:
    sizes = [int(n) for n in args.sweep.split(",")] if args.sweep else [args.nodes]
    if min(sizes) < 2 or args.steps < 1 or args.dim < 1 or args.window < 1 or args.processes < 1:
        print("p2ptrain simulate: --nodes/--sweep >= 2, --steps, --dim, --window, --processes >= 1", file=sys.stderr)
        return 2
    if args.churn < 0 or (args.churn and (args.churn_steps < args.churn or args.churn > min(sizes) - 2)):
        print("p2ptrain simulate: --churn EVENTS needs --churn-steps >= EVENTS and fewer events than nodes - 1",
              file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    try:
        with sigint_interrupts():  # (Ctrl-C, or SIGTERM, ends the run and its processes, also where SIGINT was ignored)
            for n in sizes:
                runs.append(simulate(n, args.processes, args.steps, args.dim, args.window, args.timeout, args.meet,
                                     args.churn, args.churn_steps, args.seed, not args.loop_per_node,
                                     args.grpc_calls))
                print(f"simulated {n} nodes", file=sys.stderr)
    except TimeoutError as exc:
        print(f"p2ptrain simulate: {exc} (--timeout {args.timeout:g})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("p2ptrain simulate: interrupted; every simulated node stopped", file=sys.stderr)
        return 130
    result: dict = {"runs": runs}
    print_runs(runs)
    if len(runs) > 1 and all(run["change"] for run in runs):
        result["fit"] = {name: fit_exponent(sizes, [run[group][key] for run in runs]) for name, (group, key) in FITTED}
        plot(runs, out / PLOT_NAME)
        print("per node ~ n^exponent: " + ", ".join(f"{name} {fmt(e, '{:.2f}')}" for name, e in result["fit"].items())
              + f"; plot: {out / PLOT_NAME}")
    (out / RESULT_NAME).write_text(json.dumps(result, indent=1))
    print(f"results: {out / RESULT_NAME}")
    return 0


__all__ = ["PLOT_NAME", "RESULT_NAME", "change", "consensus", "end_processes", "fit_exponent", "main", "plot",
           "mixing_steps", "simulate", "summarize"]
