"""`p2ptrain reproduce diloco`: issue 15's WAN comparison, and issue 26's on a language model.

8 node processes whose links are emulated at 100 Mbit/s with 50 ms latency. `--task synthetic`
(the fast variant): the MLP on the synthetic task, AllReduce every step against DiLoCo (H = 10, 50,
100, mixing at sync), Streaming DiLoCo, int8 / int4 / top-k pseudo-gradients and gossip-DiLoCo (also
with drops and a frozen node). `--task char-lm`: examples/char_lm.py's byte-level Transformer on
standard-library text, AllReduce against DiLoCo (H = 50, and H = 25 in fp32, int8, int4, FP4, top-k
1% by ring and all-gather, SparseLoCo, also with drops and a frozen node, DCT-top-k, SparseLoCo
with Muon inside) and gossip-DiLoCo with SparseLoCo shares. The table holds validation loss (and accuracy or
perplexity), MB sent per node and per sync, wall-clock seconds, bytes relative to AllReduce and the
seconds a variant took to reach AllReduce's final quality; OUT/diloco[-char-lm].png plots validation
loss against wall-clock time; the issues' targets are printed PASS/MISS with their numbers.
"""
from __future__ import annotations

import json
import math
import sys
import time
import types
from dataclasses import dataclass, field
from pathlib import Path

from p2ptrain.bench.clusters import VariantResult, fmt, print_table, run_variant, variant_dir

LINK = "bandwidth=100mbit,latency=50ms"
FRAGMENTS = 5
TOPK_FRACTION = 0.1
STALL = "3@60:8"
TASKS = ("synthetic", "char-lm")
LM_TOPK_FRACTION = 0.01   # top-k 1%, as the issue asks
LM_SPARSE_FRACTION = 0.02  # SparseLoCo's and DCT-top-k's density (2%, 2-bit values)
LM_STALL = "3@100:10"     # the frozen node of the language model's fault row: 10 s
LM_H = 25                 # the language model's compressed rows: 16 outer steps in 400
LM_SPARSE_OUTER_LR = 2.0  # the sparse codecs' outer lr on it (lm_variants says why)
LM_MODEL = ["--width", "64", "--context", "64", "--layers", "2", "--eval-every", "50", "--val-windows", "128"]
FAULTY = ("gossip-faults", "faults")  # the rows run with 20% drops and a frozen node


def variants(fragments: int, topk_fraction: float) -> dict[str, tuple[str, list[str]]]:
    """key -> (row name, node flags). AllReduce every step (gradients averaged before the inner
    optimizer, AdamW like DiLoCo's inner steps, so only the communication differs), DiLoCo with
    H ∈ {10, 50, 100}, DiLoCo H = 50 whose blocking syncs keep α = 0.5 of the local model
    (`--mixing-at-sync`: Streaming DiLoCo's merge at every sync), Streaming DiLoCo (F fragments,
    τ = 1, α = 0.5 as in the paper and α = 0), DiLoCo H = 50 with int8 / int4 / top-k
    pseudo-gradients, gossip-DiLoCo (two out-peers per outer step), and gossip-DiLoCo with 20% of
    messages dropped and one node frozen (`launch --stall`)."""
    diloco = ["--algorithm", "diloco"]
    h50 = [*diloco, "--inner-steps", "50"]
    # two out-peers per outer step (one: 0.84 accuracy here; three: 0.90); gossip keeps nodes in
    # lockstep only loosely, so its messages may meet a node several H behind: a wide step window
    gossip = ["--algorithm", "gossip-diloco", "--inner-steps", "50", "--peers-per-step", "2", "--step-window", "256"]
    streaming = [*h50, "--fragments", str(fragments), "--outer-delay", "1"]
    return {
        "allreduce": ("allreduce every step", ["--algorithm", "allreduce", "--average", "gradients",
                                                "--optimizer", "adamw"]),
        "diloco-h10": ("diloco H=10", [*diloco, "--inner-steps", "10"]),
        "diloco-h50": ("diloco H=50", h50),
        # (a node may be H steps behind when a sync's messages reach it: its step window must take them)
        "diloco-h100": ("diloco H=100", [*diloco, "--inner-steps", "100", "--step-window", "128"]),
        "diloco-h50-mix": ("diloco H=50 mixing at sync a=0.5", [*h50, "--mixing-at-sync", "--mixing", "0.5"]),
        "streaming": (f"streaming H=50 F={fragments} tau=1 a=0.5", [*streaming, "--mixing", "0.5"]),
        "streaming-a0": (f"streaming H=50 F={fragments} tau=1 a=0", [*streaming, "--mixing", "0"]),
        "int8": ("diloco H=50 int8", [*h50, "--compression", "int8"]),
        "int4": ("diloco H=50 int4", [*h50, "--compression", "int4"]),
        # (the ring re-sparsifies partial sums hop by hop: the row measured before the all-gather came)
        "topk": (f"diloco H=50 topk {topk_fraction:g} ring", [*h50, "--compression", "topk", "--topk-fraction",
                                                               str(topk_fraction), "--sparse-exchange", "ring"]),
        "gossip": ("gossip-diloco H=50 2 peers", gossip),
        "gossip-faults": ("gossip-diloco H=50 2 peers drop=0.2 +stall", gossip),
    }


