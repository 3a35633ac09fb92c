"""RelaySGD (seed 003 Alg. 2; Vogels et al. 2021) on a chain, a binary tree or double binary trees.

Per node i, step t and tree, in the seed's notation (m^{(-1)} = 0, c^{(-1)} = 0):
    x_i^{(t+1/2)} = x_i^{(t)} - γ ∇f_i(x_i^{(t)})              (engine: local optimizer step)
    for each neighbour j:  send m_{i→j}^{(t)} = x_i^{(t+1/2)} + Σ_{k∈N_i\\j} m_{k→i}^{(t-1)}
                                c_{i→j}^{(t)} = 1 + Σ_{k∈N_i\\j} c_{k→i}^{(t-1)}
                           receive m_{j→i}^{(t)}, c_{j→i}^{(t)}
    n̄_i^{(t+1)} = 1 + Σ_j c_{j→i}^{(t)},   x_i^{(t+1)} = (x_i^{(t+1/2)} + Σ_j m_{j→i}^{(t)}) / n̄_i^{(t+1)}
("counters"; "world-size" divides by n and fills in the models not received: see RelaySGD).
Invariant: n̄_i counts exactly the models the sum holds (a lost message is dropped with its count),
so once t ≥ node i's eccentricity every node averages all n models uniformly, with no gossip matrix.
Never: a relayed model scaled by a weight, or a count kept for a model that was not summed.
"""
from __future__ import annotations

import concurrent.futures
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from p2ptrain.algorithms.base import Algorithm, Comm, Kind, Received, send_failure
from p2ptrain.algorithms.registry import AlgorithmOptions, AlgorithmSpec, BuildContext, option, register
from p2ptrain.topology.trees import Tree, build_relay_trees, coordinate_slices

if TYPE_CHECKING:
    import torch

KIND = Kind.RELAY
NORMALIZATIONS = ("counters", "world-size")  # divide by n̄ (seed 003 Alg. 2) / by n, missing models filled
SEND_WINDOW = 2  # relay messages in flight to one neighbour per tree, at most
log = logging.getLogger(__name__)


