"""DiLoCo (Douillard et al., 2023) and Streaming DiLoCo (Douillard et al., 2025, "Streaming DiLoCo
with overlapping communication") over the ring all-reduce (sparse codecs: the ring all-gather).

DiLoCo, per node i, every H steps (see outer.py for the notation):
    Δ_i = θ - θ_i;   Δ = (1/m) Σ_{i ∈ M} Δ_i  (ring all-reduce over the m members M);
    θ ← OuterNesterov(θ, Δ);   θ_i ← θ
Streaming DiLoCo syncs fragment p of F at steps t with (t + 1) mod H = (p + 1) H / F; an outer delay
τ ≥ 1 overlaps its all-reduce with the next τ inner steps and merges with the mixing factor α:
    θ_{i,p}^(t+τ) ← α θ_{i,p}^(t+τ) + (1 - α) θ_p^(t)      (θ_p^(t) = OuterNesterov(θ_p^(t-H), Δ_p))
Invariant: every member ends an outer step with the same bits, and finish() leaves every node with
the same model. It never opens a socket, and it never applies an outer step it has not summed over
every member of the ring it was given.
"""
from __future__ import annotations

import concurrent.futures
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from p2ptrain import compression
from p2ptrain.algorithms.allgather import RingAllGather
from p2ptrain.algorithms.base import Algorithm, Comm, Kind
from p2ptrain.algorithms.collectives import CollectiveIncomplete, RingAllReduce, segment_bounds
from p2ptrain.algorithms.outer import UNKNOWN, OuterNesterov, OuterOptions, OuterStateChannel
from p2ptrain.algorithms.registry import AlgorithmSpec, BuildContext, option, register
from p2ptrain.compression import NEEDS_ERROR_FEEDBACK

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
KIND = Kind.ALLREDUCE
SPARSE_EXCHANGES = ("allgather", "ring")  # --sparse-exchange: how codecs of NEEDS_ERROR_FEEDBACK travel


@dataclass(frozen=True)
class DiLoCoOptions(OuterOptions):
    fragments: int = option(1, "Streaming DiLoCo: the parameters are split into F fragments, one of which is "
                               "synced every H/F steps, in turn", metavar="F")
    outer_delay: int = option(0, "Streaming DiLoCo's overlap τ: a sync's all-reduce runs during the next τ inner "
                                 "steps and is merged after them (0: the sync blocks; at most H/F; H only with "
                                 "outer_momentum 0)", metavar="TAU")
    mixing: float = option(0.5, "Streaming DiLoCo's mixing factor α for overlapped syncs (blocking ones too with "
                                "--mixing-at-sync): θ_fragment <- α θ_local + (1-α) θ_outer (0: take the outer "
                                "parameters)", metavar="ALPHA")
    mixing_at_sync: bool = option(False, "blocking syncs (outer_delay 0) merge with --mixing α too, as every "
                                         "fragment update of the paper's Algorithm 1 does (without it they take "
                                         "the outer parameters)")
    sparse_exchange: str = option("allgather", "how the sparse codecs (topk, sparseloco, dct-topk) exchange "
                                               "pseudo-gradients: allgather = each node's own payload travels the "
                                               "ring untouched and every node adds all m in rank order (its error "
                                               "feedback keeps only its own loss); ring = the ring all-reduce, "
                                               "which decodes, sums and re-encodes at every hop; the other codecs "
                                               "always take the ring", choices=SPARSE_EXCHANGES)
    error_decay: float | None = option(None, "β of the error feedback e <- β e + Δ that a codec's losses go "
                                             "to (default 1: what a codec drops is only delayed; with the sparse "
                                             "codecs topk, sparseloco and dct-topk 0.95: SparseLoCo's and DeMo's "
                                             "accumulator, which replaces the outer momentum)", metavar="BETA")

    def default_momentum(self) -> float:
        # the sparse codecs' decaying error feedback is their momentum (SparseLoCo, DeMo); on top of it
        # Nesterov's hurt: char-lm, 4 nodes, H = 25, top-k 1%: val loss 3.61 with it, 2.69 without
        return 0.0 if self.compression in NEEDS_ERROR_FEEDBACK else 0.9

    @property
    def decay(self) -> float:
        """The error feedback's β in force: the option, or 0.95 with a sparse codec (SparseLoCo), else 1."""
        if self.error_decay is not None:
            return self.error_decay
        return 0.95 if self.compression in NEEDS_ERROR_FEEDBACK else 1.0

    def bounded_delay(self) -> int:
        """A node waits at every fragment's sync (or τ steps after it) for the others."""
        return self.inner_steps // max(1, self.fragments) + self.outer_delay

    def validate(self, settings) -> None:
        if self.fragments < 1 or self.inner_steps % self.fragments:
            raise ValueError(f"fragments F must be >= 1 and divide inner_steps H = {self.inner_steps}, "
                             f"got {self.fragments}")
        super().validate(settings)
        if not 0 <= self.outer_delay <= self.inner_steps // self.fragments:
            raise ValueError(f"outer_delay τ must be within [0, H/F = {self.inner_steps // self.fragments}], "
                             f"got {self.outer_delay}")
        if not 0 <= self.mixing < 1:
            raise ValueError(f"mixing α must be in [0, 1), got {self.mixing}")
        if not 0 < self.decay <= 1:
            raise ValueError(f"error_decay β must be in (0, 1], got {self.error_decay}")
        if self.outer_delay == self.inner_steps and self.momentum:
            # measured on the synthetic task: 0.34 accuracy with μ = 0.9, 0.90 with μ = 0 (blocking: 0.915)
            raise ValueError(f"outer_delay τ = H = {self.inner_steps} applies every outer gradient one outer step "
                             f"late, and outer momentum on it diverges: set outer_momentum 0 (got "
                             f"{self.momentum}) or τ < H")