def lm_variants(topk_fraction: float, sparse_fraction: float) -> dict[str, tuple[str, list[str]]]:
    """key -> (row name, node flags) of `--task char-lm`: AllReduce every step (gradients averaged
    before the script's AdamW), DiLoCo H = 50 in fp32, and at H = LM_H (more outer steps in a short
    run, which the sparse codecs need) fp32, int8, int4 and FP4 pseudo-gradients, top-k with the old
    ring (each hop re-sparsifies partial sums) and with the all-gather (each node's own top-k,
    decoded and averaged locally), SparseLoCo (top-k of each 4096-entry chunk in 2 bits), DCT-top-k
    (DeMo), SparseLoCo with Muon as the inner optimizer (MuLoCo), gossip-DiLoCo with SparseLoCo on
    its shares' pseudo-gradient half (the anchor half in int8), and SparseLoCo with 20% of messages
    dropped and one node frozen. The sparse codecs run with their decaying error feedback instead
    of outer momentum (the default) and outer lr LM_SPARSE_OUTER_LR (their 2-bit levels shrink the
    mean step: 4 nodes, H = 10, SparseLoCo val loss 2.62 at lr 0.7, 2.45 at 2.0; fp32 DiLoCo 2.45)."""
    diloco = ["--algorithm", "diloco", "--inner-steps", str(LM_H)]
    sparse = ["--compression", "sparseloco", "--topk-fraction", str(sparse_fraction), "--value-bits", "2"]
    fast = ["--outer-lr", str(LM_SPARSE_OUTER_LR)]
    topk = [*diloco, *fast, "--compression", "topk", "--topk-fraction", str(topk_fraction)]
    gossip = ["--algorithm", "gossip-diloco", "--inner-steps", str(LM_H), "--peers-per-step", "2", "--step-window",
              "256", *sparse]
    h = f"H={LM_H}"
    return {
        "allreduce": ("allreduce every step", ["--algorithm", "allreduce", "--average", "gradients"]),
        "diloco-h50": ("diloco H=50 fp32", ["--algorithm", "diloco", "--inner-steps", "50"]),
        "diloco": (f"diloco {h} fp32", diloco),
        "int8": (f"diloco {h} int8", [*diloco, "--compression", "int8"]),
        "int4": (f"diloco {h} int4", [*diloco, "--compression", "int4"]),
        "fp4": (f"diloco {h} fp4 (E3M0)", [*diloco, "--compression", "fp4"]),
        "topk-ring": (f"diloco {h} topk {topk_fraction:g} ring", [*topk, "--sparse-exchange", "ring"]),
        "topk": (f"diloco {h} topk {topk_fraction:g} all-gather", [*topk, "--sparse-exchange", "allgather"]),
        "sparseloco": (f"diloco {h} sparseloco {sparse_fraction:g} 2-bit", [*diloco, *fast, *sparse]),
        "dct-topk": (f"diloco {h} dct-topk {sparse_fraction:g} 2-bit",
                     [*diloco, *fast, "--compression", "dct-topk", "--topk-fraction", str(sparse_fraction),
                      "--value-bits", "2"]),
        "muon-sparseloco": (f"diloco {h} muon inner, sparseloco 2-bit",
                            [*diloco, *fast, "--inner-optimizer", "muon", *sparse]),
        "gossip-sparseloco": (f"gossip-diloco {h} sparseloco {sparse_fraction:g} shares", gossip),
        "faults": (f"diloco {h} sparseloco {sparse_fraction:g} drop=0.2 +stall", [*diloco, *fast, *sparse]),
    }