class RelaySum:
    """The relay mechanism of one node on one tree: messages m_{k→i} and counters c_{k→i}.

    Relaying without weights delivers node j's model to node i unscaled, τ_ij steps late, so every
    node averages all n models uniformly (once t ≥ its eccentricity, n̄_i = n): no gossip matrix,
    hence no dependence on data heterogeneity. Because the averaged model is what is relayed next,
    x itself converges to consensus rather than hitting the exact average in finite time; the relay
    mechanism (RelaySum) alone is exact for fixed inputs after `diameter` steps.

    `post(t, x)` sends m_{i→j}^{(t)} built from `x` and the step t-1 messages kept from the last
    `collect`; `collect(t)` receives step t's and keeps them; `average(x)` is
    (x + Σ_j m_{j→i}) / n̄_i. A message that is refused, lost or late is dropped together with its
    count (m = 0, c = 0 for that step), so n̄_i still counts exactly the models summed.
    """

    def __init__(self, comm, tree: Tree, channel: str):
        if tree.world_size != comm.world_size:
            raise ValueError(f"tree over {tree.world_size} nodes, cluster has {comm.world_size}")
        self.comm = comm
        self.rank = comm.rank
        self.tree = tree
        self.channel = channel
        self.neighbors = tree.neighbors(self.rank)
        self.messages: dict[int, torch.Tensor] = {}  # m_{j→i} of the last collected step
        self.counts: dict[int, float] = {j: 0.0 for j in self.neighbors}  # c_{j→i}
        self._sends: list[tuple[concurrent.futures.Future, int, int]] = []  # (ack, peer, step)

    def expect(self, like: torch.Tensor) -> None:
        """Declare this channel's message size; call before comm.ready()."""
        self.comm.expect(KIND, like.dtype, like.numel(), channel=self.channel,
                         preallocate=max(1, len(self.neighbors)))
        self.messages = {j: like.new_zeros(like.shape) for j in self.neighbors}  # m^{(-1)} = 0

    def post(self, step: int, x: torch.Tensor) -> None:
        self._check_acks(wait=False)
        for j in self.neighbors:
            m = x.clone()  # fresh per peer: ownership passes to the transport
            c = 1.0
            for k in self.neighbors:
                if k != j:
                    m.add_(self.messages[k])
                    c += self.counts[k]
            if not self.comm.membership.live([j]) or not self.comm.make_room(j, SEND_WINDOW):
                continue  # a dead or stalled neighbour: its subtree drops out of our averages until it is back
            future = self.comm.send(j, m, kind=KIND, step=step, relay_count=c, channel=self.channel)
            self._sends.append((future, j, step))

    def collect(self, step: int) -> None:
        """m_{j→i}, c_{j→i} of this step; a message lost or late (link deadline) is dropped together
        with its count (m = 0, c = 0 for this step), so n̄ still counts exactly the models summed."""
        received = self.comm.gather(KIND, step, self.neighbors, channel=self.channel)
        for j in self.neighbors:
            message = received.get(j)
            if message is None:
                self.messages[j].zero_()
                self.counts[j] = 0.0
                continue
            self.messages[j].copy_(message.tensor)  # out of the pooled buffer, then give it back
            self.counts[j] = message.relay_count
            message.release()
        for stale in self.comm.take(KIND, step, channel=self.channel):  # late: superseded already
            stale.release()

    def average(self, x: torch.Tensor, out: torch.Tensor | None = None, *,
                fill: torch.Tensor | None = None) -> torch.Tensor:
        """(x + Σ_j m_{j→i}) / n̄_i (counters); with `fill`, (x + Σ_j m_{j→i} + (n - n̄_i) fill) / n
        (world-size: the models not received count as `fill`). Written into `out` when given."""
        total = x.clone() if out is None else out.copy_(x)
        for m in self.messages.values():
            total.add_(m)
        if fill is None:
            return total.div_(self.n_bar)
        world_size = self.tree.world_size
        missing = world_size - self.n_bar
        if missing:
            total.add_(fill, alpha=missing)
        return total.div_(world_size)

    @property
    def n_bar(self) -> float:
        """n̄_i = 1 + Σ_j c_{j→i}: how many models the current average holds."""
        return 1.0 + sum(self.counts.values())

    def drain(self) -> None:
        """Wait until every sent message is acknowledged."""
        self._check_acks(wait=True)

    @property
    def unacknowledged(self) -> int:
        """Messages sent whose acknowledgement has not been looked at yet."""
        return len(self._sends)

    def _check_acks(self, wait: bool) -> None:
        if wait:  # a lost message is dropped with its count: give the last ones one link deadline
            concurrent.futures.wait([f for f, _, _ in self._sends], timeout=self.comm.link_deadline)
        pending = []
        for future, peer, step in self._sends:
            if not future.done():
                pending.append((future, peer, step))
                continue
            exc = send_failure(future)
            if exc is not None:  # lost or the peer is dead: the receiver drops message and count
                log.debug("node %d: relay message of step %d to %d (%s) not delivered: %s", self.rank, step,
                          peer, self.channel, exc)
            elif not future.result().delivered:
                outcome = future.result()
                log.warning("node %d: node %d refused the step-%d relay message (%s): %s: %s", self.rank, peer,
                            step, self.channel, outcome.reason, outcome.detail)
        self._sends = pending


@dataclass(frozen=True)
class RelaySGDOptions(AlgorithmOptions):
    """The trees (--topology) fix what is relayed where; the normalization, what a node divides
    the relayed sum by (see RelaySGD)."""

    relay_normalization: str = option(
        "counters", "counters: x = (x + Σ m) / n̄, n̄ = 1 + Σ c the models received (seed 003 Alg. 2); world-size: "
                    "x = (x + Σ m + (n - n̄) x_prev) / n, the models not received filled with the node's own model "
                    "of the step before (the RelaySGD reference code)", choices=NORMALIZATIONS)