@dataclass
class _Outcome:
    """What one fragment's sync brought: the fragment's outer state after it (this node's outer step,
    or a donor's offer), or nothing (the sync did not complete here)."""

    anchor: torch.Tensor | None = None
    momentum: torch.Tensor | None = None
    version: int = UNKNOWN
    donor: int | None = None  # set when the state is a donor's offer


class DiLoCo(Algorithm):
    """DiLoCo and Streaming DiLoCo on one node (the update rules are in the module docstring).

    Every member ends the outer step with the same bits: the all-gather forwards identical bytes
    (collectives.py), every member divides them by the same m and applies the same elementwise
    update to the same anchor and momentum.

    Streaming DiLoCo: the flat parameters are cut into F contiguous fragments (the paper cuts
    layers, strided; a flat vector has none), so one fragment moves every H / F steps. With an outer
    delay τ ≥ 1 a fragment's all-reduce runs on the engine's communication worker while the next τ
    inner steps compute (the outer gradient is τ steps old when it lands, as in Pipe-SGD), and the
    result is merged with the mixing factor α; α = 0 takes the outer parameters. A blocking sync
    (τ = 0) takes them too, unless mixing_at_sync makes it merge with α as Algorithm 1 does for
    every fragment update (docs/wan-diloco.md, "Mixing at blocking syncs", says why that is not the
    default). finish() always takes them, so every node ends with the same model. A fragment's sync
    moves 1/F of the model, so the peak bytes per sync are 1/F of DiLoCo's.

    Compressed pseudo-gradients: every ring hop decompresses, sums and recompresses
    (collectives.py); what this node's compressions lose stays on it (error feedback) and is added
    to its next pseudo-gradient of that fragment, so nothing a codec drops is lost, only delayed.
    Sparse codecs (NEEDS_ERROR_FEEDBACK) go by all-gather instead (allgather.py, unless
    sparse_exchange="ring"): the top k of a partial sum is not a sum of top-k's, so each node
    encodes its own Δ_p once, keeps only its own loss, and every node adds the m decoded payloads
    in rank order, which gives every member the same bits too."""

    name = "diloco"
    elastic = True  # each sync's ring forms over the live members of its step; newcomers take an offer

    @classmethod
    def from_options(cls, comm: Comm, options: DiLoCoOptions, context: BuildContext) -> "DiLoCo":
        return cls(comm, **options.outer_settings(), fragments=options.fragments, outer_delay=options.outer_delay,
                   mixing=options.mixing, mixing_at_sync=options.mixing_at_sync,
                   sparse_exchange=options.sparse_exchange, error_decay=options.decay)

    def __init__(self, comm: Comm, *, inner_steps: int, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 compression: str = "none", topk_fraction: float = 0.01, value_bits: int = 2, fragments: int = 1,
                 outer_delay: int = 0,
                 mixing: float = 0.5, mixing_at_sync: bool = False, sparse_exchange: str = "allgather",
                 error_decay: float = 1.0):
        DiLoCoOptions(inner_steps=inner_steps, outer_lr=outer_lr, outer_momentum=outer_momentum,
                      compression=compression, topk_fraction=topk_fraction, value_bits=value_bits, fragments=fragments,
                      outer_delay=outer_delay, mixing=mixing, mixing_at_sync=mixing_at_sync,
                      sparse_exchange=sparse_exchange, error_decay=error_decay).validate(None)
        self.comm = comm
        self.rank = comm.rank
        self.H, self.F, self.tau, self.alpha = inner_steps, fragments, outer_delay, mixing
        self.mixing_at_sync = mixing_at_sync
        self.period = inner_steps // fragments  # a fragment is synced every `period` steps, in turn
        self.outer = OuterNesterov(outer_lr, outer_momentum)
        self.codec_name, self.topk_fraction, self.value_bits = compression, topk_fraction, value_bits
        self.error_decay = error_decay
        # each node's own payload, all-gathered, where a codec's output cannot be summed hop by hop
        self.allgather = sparse_exchange == "allgather" and compression in NEEDS_ERROR_FEEDBACK
        self.anchor: torch.Tensor | None = None     # θ, the outer parameters
        self.momentum: torch.Tensor | None = None   # the outer optimizer's buffer
        self.residual: torch.Tensor | None = None   # error feedback: what this node's compressions lost
        self.versions: list[int] = []               # outer steps applied, per fragment
        self.bounds: list[tuple[int, int]] = []
        self.exchanges: list[RingAllReduce | RingAllGather] = []  # one per fragment
        self.states: list[OuterStateChannel] = []
        self.outer_steps = 0                        # outer updates applied here (all fragments)
        self.failed_syncs = 0
        self.caught_up = 0                          # offers adopted
        self._params: torch.Tensor | None = None
        self._in_flight: list[tuple[int, int, concurrent.futures.Future]] = []  # (merge step, fragment, outcome)
        self._last_step = -1

    # Hooks ------------------------------------------------------------------------------------------
    def setup(self, params: torch.Tensor) -> torch.Tensor:
        codec = compression.make_codec(self.codec_name, topk_fraction=self.topk_fraction, value_bits=self.value_bits)
        self.anchor = params.detach().clone()
        self.momentum = params.new_zeros(params.shape)
        self.residual = params.new_zeros(params.shape) if codec.wire_id != compression.UNCOMPRESSED else None
        self.bounds = segment_bounds(params.numel(), self.F)
        known = UNKNOWN if self.comm.joined is not None else 0  # a rejoined node loaded a donor's anchor
        self.versions = [known] * self.F
        for p, (start, end) in enumerate(self.bounds):
            if self.allgather:
                self.exchanges.append(RingAllGather(self.comm, end - start, params.dtype, codec=codec,
                                                    tag=f"diloco{p}.", kind=KIND, delay=self.tau))
            else:
                self.exchanges.append(RingAllReduce(self.comm, end - start, params.dtype, codec=codec,
                                                    tag=f"diloco{p}.", kind=KIND, elastic=True, delay=self.tau))
            self.states.append(OuterStateChannel(self.comm, end - start, params.dtype, tag=f"diloco{p}.", kind=KIND))
        self.comm.ready()
        self._params = params
        return params

    def after_step(self, step: int, params: torch.Tensor) -> torch.Tensor:
        """After an inner step: the outer gradient of the fragment due now is taken first, then the
        syncs whose τ steps are over land, then the new sync runs (τ = 0) or is launched.

        Taken first, the outer gradient measures the inner steps from the anchor they started from.
        The order matters only when τ = H (F = 1), where the sync landing now is the same
        fragment's: the whole outer step overlaps (Kale et al., 2025, "Eager updates ...":
        Streaming DiLoCo with 1-outer-step overlap, or DiLoCo with delayed outer gradients), and
        each outer gradient is applied, one outer step late, to the anchor that just landed. Merged
        first, it would be α times the progress (nothing at α = 0: only the momentum would move the
        anchor). At a fragment's first sync nothing lands: its replicas merge the anchor they have
        instead, as Kale et al.'s next inner phase starts from the global parameters (else its next
        outer gradient would carry this one again, in full). Outer momentum on these one-step-late
        outer gradients diverged on the synthetic task (0.34 accuracy with the default μ = 0.9;
        0.90 with μ = 0, blocking DiLoCo 0.915), so τ = H is refused unless outer_momentum is 0
        (DiLoCoOptions.validate)."""
        self.comm.set_step(step)
        self._last_step, self._params = step, params
        landed = []
        for entry in [e for e in self._in_flight if e[0] <= step]:  # syncs whose τ steps are over
            self._in_flight.remove(entry)
            landed.append((entry[1], entry[2].result()))  # (done: its thread also wrote that fragment's residual)
        p = self.due(step)
        delta = self._pseudo_gradient(p, params) if p is not None else None
        for q, outcome in landed:
            self._merge(q, outcome, params, mix=True)
        if p is not None and self.tau == self.H and all(q != p for q, _ in landed):
            # nothing landed to start the next outer step from (the first sync, or the first after a
            # catch-up): it starts from the anchor we have, or the outer gradient just sent would
            # count again, in full, in the next one
            self._take_anchor(p, params, mix=True)
        if p is not None:
            if not self.tau:
                self._merge(p, self._sync(p, delta, step), params, mix=self.mixing_at_sync)
            else:  # the communication worker reads the anchor, momentum and version the merges above left
                self._in_flight.append((step + self.tau, p, self.comm.background(self._sync, p, delta, step)))
        return params

    def finish(self) -> torch.Tensor | None:
        """Merge the syncs still in flight, then one last blocking outer step of every fragment that
        is mixed or trained since it took the outer one (_final_sync: the same decision on every
        node, it follows from the schedule), so all nodes end with the same model. A node that
        leaves takes none: the members it leaves behind do not sync at its last step."""
        params = self._params
        if params is None:
            return None
        landed = [(p, future.result()) for _, p, future in self._in_flight]
        self._in_flight.clear()
        last = self._last_step
        leaving = self.rank not in self.comm.membership.members(last + 1)  # the others go on without us
        final = [p for p in range(self.F) if self._final_sync(p, last) and not leaving]
        # with τ = H the sync in flight would have landed where its fragment's next outer gradient is
        # taken, and that is taken first (after_step): here too
        early = {p: self._pseudo_gradient(p, params) for p in final} if self.tau == self.H else {}
        for p, outcome in landed:
            self._merge(p, outcome, params, mix=True)
        for p in final:  # taking the outer parameters (never mixing): every node ends with the same model
            delta = early[p] if p in early else self._pseudo_gradient(p, params)
            self._merge(p, self._sync(p, delta, last + 1), params, mix=False)
        return params

    def donate_state(self, peer: int, step: int, params: torch.Tensor) -> None:
        """A (re)joining peer loads our anchor (its pseudo-gradients are measured from it); its next
        sync brings it our momentum and version. A node that rejoins (restart or catch-up, through
        the engine) thus holds a donor's anchor, not its local model, with version unknown, so its
        next sync brings it the outer state."""
        self.comm.send(peer, self.anchor.clone(), kind=Kind.STATE, step=step, ps_weight=1.0, reliable=True)
        return None

    def adopt_state(self, state, params: torch.Tensor) -> torch.Tensor:
        """Caught up after a stall: continue from the donor's anchor, outer state unknown until the
        next sync of each fragment brings it."""
        for _, _, future in self._in_flight:  # measured from the anchor we give up: void
            future.result()
        self._in_flight.clear()
        self.anchor.copy_(state.tensor.view_as(self.anchor))
        state.release()
        self.versions = [UNKNOWN] * self.F
        params.copy_(self.anchor)
        return params

    def shared_state(self, params: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """The anchor (the outer model): every member ends each outer step, and finish(), with the
        same bits."""
        return ("anchor", self.anchor) if self.anchor is not None else None

    def stats(self) -> dict[str, float]:
        return {"outer_steps": float(self.outer_steps), "failed_syncs": float(self.failed_syncs),
                "caught_up": float(self.caught_up)}

    # The schedule ---------------------------------------------------------------------------------
    def due(self, step: int) -> int | None:
        """The fragment synced after step `step`, if any: fragment p at (step + 1) mod H = (p + 1) H/F."""
        if (step + 1) % self.period:
            return None
        return ((step + 1) // self.period - 1) % self.F

    def fragment_syncs(self, steps: int) -> int:
        """How many fragment syncs a run of `steps` steps makes, finish()'s included."""
        return sum(self.due(step) is not None for step in range(steps)) + \
            sum(self._final_sync(p, steps - 1) for p in range(self.F))

    def _final_sync(self, p: int, last: int) -> bool:
        """Whether finish() syncs fragment p: always where its merges leave the local fragment mixed
        (α > 0, overlapped syncs or blocking ones with mixing_at_sync), as it then differs from node
        to node; otherwise if it trained since it last took the outer fragment. Else its outer
        gradient would be 0 and the outer step would move the anchor by its momentum alone."""
        offset = (p + 1) * self.period - 1
        launched = -1 if last < offset else offset + (last - offset) // self.H * self.H  # its last sync
        if self.alpha > 0 and (self.tau or self.mixing_at_sync):
            return True
        if launched < 0:
            return True
        # when it took the outer fragment: at a blocking sync, when an overlapped one lands (in
        # finish() if in flight), with τ = H when the sync before lands at the next launch
        took = launched + self.tau if self.tau < self.H else launched
        return took < last

    # One fragment's outer step ------------------------------------------------------------------
    def _pseudo_gradient(self, p: int, params: torch.Tensor) -> torch.Tensor:
        """Δ_p = θ_p - θ_{i,p}, plus what earlier compressions of this fragment lost, decayed by β
        (SparseLoCo's e <- β e + Δ; β = 1 by default, then nothing is lost)."""
        start, end = self.bounds[p]
        delta = self.anchor[start:end] - params[start:end]
        if self.residual is not None:
            delta.add_(self.residual[start:end], alpha=self.error_decay)
        return delta

    def _sync(self, p: int, delta: torch.Tensor, step: int) -> _Outcome:
        """Agree on who is current, all-reduce Δ_p over them and take the outer step, then hand the
        members behind their offers of the result. Runs on the communication worker when the sync
        overlaps inner steps: it reads fragment p's anchor, momentum and residual, which the
        training thread leaves alone until the merge, and writes only copies and the residual.

        Faults (the sync's deadline is the link deadline):
        - the ring is re-formed at every sync over this node and the live peers
          (comm.membership.live), in rank order, and the mean divides by the number of
          pseudo-gradients summed (m);
        - a sync opens with every member announcing the version of its fragment (outer steps
          applied). Only the members at the highest version form the ring; one behind (it missed an
          earlier sync, or took a donor's anchor) is left out of this mean and gets, from its donor
          (the next member at the top version in ring order), an offer of that fragment's anchor,
          momentum and version after this outer step: it keeps its own progress,
          θ_i ← θ_offer + (θ_i - θ_old), which it contributes at the next sync;
        - a live peer whose version misses the deadline is told so (it skips this sync rather than
          wait for a ring that runs without it); it keeps its anchor and progress and is behind at
          the next;
        - a sync that cannot complete (a member missed the deadline, or members disagree on who is
          in it) changes nothing on a node that did not complete it: it keeps its anchor and its
          progress, and the next sync's versions tell who is behind. Members that did complete it
          are ahead by one."""
        start, end = self.bounds[p]
        channel, version = self.states[p], self.versions[p]
        channel.discard_through(step - 1)
        others = self.comm.membership.live([r for r in self.comm.membership.members(step) if r != self.rank])
        channel.announce(others, step, version)
        versions = {self.rank: version, **channel.versions(step, others)}
        if channel.left_out(step):  # we came after the deadline: the others run without us
            self.failed_syncs += 1
            return _Outcome()
        channel.announce([r for r in others if r not in versions], step, version, left_out=True)
        top = max(versions.values())
        current = sorted(r for r, v in versions.items() if v == top)
        if version < top:  # left out of this mean: the donor's outer state after it comes instead
            donor = _donor(self.rank, current)
            offer = channel.wait_offer(donor, step, deadline=self.comm.link_deadline * 2 * len(current))
            if offer is None:
                log.warning("node %d: fragment %d is behind (version %d < %d) and node %d's offer missed the "
                            "deadline", self.rank, p, version, top, donor)
                self.failed_syncs += 1
                return _Outcome()
            return _Outcome(offer.anchor, offer.momentum, offer.version, donor=offer.sender)
        anchor, momentum = self.anchor[start:end], self.momentum[start:end]
        outcome = _Outcome()
        if version == UNKNOWN:  # nobody here holds the outer state: wait for a sync with someone who does
            self.failed_syncs += 1
        else:
            residual = self.residual[start:end] if self.residual is not None else None
            try:
                # (the ring's restore=False: Δ_p is ours alone and not used again if the sync fails;
                # the all-gather only reads it)
                keep = {} if self.allgather else {"restore": False}
                total = self.exchanges[p](delta, step, average=False, members=current, residual=residual, **keep)
                outcome = _Outcome(anchor.clone(), momentum.clone(), version + 1)
                self.outer.step(outcome.anchor, total.div_(len(current)), outcome.momentum)
            except CollectiveIncomplete as exc:
                log.warning("%s; fragment %d keeps its progress for the next outer step", exc, p)
                self.failed_syncs += 1
        for peer, theirs in versions.items():
            if theirs < top and _donor(peer, current) == self.rank:
                if outcome.anchor is not None:
                    channel.offer(peer, step, outcome.anchor, outcome.momentum, outcome.version)
                else:
                    channel.offer(peer, step, anchor, momentum, version)
        return outcome

    def _merge(self, p: int, outcome: _Outcome, params: torch.Tensor, *, mix: bool) -> None:
        """Fragment p after its sync: our own outer step replaces the local fragment, or (`mix`)
        merges with it, α local + (1 - α) outer; a donor's offer keeps our progress."""
        if outcome.anchor is None:
            return  # nothing happened here: our anchor and our progress stay
        start, end = self.bounds[p]
        local, anchor = params[start:end], self.anchor[start:end]
        if outcome.donor is None:  # our own outer step
            anchor.copy_(outcome.anchor)
            self._take_anchor(p, params, mix=mix)
            self.outer_steps += 1
        else:  # a donor's: keep the progress made since our (older) anchor
            local.add_(outcome.anchor - anchor)
            anchor.copy_(outcome.anchor)
            self.caught_up += 1
            log.info("node %d: fragment %d caught up to outer version %d from node %d", self.rank, p,
                     outcome.version, outcome.donor)
        self.momentum[start:end].copy_(outcome.momentum)
        self.versions[p] = outcome.version

    def _take_anchor(self, p: int, params: torch.Tensor, *, mix: bool) -> None:
        """The local fragment p becomes the anchor's, or (`mix`) α local + (1 - α) anchor."""
        start, end = self.bounds[p]
        local, anchor = params[start:end], self.anchor[start:end]
        if mix and self.alpha:
            local.mul_(self.alpha).add_(anchor, alpha=1.0 - self.alpha)
        else:
            local.copy_(anchor)


def _donor(rank: int, current: list[int]) -> int:
    """Who hands `rank` its offer: the next current member after it in ring order."""
    return next((r for r in current if r > rank), current[0])


register(AlgorithmSpec(
    "diloco", "H local AdamW steps, then the mean pseudo-gradient by ring all-reduce drives an outer Nesterov "
    "step on the anchor; --fragments/--outer-delay: Streaming DiLoCo", DiLoCoOptions, DiLoCo.from_options,
    topologies=("ring",), default_optimizer="adamw"))

__all__ = ["DiLoCo", "DiLoCoOptions"]