@dataclass(frozen=True)
class Task:
    """What a `--task` runs: its variants, the node flags common to them, the script of your own
    each rank runs (none: `p2ptrain node`'s built-in training), the frozen node of its fault row."""

    name: str
    variants: dict[str, tuple[str, list[str]]]
    node_args: list[str]
    script: list[str]
    stall: str

    @property
    def language_model(self) -> bool:
        return bool(self.script)

    @property
    def plot_name(self) -> str:
        return "diloco.png" if self.name == "synthetic" else f"diloco-{self.name}.png"


def char_lm_script() -> Path:
    """examples/char_lm.py of this checkout (the examples are not part of the installed package)."""
    return Path(__file__).resolve().parents[2] / "examples" / "char_lm.py"


def make_task(args) -> Task:
    common = ["--seed", str(args.seed), "--log-every", str(args.log_every), "--link-deadline", str(args.link_deadline),
              "--threads", "1", *args.extra.split()]
    if args.task == "synthetic":
        return Task("synthetic", variants(args.fragments, args.topk_fraction),
                    ["--dataset", "synthetic", "--model", "mlp", "--num-train", str(args.num_train), *common], [],
                    args.stall or STALL)
    script = Path(args.script) if args.script else char_lm_script()
    if not script.is_file():
        raise SystemExit(f"p2ptrain reproduce diloco: {script} not found; run from a p2ptrain checkout or give "
                         "--script PATH/char_lm.py")
    return Task(args.task, lm_variants(args.topk_fraction if args.topk_fraction != TOPK_FRACTION else LM_TOPK_FRACTION,
                                       LM_SPARSE_FRACTION),
                ["--batch-size", str(args.batch_size), *common],
                [sys.executable, str(script), *LM_MODEL, *args.script_args.split()], args.stall or LM_STALL)


