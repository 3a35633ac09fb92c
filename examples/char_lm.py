"""A byte-level Transformer language model on Python's own standard library, trained with p2ptrain.

The text is the source of a fixed list of standard-library modules (about 1 MB of real Python written
by many people over thirty years): it ships with every Python, so nothing is downloaded. The last 10%
of it is held out; each node trains on its own contiguous slice of the rest. The loop is the usual
one for a small GPT: AdamW, a linear warm-up then cosine decay (LambdaLR), gradient clipping. Every
node reports its validation loss (nats per byte) and perplexity at the end and every --eval-every steps.

    p2ptrain launch --nodes 4 --algorithm sgp --overlap 1 --steps 400 --batch-size 16 -- python examples/char_lm.py
    p2ptrain launch --nodes 4 --algorithm allreduce --steps 400 --batch-size 16 -- python examples/char_lm.py

and the same model trained in one process with the same total batch (4 x 16), for comparison:

    python examples/char_lm.py --single --nodes 4 --steps 400 --batch-size 16

Settings (--steps, --batch-size, --lr, --seed, --inner-optimizer muon) come from the launcher; the
model's own options are this script's arguments (`-- python examples/char_lm.py --width 128`). The
three p2ptrain lines are marked.
"""
from __future__ import annotations

import argparse
import math
import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

# Modules present in every CPython 3.x, old enough to be stable: a fixed corpus on any install.
CORPUS_MODULES = ("argparse", "ast", "calendar", "collections/__init__", "configparser", "csv", "dataclasses",
                  "datetime", "difflib", "email/message", "fractions", "functools", "heapq", "inspect",
                  "ipaddress", "json/decoder", "json/encoder", "logging/__init__", "pathlib", "pickle",
                  "pprint", "random", "shutil", "statistics", "string", "subprocess", "tarfile",
                  "textwrap", "threading", "typing", "zipfile")


def corpus() -> torch.Tensor:
    """The bytes of CORPUS_MODULES (the ones this Python has), one uint8 tensor."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for name in CORPUS_MODULES:
        path = stdlib / f"{name}.py"
        if not path.is_file():  # (a package turned into a folder in some version: take what is there)
            path = stdlib / name / "__init__.py"
        if path.is_file():
            texts.append(path.read_bytes())
    if not texts:
        raise SystemExit(f"char_lm: no standard-library sources under {stdlib} (a Python without its .py files?)")
    return torch.frombuffer(bytearray(b"\n".join(texts)), dtype=torch.uint8).long()


class CharTransformer(nn.Module):
    """A small causal Transformer over bytes (vocabulary 256), pre-norm, learned positions."""

    def __init__(self, context: int, width: int, layers: int, heads: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.position = nn.Parameter(torch.zeros(context, width))
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 256)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        h = self.embed(tokens) + self.position[:t]
        h = self.blocks(h, mask=self.causal[:t, :t], is_causal=True)
        return self.head(self.norm(h))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1))


def windows(text: torch.Tensor, starts: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, next-byte targets) for the windows of `text` starting at `starts`."""
    idx = starts[:, None] + torch.arange(context + 1)
    chunk = text[idx]
    return chunk[:, :-1], chunk[:, 1:]


def warmup_cosine(warmup: int, total: int, floor: float = 0.1):
    """LambdaLR factor: linear warm-up to 1 over `warmup` steps, then cosine decay to `floor`."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def validation_loss(model: nn.Module, val_inputs: torch.Tensor, val_targets: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        loss = sum(lm_loss(model(x), y).item() for x, y in zip(val_inputs.split(64), val_targets.split(64)))
    model.train()
    return loss / math.ceil(len(val_inputs) / 64)


def inner_optimizer(model: nn.Module, lr: float, name: str | None) -> torch.optim.Optimizer:
    """AdamW (weight decay on matrices only), or with `name` "muon" Muon on the hidden matrices and
    AdamW on embeddings, positions, head, biases and norms (launch's --inner-optimizer muon)."""
    if name == "muon":
        from p2ptrain.train.muon import MuonWithAdamW

        return MuonWithAdamW(model, lr=lr, weight_decay=0.1, betas=(0.9, 0.95), exclude=["position"])
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and n != "position"]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 or n == "position"]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95))