class RelaySGD(Algorithm):
    """RelaySGD on one node: one RelaySum per tree. With several trees (double binary trees) each
    relays its own contiguous coordinate range on its own channel; counters travel in the header's
    relay_count.

    Normalization (`--relay-normalization`). The seed divides by n̄_i, the models the sum holds
    ("counters", the default). Until t reaches node i's eccentricity, and for a step whose relay
    message was lost, n̄_i < n and node i weights the models it has heard of by 1/n̄_i > 1/n: its
    own fresh update, and its near neighbours', count for more than the far ones'. "world-size" is
    the reference code's rule instead (epfml/relaysgd, normalization_mode "world_size" with the
    reference state updated every step): divide by n and fill the n - n̄_i models not received with
    the node's own model of the step before, x_i^{(t)},
        x_i^{(t+1)} = (x_i^{(t+1/2)} + Σ_j m_{j→i}^{(t)} + (n - n̄_i^{(t+1)}) x_i^{(t)}) / n.
    Every received x_k^{(s+1/2)} then counts 1/n at every node, so every node's local update enters
    every average with the same weight 1/n, and a lost message leaves the node's model where it was
    for that part rather than re-weighting what arrived. Filling with x_i^{(t)} rather than
    x_i^{(t+1/2)} keeps the node's own fresh update at 1/n too; at t = 0 it is x^{(0)}, the
    reference code's default fill, which is the same on every node (common initialization). Once
    n̄_i = n both rules are the same division. Neither keeps the nodes' mean model fixed on a pure
    averaging problem beyond the first step: a model reaches the other nodes with different delays
    (tests/test_relaysgd.py)."""

    name = "relaysgd"

    @classmethod
    def from_options(cls, comm: Comm, options: RelaySGDOptions, context: BuildContext) -> "RelaySGD":
        return cls(comm, context.topology, normalization=options.relay_normalization)

    def __init__(self, comm: Comm, trees: str | Sequence[Tree] = "double-binary-trees", *,
                 normalization: str = "counters"):
        """`trees`: a name from TREE_NAMES, or trees whose k-th relays the k-th of
        len(trees) contiguous coordinate ranges; `normalization`: one of NORMALIZATIONS."""
        if normalization not in NORMALIZATIONS:
            raise ValueError(f"unknown relay normalization {normalization!r}; choose from {', '.join(NORMALIZATIONS)}")
        if isinstance(trees, str):
            trees = build_relay_trees(trees, comm.world_size)
        if not trees:
            raise ValueError("RelaySGD needs at least one tree")
        self.comm = comm
        self.rank = comm.rank
        self.normalization = normalization
        self.relays = [RelaySum(comm, tree, f"tree{k}") for k, tree in enumerate(trees)]
        self.slices: list[slice] = []
        self.previous: torch.Tensor | None = None  # world-size: x_i^{(t)}, the fill of the missing models

    @property
    def fills_missing(self) -> bool:
        return self.normalization == "world-size"

    def setup(self, params: torch.Tensor) -> torch.Tensor:
        x = params.detach().reshape(-1)
        self.slices = coordinate_slices(x.numel(), len(self.relays))
        for relay, sl in zip(self.relays, self.slices):
            relay.expect(x[sl])
        if self.fills_missing:
            self.previous = x.clone()  # x^{(0)}
        self.comm.ready()
        return params

    def after_step(self, step: int, params: torch.Tensor) -> torch.Tensor:
        self.comm.set_step(step)
        x_half = params.detach().reshape(-1)  # x^{(t+1/2)}
        for relay, sl in zip(self.relays, self.slices):  # all trees' messages out before waiting
            relay.post(step, x_half[sl])
        x_next = x_half.new_empty(x_half.shape)
        previous = self.previous
        for relay, sl in zip(self.relays, self.slices):
            relay.collect(step)
            relay.average(x_half[sl], out=x_next[sl], fill=None if previous is None else previous[sl])
        if previous is not None:
            previous.copy_(x_next)  # our own copy: the caller may write into what we return
        return x_next.view_as(params)

    def adopt_state(self, state: Received, params: torch.Tensor) -> torch.Tensor:
        """The donor's model, as the default; it is also this node's model "of the step before"
        from now on (world-size fills with it, not with the stale one)."""
        adopted = super().adopt_state(state, params)
        if self.previous is not None:
            self.previous.copy_(adopted.reshape(-1))
        return adopted

    def state_dict(self) -> dict:
        """Every tree's last collected relay messages m_{j→i} and counters c_{j→i}; with world-size,
        the model the next step fills missing models with."""
        state = {"trees": [{"messages": {j: m.clone() for j, m in relay.messages.items()},
                            "counts": dict(relay.counts)} for relay in self.relays]}
        if self.previous is not None:
            state["previous"] = self.previous.clone()
        return state

    def load_state_dict(self, state: dict, step: int) -> None:
        for relay, saved in zip(self.relays, state["trees"]):
            for j, message in saved["messages"].items():
                relay.messages[int(j)].copy_(message)
            relay.counts.update({int(j): float(c) for j, c in saved["counts"].items()})
        if self.previous is not None and "previous" in state:  # a counters checkpoint has none: keep setup's
            self.previous.copy_(state["previous"])

    def finish(self) -> None:
        """Wait for every ack so nothing is left on the wire (the model needs no final mix)."""
        for relay in self.relays:
            relay.drain()
        return None

    def stats(self) -> dict[str, float]:
        return {"relay_n": sum(r.n_bar for r in self.relays) / len(self.relays)}


register(AlgorithmSpec(
    "relaysgd", "relay messages m_i→j and counters c_i→j on a tree; x = (x + Σ m) / (1 + Σ c) (seed 003 Alg. 2), "
                "or / n with the missing models filled in (--relay-normalization world-size)",
    RelaySGDOptions, RelaySGD.from_options, topologies=("double-binary-trees", "binary-tree", "chain")))