def add_arguments(parser) -> None:
    keys = ",".join(variants(FRAGMENTS, TOPK_FRACTION))
    lm_keys = ",".join(lm_variants(LM_TOPK_FRACTION, LM_SPARSE_FRACTION))
    parser.add_argument("--task", choices=TASKS, default="synthetic",
                        help="synthetic: the MLP on the synthetic task (the fast variant); char-lm: "
                             "examples/char_lm.py's byte-level Transformer on standard-library text (default "
                             "synthetic)")
    parser.add_argument("--nodes", type=int, default=8, help="cluster size (default 8)")
    parser.add_argument("--steps", type=int, default=300, help="training steps per run (default 300)")
    parser.add_argument("--diloco-steps", type=int, default=None,
                        help="steps of every run but AllReduce's (default --steps): DiLoCo's steps are cheaper, so "
                             "time to AllReduce's final quality may need more of them")
    parser.add_argument("--variants", default=None,
                        help=f"comma-separated subset of {keys} (synthetic) or {lm_keys} (char-lm) (default all)")
    parser.add_argument("--link", default=LINK, help=f"emulated links of every node (default {LINK})")
    parser.add_argument("--link-deadline", type=float, default=5.0,
                        help="the nodes' --link-deadline: the outer sync's deadline (default 5 s)")
    parser.add_argument("--fragments", type=int, default=FRAGMENTS,
                        help=f"Streaming DiLoCo's F (default {FRAGMENTS}; must divide 50)")
    parser.add_argument("--topk-fraction", type=float, default=TOPK_FRACTION,
                        help=f"kept fraction of the top-k runs (default {TOPK_FRACTION}; char-lm: {LM_TOPK_FRACTION})")
    parser.add_argument("--stall", default=None,
                        help=f"the frozen node of the fault row, RANK@STEP:SECONDS (default {STALL}; char-lm: "
                             f"{LM_STALL})")
    parser.add_argument("--batch-size", type=int, default=16, help="char-lm: sequences per node and step (default 16)")
    parser.add_argument("--script", default=None, help="char-lm: the script to run (default examples/char_lm.py "
                                                       "of this checkout)")
    parser.add_argument("--script-args", default="", help="char-lm: more arguments of the script, one string "
                                                          "(e.g. '--width 128')")
    parser.add_argument("--log-every", type=int, default=10, help="snapshot / progress interval (default 10)")
    parser.add_argument("--num-train", type=int, default=12000, help="training samples, all nodes (default 12000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of data, split and init (default 0)")
    parser.add_argument("--extra", default="", help="more node flags for every run, one string")
    parser.add_argument("--out", default="runs/reproduce-diloco", help="run folders and the plot "
                                                                      "(default runs/reproduce-diloco)")
    parser.add_argument("--keep-snapshots", action="store_true", help="keep the model snapshots after evaluating")
    parser.add_argument("--timeout", type=float, default=1200, help="per-run timeout in seconds (default 1200)")
    parser.add_argument("--json", action="store_true", help="also print the results as JSON")


@dataclass
class Row:
    key: str
    name: str
    run: VariantResult
    val_loss: float = math.nan
    val_accuracy: float = math.nan
    worst_accuracy: float = math.nan
    worst_loss: float = math.nan
    mb_sent: float = math.nan
    syncs: int = 0
    curve: list[tuple[float, float, float]] = field(default_factory=list)  # (seconds since launch, loss, accuracy)

    @property
    def mb_per_sync(self) -> float:
        return self.mb_sent / self.syncs if self.syncs else math.nan

    @property
    def perplexity(self) -> float:
        return math.exp(self.val_loss) if math.isfinite(self.val_loss) else math.nan

    def seconds_to(self, accuracy: float) -> float:
        """Seconds since launch until the nodes' mean validation accuracy first reached `accuracy`."""
        return next((t for t, _, a in self.curve if a >= accuracy), math.nan)

    def seconds_to_loss(self, loss: float) -> float:
        """Seconds since launch until the nodes' mean validation loss first fell to `loss`."""
        return next((t for t, v, _ in self.curve if v <= loss), math.nan)

    def to_dict(self) -> dict:
        return {"key": self.key, "name": self.name, "val_loss": self.val_loss, "worst_val_loss": self.worst_loss,
                "perplexity": self.perplexity, "val_accuracy": self.val_accuracy, "worst_accuracy": self.worst_accuracy,
                "mb_sent_per_node": self.mb_sent, "syncs": self.syncs,
                "mb_per_sync": self.mb_per_sync, "wall_seconds": self.run.wall_seconds, "error": self.run.error,
                "curve": self.curve}