def train(args: argparse.Namespace, steps: int, batch_size: int, lr: float, seed: int, *, rank: int = 0,
          world_size: int = 1, node=None) -> float:
    """Train for `steps` steps on this rank's slice; return the final validation loss. With `node`,
    the optimizer is p2ptrain's; without, this is plain single-process torch."""
    import p2ptrain

    text = corpus()
    cut = int(0.9 * len(text))
    train_text, val_text = text[:cut], text[cut:]
    lo, hi = rank * len(train_text) // world_size, (rank + 1) * len(train_text) // world_size
    shard = train_text[lo:hi]
    val_starts = torch.linspace(0, len(val_text) - args.context - 2, args.val_windows).long()
    val_inputs, val_targets = windows(val_text, val_starts, args.context)

    torch.manual_seed(seed)  # the same initial model on every node
    model = CharTransformer(args.context, args.width, args.layers, args.heads)
    inner = inner_optimizer(model, lr, node.config.optimizer if node is not None else args.optimizer)
    opt = inner if node is None else p2ptrain.DecentralizedOptimizer(inner, model=model, node=node)  # p2ptrain 2/3
    start = opt.local_step if node is not None else 0  # a node restarted by the launcher rejoins at a peer's step
    factor = warmup_cosine(max(1, steps // 10), steps)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda done: factor(start + done))
    sampler = torch.Generator().manual_seed(seed + 1000 + rank + 7919 * start)
    val_loss = float("nan")
    for step in range(start + 1, steps + 1):
        x, y = windows(shard, torch.randint(0, len(shard) - args.context - 1, (batch_size,), generator=sampler),
                       args.context)
        loss = lm_loss(model(x), y)
        loss.backward()
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        schedule.step()
        opt.zero_grad(set_to_none=True)
        scalars = {"loss": loss.item()}
        if step % args.eval_every == 0 or step == steps:
            if node is not None and step == steps:
                opt.finish()  # the last mixing lands before the model is judged
            val_loss = validation_loss(model, val_inputs, val_targets)
            scalars.update(val_loss=val_loss, perplexity=math.exp(val_loss))
        if node is not None:
            node.report(step, **scalars)                                                       # p2ptrain 3/3
        elif "val_loss" in scalars:
            print(f"step {step}: loss {loss.item():.4f} validation loss {val_loss:.4f} "
                  f"perplexity {math.exp(val_loss):.3f}", flush=True)
    return val_loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=64, help="bytes of context (default 64)")
    parser.add_argument("--width", type=int, default=64, help="model width (default 64)")
    parser.add_argument("--layers", type=int, default=2, help="Transformer blocks (default 2)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    parser.add_argument("--clip", type=float, default=1.0, help="gradient-norm clipping (default 1; 0: none)")
    parser.add_argument("--eval-every", type=int, default=100, help="validation every this many steps")
    parser.add_argument("--val-windows", type=int, default=256, help="held-out windows scored (default 256)")
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate (default 3e-3; launch's --lr wins)")
    parser.add_argument("--optimizer", choices=("adamw", "muon"), default=None,
                        help="--single's optimizer (default adamw; under launch, its --inner-optimizer)")
    single = parser.add_argument_group("one process, no p2ptrain (the comparison run)")
    single.add_argument("--single", action="store_true", help="train alone with --nodes x --batch-size per step")
    single.add_argument("--nodes", type=int, default=4)
    single.add_argument("--steps", type=int, default=300)
    single.add_argument("--batch-size", type=int, default=32, help="per node (default 32, as launch's)")
    single.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.single:
        val_loss = train(args, args.steps, args.nodes * args.batch_size, args.lr or 3e-3, args.seed)
        print(f"single process, batch {args.nodes * args.batch_size}: validation loss {val_loss:.4f} "
              f"perplexity {math.exp(val_loss):.3f}")
        return
    import p2ptrain

    with p2ptrain.init() as node:                                                              # p2ptrain 1/3
        s = node.config
        val_loss = train(args, s.steps, s.batch_size, s.lr or args.lr or 3e-3, s.seed, rank=node.rank,
                         world_size=node.world_size, node=node)
        print(f"node {node.rank}: validation loss {val_loss:.4f} perplexity {math.exp(val_loss):.3f}")


if __name__ == "__main__":
    main()
