"""What the DiLoCo family shares (DiLoCo, Streaming DiLoCo, gossip-DiLoCo): its options, the outer
optimizer, and the messages that hand a node's outer state to a peer that lacks it.

DiLoCo (Douillard et al., 2023), per worker i and outer step t, from the anchor θ^(t-1):
    θ_i ← θ^(t-1);  H inner steps of the node's own optimizer (AdamW):  θ_i ← InnerOpt(θ_i, ∇f_i)
    Δ_i = θ^(t-1) - θ_i                  (the pseudo-gradient; its mean over workers is Δ^(t))
    θ^(t) = OuterOpt(θ^(t-1), Δ^(t))     (SGD with Nesterov momentum, lr 0.7, momentum 0.9)
Invariant: nodes that hold the same anchor, momentum and Δ end an outer step with the same bits
(OuterNesterov is plain elementwise arithmetic). The outer state of a node is (anchor, momentum,
version), version = outer steps applied to it (-1: unknown); a node lacking it gets an offer from a
peer that has it (OuterStateChannel). Never opens a socket; imports no torch at module level.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from p2ptrain.algorithms.base import Comm, Kind
from p2ptrain.algorithms.registry import AlgorithmOptions, option
from p2ptrain.compression import CODEC_HELP, CODEC_NAMES, VALUE_BITS

if TYPE_CHECKING:
    import torch

UNKNOWN = -1  # the version of an anchor taken from a donor before its outer state came


@dataclass(frozen=True)
class OuterOptions(AlgorithmOptions):
    """Options every DiLoCo variant takes (declared once, so the shared flags agree)."""

    inner_steps: int = option(50, "H: local steps of the inner optimizer (AdamW) between outer steps", metavar="H")
    outer_lr: float = option(0.7, "learning rate of the outer Nesterov SGD on the pseudo-gradient")
    outer_momentum: float | None = option(None, "momentum of the outer Nesterov SGD (default 0.9; diloco with "
                                                "compression topk, sparseloco or dct-topk: 0, their decaying "
                                                "error feedback takes the momentum's place, see --error-decay)")
    compression: str = option("none", CODEC_HELP, choices=CODEC_NAMES)
    topk_fraction: float = option(0.01, "compression topk: the fraction of entries kept (what it drops stays "
                                        "on the node as error feedback); sparseloco / dct-topk: of each chunk",
                                   metavar="FRACTION")
    value_bits: int = option(2, "compression sparseloco / dct-topk: bits per kept value, 1..8 (one scale per chunk; "
                                "1 = sign times the scale), or 32 = float32 values", metavar="BITS")

    def bounded_delay(self) -> int:
        """Between outer steps nodes hear nothing from each other: a fast one may be H steps ahead."""
        return self.inner_steps

    def default_momentum(self) -> float:
        return 0.9

    @property
    def momentum(self) -> float:
        """The outer momentum in force: the option, or the variant's default."""
        return self.default_momentum() if self.outer_momentum is None else self.outer_momentum

    def validate(self, settings) -> None:
        super().validate(settings)
        if self.inner_steps < 1:
            raise ValueError(f"inner_steps H must be >= 1, got {self.inner_steps}")
        if not self.outer_lr > 0:
            raise ValueError(f"outer_lr must be > 0, got {self.outer_lr}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {self.outer_momentum}")
        if not 0 < self.topk_fraction <= 1:
            raise ValueError(f"topk_fraction must be in (0, 1], got {self.topk_fraction}")
        if self.value_bits not in VALUE_BITS:
            raise ValueError(f"value_bits must be 1..8 or 32 (float32 values), got {self.value_bits}")
        if settings is not None and self.bounded_delay() >= settings.step_window:
            # a sync's messages reach a node up to that many steps behind: its step window must take them
            raise ValueError(f"the steps between two syncs ({self.bounded_delay()}) must be smaller than "
                             f"step_window ({settings.step_window}): raise --step-window")

    def outer_settings(self) -> dict:
        """The shared options as keyword arguments of the algorithms' constructors (defaults resolved)."""
        return {**{f.name: getattr(self, f.name) for f in dataclasses.fields(OuterOptions)},
                "outer_momentum": self.momentum}


class OuterNesterov:
    """θ ← θ - lr (Δ + μ b), b ← μ b + Δ first: SGD with Nesterov momentum, Δ the (mean) pseudo-gradient.

    It is torch.optim.SGD(nesterov=True, dampening=0)'s update, written out so that it is plain
    elementwise arithmetic: nodes that hold the same anchor, momentum and Δ end with the same bits."""

    def __init__(self, lr: float = 0.7, momentum: float = 0.9):
        self.lr, self.momentum = lr, momentum

    def step(self, anchor: torch.Tensor, delta: torch.Tensor, buffer: torch.Tensor) -> None:
        """Update `anchor` and the momentum `buffer` in place (torch.optim.SGD's order of operations:
        b = μ b + Δ; d = Δ + μ b; θ -= lr d; a zero buffer makes the first step's b = Δ exactly)."""
        buffer.mul_(self.momentum).add_(delta)
        direction = delta.add(buffer, alpha=self.momentum) if self.momentum else delta
        anchor.add_(direction, alpha=-self.lr)