def main(args) -> int:
    task = make_task(args)
    table = task.variants
    keys = [k.strip() for k in (args.variants or ",".join(table)).split(",") if k.strip()]
    unknown = [k for k in keys if k not in table]
    if unknown or not keys or args.nodes < 2 or args.steps < 1 or (args.diloco_steps or 1) < 1 or 50 % args.fragments:
        print(f"p2ptrain reproduce diloco: choose --task {task.name} variants from {', '.join(table)}, --nodes >= 2, "
              "--steps >= 1 and --fragments dividing 50", file=sys.stderr)
        return 2
    out = Path(args.out)
    evaluator = None if task.language_model else _Evaluator(args)
    rows: dict[str, Row] = {}
    for key in keys:
        name, flags = table[key]
        link = args.link + (",drop=0.2" if key in FAULTY else "")
        stalls = [task.stall] if key in FAULTY and task.stall else []
        steps = args.steps if key == "allreduce" else args.diloco_steps or args.steps
        print(f"  running {name} ...", file=sys.stderr, flush=True)
        launched = time.time()
        run = run_variant(name, args.nodes, steps, [*flags, "--link", link, *task.node_args], out,
                          timeout=args.timeout, echo=lambda text: print(text, file=sys.stderr), stalls=stalls,
                          script=task.script)
        row = Row(key, name, run, syncs=_syncs(flags, steps, args.nodes))
        if not run.error:
            _measure(row, variant_dir(out, name), args.nodes, launched, evaluator, keep=args.keep_snapshots)
        rows[key] = row
        quality = f"val loss {fmt(row.val_loss, '{:.4f}')}" if task.language_model else \
            f"val acc {fmt(row.val_accuracy)}"
        print(f"    {name}: {quality}, {fmt(row.mb_sent, '{:.2f}')} MB/node, "
              f"{fmt(run.wall_seconds, '{:.0f}')} s{'  FAILED: ' + run.error if run.error else ''}",
              file=sys.stderr, flush=True)
    report(rows, sys.stdout, language_model=task.language_model)
    plot = _plot(rows, out / task.plot_name)
    if plot:
        print(f"\nplot: {plot}")
    if args.json:
        print(json.dumps([r.to_dict() for r in rows.values()], indent=2, default=str))
    return 0 if not any(r.run.error for r in rows.values()) else 1


def report(rows: dict[str, Row], stream, *, language_model: bool = False) -> None:
    """The table, then the targets. MB per sync is the bytes per node over the number of syncs of
    the schedule (_syncs): the peak, since every sync of a variant moves the same amount; wall-clock
    seconds count from launch. A language model's rows give perplexity and the seconds to
    AllReduce's final validation loss; the synthetic task's, accuracy and the seconds to its
    accuracy."""
    base = rows.get("allreduce")
    usable = base is not None and not base.run.error
    quality = ["val loss (worst)", "perplexity"] if language_model else ["val loss", "val acc (worst)"]
    reach_header = "s to AR loss" if language_model else "s to AR acc"
    headers = ["variant", *quality, "MB sent/node", "MB/sync", "wall s", "x fewer bytes", reach_header]
    table = []
    for row in rows.values():
        if row.run.error:
            table.append([row.name, "failed", *["-"] * (len(headers) - 2)])
            continue
        fewer = base.mb_sent / row.mb_sent if usable and row.mb_sent else math.nan
        if language_model:
            reach = row.seconds_to_loss(base.val_loss) if usable else math.nan
            shown = [f"{fmt(row.val_loss, '{:.4f}')} ({fmt(row.worst_loss, '{:.4f}')})", fmt(row.perplexity, "{:.3f}")]
        else:
            reach = row.seconds_to(base.val_accuracy) if usable else math.nan
            shown = [fmt(row.val_loss, "{:.4f}"), f"{fmt(row.val_accuracy)} ({fmt(row.worst_accuracy)})"]
        table.append([row.name, *shown, fmt(row.mb_sent, "{:.2f}"), fmt(row.mb_per_sync, "{:.3f}"),
                      fmt(row.run.wall_seconds, "{:.0f}"), fmt(fewer, "{:.1f}"), fmt(reach, "{:.0f}")])
    print_table(table, headers, stream)
    print(file=stream)
    for line in (lm_targets(rows) if language_model else targets(rows)):
        print(line, file=stream)


class Verdicts:
    """PASS/MISS lines about the rows that ran without error."""

    def __init__(self, rows: dict[str, Row]):
        self.rows = rows
        self.lines: list[str] = []

    def ok(self, key: str) -> Row | None:
        row = self.rows.get(key)
        return row if row is not None and not row.run.error else None

    def check(self, passed: bool, text: str) -> None:
        self.lines.append(f"{'PASS' if passed else 'MISS'}  {text}")


def targets(rows: dict[str, Row]) -> list[str]:
    """The issue's targets, each PASS/MISS with its numbers (only where both runs are here)."""
    verdicts = Verdicts(rows)
    ok, check, lines = verdicts.ok, verdicts.check, verdicts.lines

    base, h50 = ok("allreduce"), ok("diloco-h50")
    if base and h50:
        gap = 100 * (h50.val_accuracy - base.val_accuracy)
        loss = (h50.val_loss - base.val_loss) / base.val_loss
        fewer = base.mb_sent / h50.mb_sent
        check((gap >= -1 or loss <= 0.02) and fewer >= 40,
              f"diloco H=50 vs allreduce: accuracy {gap:+.1f} points, val loss {100 * loss:+.1f}%, {fewer:.0f}x fewer "
              "bytes (target: within 1 point or 2% of the loss, >= 40x fewer bytes)")
        reach, wall = h50.seconds_to(base.val_accuracy), base.run.wall_seconds
        check(reach <= 0.2 * wall, f"diloco H=50 reached allreduce's final accuracy {base.val_accuracy:.3f} after "
              f"{fmt(reach, '{:.0f}')} s = {fmt(reach / wall, '{:.2f}')}x allreduce's {wall:.0f} s (target <= 0.2x)")
    for key in ("streaming", "streaming-a0"):
        row = ok(key)
        if row and h50:
            share, gap = row.mb_per_sync / h50.mb_per_sync, 100 * (row.val_accuracy - h50.val_accuracy)
            fragments = round(h50.mb_per_sync / row.mb_per_sync) if row.mb_per_sync else 0
            check(share <= 1 / max(1, fragments) + 0.01 and abs(gap) <= 1,
                  f"{row.name}: {share:.3f}x DiLoCo's MB per sync, accuracy {gap:+.1f} points vs diloco H=50 "
                  "(target <= 1/F per sync, within 1 point)")
    for key in ("int8", "int4", "topk"):
        row = ok(key)
        if row and h50:
            fewer, gap = h50.mb_sent / row.mb_sent, 100 * (row.val_accuracy - h50.val_accuracy)
            target = key != "int8"
            check((fewer >= 4 or not target) and abs(gap) <= 1,
                  f"{row.name}: {fewer:.1f}x fewer bytes than fp32 diloco H=50, accuracy {gap:+.1f} points"
                  + (" (target >= 4x, within 1 point)" if target else " (within 1 point)"))
    clean, faulty = ok("gossip"), rows.get("gossip-faults")
    if faulty is not None:
        if faulty.run.error:
            check(False, f"{faulty.name}: did not finish ({faulty.run.error})")
        elif clean:
            gap = 100 * (faulty.val_accuracy - clean.val_accuracy)
            check(abs(gap) <= 2, f"{faulty.name}: finished, accuracy {gap:+.1f} points vs gossip-diloco without faults "
                                 "(target within 2 points)")
    return lines