@dataclass
class Offer:
    """A peer's outer state for one slice of the parameters."""

    sender: int
    anchor: torch.Tensor
    momentum: torch.Tensor
    version: int


class OuterStateChannel:
    """The version, left-out and offer messages of one slice of `numel` parameters (channels
    `{tag}v`, `{tag}out`, `{tag}offer`); declare before comm.ready().

    An *offer* is [anchor, momentum, version] in one float32 message (versions are exact in float32
    up to 2^24 outer steps), sent by a peer that has the outer state to a node that lacks it
    (version -1: unknown, after taking a donor's anchor). Versions travel alone (one float32) on a
    second channel: DiLoCo's sync opens with them, gossip-DiLoCo's rejoining nodes ask with theirs;
    a third tells a node that came too late that a sync runs without it."""

    def __init__(self, comm: Comm, numel: int, dtype: torch.dtype, *, tag: str, kind: Kind = Kind.ALLREDUCE):
        self.comm, self.numel, self.dtype = comm, numel, dtype
        self.kind = kind
        self.versions_channel, self.out_channel, self.offers_channel = f"{tag}v", f"{tag}out", f"{tag}offer"
        comm.expect(kind, dtype, 1, channel=self.versions_channel, preallocate=0)
        comm.expect(kind, dtype, 1, channel=self.out_channel, preallocate=0)
        comm.expect(kind, dtype, 2 * numel + 1, channel=self.offers_channel, preallocate=0)

    def announce(self, peers: list[int], step: int, version: int, *, left_out: bool = False) -> None:
        """Tell `peers` this node's version; with `left_out`, that they are not in this step's sync
        (their version missed the deadline): they need not wait for a ring that runs without them."""
        import torch  # (here, not at import: the algorithm registry loads without torch)

        channel = self.out_channel if left_out else self.versions_channel
        for peer in peers:
            self.comm.send(peer, torch.tensor([float(version)], dtype=self.dtype), kind=self.kind, step=step,
                           channel=channel, reliable=True)

    def left_out(self, step: int) -> bool:
        """Whether a peer said this node is not in the step-`step` sync (already-arrived notices only)."""
        notices = self.comm.take(self.kind, step, channel=self.out_channel)
        for notice in notices:
            notice.release()
        return any(notice.step == step for notice in notices)

    def versions(self, step: int, peers: list[int], *, deadline: float | None = None) -> dict[int, int]:
        """The step-`step` versions of `peers` that arrive within the deadline."""
        got = self.comm.gather(self.kind, step, peers, channel=self.versions_channel, deadline=deadline)
        return {peer: self._version(message) for peer, message in got.items()}

    def requests(self, max_step: int) -> list[tuple[int, int]]:
        """(peer, version) of the versions that arrived unasked (a peer asking for an offer)."""
        return [(message.sender, self._version(message))
                for message in self.comm.take(self.kind, max_step, channel=self.versions_channel)]

    def offer(self, peer: int, step: int, anchor: torch.Tensor, momentum: torch.Tensor, version: int) -> None:
        import torch

        packed = torch.cat([anchor.reshape(-1), momentum.reshape(-1),
                            torch.tensor([float(version)], dtype=self.dtype, device=anchor.device)])
        self.comm.send(peer, packed, kind=self.kind, step=step, channel=self.offers_channel, reliable=True)

    def wait_offer(self, peer: int, step: int, *, deadline: float | None = None) -> Offer | None:
        got = self.comm.gather(self.kind, step, [peer], channel=self.offers_channel, deadline=deadline)
        return self._offer(got[peer]) if peer in got else None

    def offers(self, max_step: int) -> list[Offer]:
        """Offers that already arrived (non-blocking)."""
        return [self._offer(m) for m in self.comm.take(self.kind, max_step, channel=self.offers_channel)]

    def discard_through(self, step: int) -> None:
        """Throw away versions and offers of steps <= `step` that came too late to matter."""
        for channel in (self.versions_channel, self.out_channel, self.offers_channel):
            for stale in self.comm.take(self.kind, step, channel=channel):
                stale.release()

    @staticmethod
    def _version(message) -> int:
        version = int(float(message.tensor.reshape(-1)[0]))
        message.release()
        return version

    def _offer(self, message) -> Offer:
        flat = message.tensor.reshape(-1)
        offer = Offer(message.sender, flat[:self.numel].clone(), flat[self.numel:2 * self.numel].clone(),
                      int(float(flat[-1])))
        message.release()
        return offer


__all__ = ["OuterNesterov", "OuterOptions", "OuterStateChannel", "Offer", "UNKNOWN"]