def lm_targets(rows: dict[str, Row]) -> list[str]:
    """Issue 26's targets on the language model, each PASS/MISS with its numbers (only where the
    runs they compare are here). Relative losses are (variant - reference) / reference."""
    verdicts = Verdicts(rows)
    ok, check, lines = verdicts.ok, verdicts.check, verdicts.lines

    def gap(row: Row, reference: Row) -> float:
        return (row.val_loss - reference.val_loss) / reference.val_loss

    base, fp32 = ok("allreduce"), ok("diloco")
    others = [row for key, row in rows.items() if key != "allreduce" and ok(key)]
    if base and others:
        def fewer(row: Row) -> float:
            return base.mb_sent / row.mb_sent

        # the fewest bytes among those within 2%; else the closest loss among those with >= 400x fewer
        close = [r for r in others if gap(r, base) <= 0.02]
        lean = [r for r in others if fewer(r) >= 400] or others
        best = max(close, key=fewer) if close else min(lean, key=lambda r: gap(r, base))
        check(gap(best, base) <= 0.02 and fewer(best) >= 400,
              f"{best.name}: val loss {100 * gap(best, base):+.1f}% vs allreduce with {fewer(best):.0f}x fewer bytes "
              "per node (target: within 2% with >= 400x fewer)")
        wall = base.run.wall_seconds
        reached = [r for r in others if math.isfinite(r.seconds_to_loss(base.val_loss))]
        if reached:
            fastest = min(reached, key=lambda r: r.seconds_to_loss(base.val_loss))
            reach = fastest.seconds_to_loss(base.val_loss)
            check(reach <= 0.2 * wall, f"{fastest.name} reached allreduce's final val loss {base.val_loss:.4f} after "
                  f"{reach:.0f} s = {reach / wall:.2f}x allreduce's {wall:.0f} s (target <= 0.2x)")
        else:
            closest = min(others, key=lambda r: r.val_loss)
            check(False, f"no variant reached allreduce's final val loss {base.val_loss:.4f} (closest: {closest.name}, "
                  f"{closest.val_loss:.4f} after {closest.run.wall_seconds:.0f} s; allreduce took {wall:.0f} s; "
                  "target <= 0.2x)")
    for key, bound in (("sparseloco", 0.01), ("topk", 0.005)):
        row = ok(key)
        if row and fp32:
            check(gap(row, fp32) <= bound, f"{row.name}: val loss {100 * gap(row, fp32):+.2f}% vs diloco fp32, "
                  f"{fp32.mb_sent / row.mb_sent:.0f}x fewer bytes (target: within {100 * bound:g}%)")
    faulty = rows.get("faults")
    if faulty is not None:
        clean = ok("sparseloco")
        if faulty.run.error:
            check(False, f"{faulty.name}: did not finish ({faulty.run.error})")
        elif clean:
            check(gap(faulty, clean) <= 0.02, f"{faulty.name}: finished, val loss {100 * gap(faulty, clean):+.1f}% vs "
                                              "without faults (target within 2%)")
    return lines


# -- measuring a run ----------------------------------------------------------------------------------
def _syncs(flags: list[str], steps: int, nodes: int) -> int:
    """Syncs of the variant's schedule: one per step for allreduce, the outer steps otherwise."""
    def value(flag: str, default: int) -> int:
        return int(flags[flags.index(flag) + 1]) if flag in flags else default

    algorithm = flags[flags.index("--algorithm") + 1]
    if algorithm == "diloco":
        from p2ptrain.algorithms.diloco import DiLoCo

        algo = DiLoCo(types.SimpleNamespace(rank=0, world_size=nodes), inner_steps=value("--inner-steps", 50),
                      fragments=value("--fragments", 1), outer_delay=value("--outer-delay", 0),
                      mixing=float(flags[flags.index("--mixing") + 1]) if "--mixing" in flags else 0.5,
                      mixing_at_sync="--mixing-at-sync" in flags)
        return algo.fragment_syncs(steps)
    if algorithm == "gossip-diloco":
        h = value("--inner-steps", 50)
        return steps // h + bool(steps % h)
    return steps


class _Evaluator:
    """The validation set and model of the runs, to evaluate snapshots after a run."""

    def __init__(self, args):
        self.args = args
        self._ready = None

    def evaluate(self, params) -> tuple[float, float]:
        """(validation loss, accuracy) of the flat model `params`."""
        if self._ready is None:
            import torch

            from p2ptrain.settings import NodeConfig
            from p2ptrain.train.data import build_dataset
            from p2ptrain.train.setup import initial_model
            from p2ptrain.train.state import ModelState

            torch.set_num_threads(1)
            config = NodeConfig.from_sources(env={}, flags={"num_train": self.args.num_train, "seed": self.args.seed})
            model = initial_model(config)
            test = build_dataset("synthetic", None, seed=self.args.seed, num_train=self.args.num_train).test
            self._ready = (model, ModelState(model), torch.utils.data.DataLoader(test, batch_size=1000))
        import torch.nn.functional as F

        from p2ptrain.train.evaluate import evaluate

        model, state, loader = self._ready
        state.load(params)
        return evaluate(model, loader, loss_fn=F.nll_loss)  # (the node's loss: its models end in log_softmax)


def _measure(row: Row, folder: Path, nodes: int, launched: float, evaluator: _Evaluator | None, *,
             keep: bool) -> None:
    """The row's numbers from the run's files, and its curve of validation loss against wall-clock
    time (the plot): with an `evaluator`, every node's model snapshots are evaluated on the
    validation set at the time its progress file gives for that step; without (a script that
    reports its own val_loss, e.g. char_lm.py), the losses the nodes reported are taken as is."""
    summaries = [json.loads((folder / f"node{r}.json").read_text()) for r in range(nodes)
                 if (folder / f"node{r}.json").exists()]

    def values(key: str) -> list[float]:
        return [s[key] for s in summaries if isinstance(s.get(key), (int, float))]

    accuracies = values("test_accuracy")
    losses = values("test_loss") if evaluator is not None else values("val_loss")
    row.val_accuracy = sum(accuracies) / len(accuracies) if accuracies else math.nan
    row.worst_accuracy = min(accuracies, default=math.nan)
    row.val_loss = sum(losses) / len(losses) if losses else math.nan
    row.worst_loss = max(losses, default=math.nan)
    row.mb_sent = sum(s["bytes_sent"] for s in summaries) / len(summaries) / 1e6 if summaries else math.nan
    points: dict[int, list[tuple[float, float, float]]] = {}
    for rank in range(nodes):
        snapshots, progress = folder / f"node{rank}.snapshots.pt", folder / f"node{rank}.progress.jsonl"
        if progress.exists():
            for step, point in _progress_points(progress, launched, snapshots if evaluator else None, evaluator):
                points.setdefault(step, []).append(point)
        if snapshots.exists() and not keep:
            snapshots.unlink()
    row.curve = [tuple(sum(p[i] for p in pts) / len(pts) for i in range(3)) for _, pts in sorted(points.items())]


def _progress_points(progress: Path, launched: float, snapshots: Path | None, evaluator: _Evaluator | None):
    """(step, (seconds since launch, validation loss, accuracy)) of one node: its snapshots
    evaluated, or the val_loss lines it reported (accuracy NaN)."""
    times, reported = {}, []
    for line in progress.read_text().splitlines():
        record = json.loads(line)
        if "step" in record and "time" in record:
            times[record["step"]] = record["time"] - launched
            if "val_loss" in record:
                reported.append((record["step"], (times[record["step"]], record["val_loss"], math.nan)))
    if evaluator is None:
        return reported
    if snapshots is None or not snapshots.exists():
        return []
    import torch

    saved = torch.load(snapshots)
    return [(step, (times[step], *evaluator.evaluate(params))) for step, params in zip(saved["steps"], saved["params"])
            if step in times]


def _plot(rows: dict[str, Row], path: Path) -> Path | None:
    """Validation loss (and accuracy, where there is one) against wall-clock time, one line per row."""
    curves = {r.name: r.curve for r in rows.values() if r.curve}
    if not curves:
        return None
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    accuracy = any(math.isfinite(p[2]) for curve in curves.values() for p in curve)
    fig, axes = plt.subplots(1, 2 if accuracy else 1, figsize=(13 if accuracy else 8, 5), squeeze=False)
    loss_ax, acc_ax = axes[0][0], axes[0][1] if accuracy else None
    colors = plt.cm.tab20.colors  # (the default cycle repeats after 10 variants)
    for (name, curve), color in zip(curves.items(), colors[::2] + colors[1::2]):
        seconds = [p[0] for p in curve]
        loss_ax.plot(seconds, [p[1] for p in curve], label=name, marker=".", color=color)
        if acc_ax is not None:
            acc_ax.plot(seconds, [p[2] for p in curve], label=name, marker=".", color=color)
    loss_ax.set(xlabel="wall-clock seconds since launch", ylabel="validation loss (mean over nodes)", yscale="log",
                title="validation loss against wall-clock time")
    if acc_ax is not None:
        acc_ax.set(xlabel="wall-clock seconds since launch", ylabel="validation accuracy (mean over nodes)",
                   title="validation accuracy against wall-clock time")
    (acc_ax or loss_ax).legend(fontsize=7)
    for ax in axes[0]:
        ax.grid(alpha=0.3)
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
