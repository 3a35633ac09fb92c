"""Gradient Energy Matching (seed 001): the worker's update rule Ψ and the baselines it is compared to.

A worker of the parameter server (p2ptrain.ps.worker) runs Algorithm 1, with Ψ one of the rules below:
    Δθ ← −η ∇L(s);   θ ← Pull();   Commit(Ψ(Δθ));   s ← θ
    gem                 m ← μ m + Δθ;  π = (κ|m| − |θ − s|) / (|Δθ| + ε)  (Alg. 1 with eq. 27 of App. B);
                        commit π ⊙ Δθ, π optionally clamped to [lo, hi] (default [0, 5]: DEFAULT_CLAMP)
    downpour            π = 1 (Dean et al. 2012)
    adaptive-staleness  the worker commits Δθ, the server applies Δθ / (τ + 1)
    proxy               not a rule: the target dynamics, synchronous momentum SGD (μ, η) on one
                        process (p2ptrain.ps.worker.run_proxy)
This module is the math only: it never opens a socket and knows nothing of the wire format; π is
finite for finite inputs (DEFAULT_EPSILON).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from p2ptrain.algorithms.registry import AlgorithmOptions, AlgorithmSpec, option, register

if TYPE_CHECKING:
    import torch

POLICIES = ("gem", "downpour", "adaptive-staleness", "proxy")
DEFAULT_KAPPA = 1.0
# Clamping π: Algorithm 1 writes π unclamped; the authors' code (github.com/montefiore-ai/
# gradient-energy-matching) clamps it to [0, 5] "for numerical stability", and so does p2ptrain's default
# (`--gem-clamp 0,5`; `none` = the formula as printed). The lower bound is what matters: where the drift
# |θ − s| exceeds κ|m|, an unclamped π is negative and the worker commits −sign(Δθ)·(|θ − s| − κ|m|), a step
# whose size grows with the other workers' steps; with several workers that feedback diverges (3 workers, MLP,
# η = 0.05: loss 2.3 -> 1e22 in 100 steps unclamped; 2.3 -> 0.9 with [0, 5], better than DOWNPOUR's 1.2 on the
# same run). `gem_pi` itself clamps only when asked.
DEFAULT_CLAMP = "0,5"  # the authors' code's clamp of π; "none" for none
# Algorithm 1's ε. It is kept at the paper's value and π is computed in float32:
#  * 1e-16 is a normal float32 (smallest normal ≈ 1.18e-38), so it is not flushed to zero;
#  * it only matters where the update (nearly) vanishes: for |Δθ| > ~1.7e-9, |Δθ| + 1e-16 == |Δθ| in
#    float32 (24-bit mantissa), which is the point: ε guards the division, it does not damp π;
#  * for Δθ == 0 exactly (e.g. a dead ReLU's weights), π = (κ|m| − |θ − s|) / 1e-16, finite unless the
#    numerator exceeds ~3.4e22 (float32 max × ε), when it would overflow to ±inf and the committed
#    π ⊙ Δθ = inf · 0 would be NaN. gem_pi saturates ±inf to ±float32 max, so π is always finite (NaN
#    only propagates from NaN inputs, i.e. a diverged worker, whose commit the server rejects) and
#    π ⊙ Δθ is exactly 0 wherever Δθ is 0, and never larger in magnitude than the numerator elsewhere.
# A larger ε would not buy safety: it would only shrink π for genuinely small updates.
DEFAULT_EPSILON = 1e-16
FLOAT32_TINY = 1.1754943508222875e-38  # smallest normal float32: a smaller ε would be a subnormal
FLOAT32_MAX = 3.4028234663852886e38
_PI_MEDIAN_SAMPLE = 1 << 20  # median π over at most this many elements (a strided sample of larger models)


def parse_clamp(text: str | None) -> tuple[float, float] | None:
    """"lo,hi" -> (lo, hi); None / "" / "none" -> None. Raises ValueError with the reason."""
    if text is None or not str(text).strip() or str(text).strip().lower() == "none":
        return None
    parts = [p.strip() for p in str(text).split(",")]
    if len(parts) != 2:
        raise ValueError(f"clamp {text!r} is not 'lo,hi'")
    try:
        lo, hi = float(parts[0]), float(parts[1])
    except ValueError:
        raise ValueError(f"clamp {text!r} is not 'lo,hi' with two numbers") from None
    if math.isnan(lo) or math.isnan(hi) or lo > hi:
        raise ValueError(f"clamp {text!r}: need lo <= hi")
    return lo, hi


def gem_pi(m: torch.Tensor, delta: torch.Tensor, theta: torch.Tensor, s: torch.Tensor, *,
           kappa: float = DEFAULT_KAPPA, epsilon: float = DEFAULT_EPSILON,
           clamp: tuple[float, float] | None = None) -> torch.Tensor:
    """Element-wise scaling factors π = (κ|m| − |θ − s|) / (|Δθ| + ε) (eq. 27), float32, finite
    for finite inputs (see DEFAULT_EPSILON), clamped to `clamp` = (lo, hi) when given."""
    m, delta, theta, s = (t.float() for t in (m, delta, theta, s))
    pi = (kappa * m.abs() - (theta - s).abs()) / (delta.abs() + epsilon)
    big = FLOAT32_MAX
    pi = pi.nan_to_num_(nan=math.nan, posinf=big, neginf=-big)
    if clamp is not None:
        pi = pi.clamp_(clamp[0], clamp[1])
    return pi


def staleness_scale(tau: int) -> float:
    """Adaptive staleness: the factor 1 / (τ + 1) the server applies to a commit of staleness τ (the
    server, because only it knows a commit's staleness τ exactly when it applies it)."""
    if tau < 0:
        raise ValueError(f"staleness must be >= 0, got {tau}")
    return 1.0 / (tau + 1)


def pi_median(pi: torch.Tensor, delta: torch.Tensor) -> float:
    """Median π over the coordinates where the update is non-zero (where π means anything: for
    Δθ == 0 it is a huge finite number with no effect); NaN when there are none."""
    pi, delta = pi.reshape(-1), delta.reshape(-1)
    if pi.numel() > _PI_MEDIAN_SAMPLE:
        stride = -(-pi.numel() // _PI_MEDIAN_SAMPLE)
        pi, delta = pi[::stride], delta[::stride]
    live = pi[delta != 0]
    return float(live.median()) if live.numel() else math.nan


class WorkerRule:
    """Ψ: turns a worker's update Δθ into what it commits, given the fresh θ and its stale s."""

    policy = "rule"
    server_scales_by_staleness = False  # True: the server applies Δθ / (τ + 1)

    def __call__(self, delta: torch.Tensor, theta: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, float]:
        """(update to commit, median π of this update; NaN when the server decides the factor)."""
        raise NotImplementedError


class GemRule(WorkerRule):
    """Ψ_gem of Algorithm 1 with κ (App. B, eq. 27): keeps the worker's first moment m."""

    policy = "gem"

    def __init__(self, *, kappa: float = DEFAULT_KAPPA, momentum: float = 0.9, epsilon: float = DEFAULT_EPSILON,
                 clamp: tuple[float, float] | None = None):
        if not (kappa >= 0 and math.isfinite(kappa)):
            raise ValueError(f"kappa must be a finite number >= 0, got {kappa}")
        if not (0 <= momentum < 1):
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if not (FLOAT32_TINY <= epsilon < math.inf):
            raise ValueError(f"epsilon must be a normal float32 > 0 (>= {FLOAT32_TINY:.3g}), got {epsilon}")
        self.kappa, self.momentum, self.epsilon, self.clamp = kappa, momentum, epsilon, clamp
        self.m: torch.Tensor | None = None  # m ← 0 (Algorithm 1, Worker line 2)
        self.last_pi: torch.Tensor | None = None

    def __call__(self, delta: torch.Tensor, theta: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, float]:
        delta = delta.float()
        if self.m is None:
            self.m = delta.new_zeros(delta.shape)
        self.m.mul_(self.momentum).add_(delta)  # m ← μ m + Δθ
        pi = gem_pi(self.m, delta, theta, s, kappa=self.kappa, epsilon=self.epsilon, clamp=self.clamp)
        self.last_pi = pi
        return pi * delta, pi_median(pi, delta)


class DownpourRule(WorkerRule):
    """π = 1: commit Δθ as it is."""

    policy = "downpour"

    def __call__(self, delta, theta, s):
        return delta.float(), 1.0


class AdaptiveStalenessRule(WorkerRule):
    """Commit Δθ; the server rescales it by 1 / (τ + 1) when it applies it. The worker does not
    scale itself: its own estimate of τ (versions seen between its pulls) would miss the commits
    that land between its pull and the server applying this one; the server counts them exactly and
    returns the factor in its reply."""

    policy = "adaptive-staleness"
    server_scales_by_staleness = True

    def __call__(self, delta, theta, s):
        return delta.float(), math.nan


def build_rule(policy: str, *, kappa: float = DEFAULT_KAPPA, momentum: float = 0.9,
               epsilon: float = DEFAULT_EPSILON, clamp: tuple[float, float] | None = None) -> WorkerRule:
    if policy == "gem":
        return GemRule(kappa=kappa, momentum=momentum, epsilon=epsilon, clamp=clamp)
    if policy == "downpour":
        return DownpourRule()
    if policy == "adaptive-staleness":
        return AdaptiveStalenessRule()
    if policy == "proxy":
        raise ValueError("the proxy is not a commit rule: it trains on one process (p2ptrain.ps.worker.run_proxy)")
    raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")


@dataclass(frozen=True)
class GemOptions(AlgorithmOptions):
    """The worker rule of a parameter-server cluster (`p2ptrain ps` + `--role worker`)."""

    ps_policy: str = option("gem", "worker rule: gem = scale updates by π (Alg. 1), downpour = π 1, "
                                   "adaptive-staleness = the server applies Δθ/(τ+1), proxy = the target: momentum "
                                   "SGD (--lr, --momentum) on one process, no server", choices=POLICIES)
    gem_kappa: float = option(DEFAULT_KAPPA, "κ: amplifies the proxy energy, π = (κ|m| - |θ-s|)/(|Δθ|+ε); GEM's μ is "
                                             "--momentum", metavar="KAPPA")
    gem_epsilon: float = option(DEFAULT_EPSILON, "ε in π's denominator; only acts where Δθ is ~0", metavar="EPS")
    gem_clamp: str | None = option(DEFAULT_CLAMP, "clamp π element-wise to [LO, HI]; 'none' = the paper's unclamped "
                                                  "formula, whose negative π amplify the drift and diverge with "
                                                  "several workers (the authors' code clamps to 0,5)", metavar="LO,HI")

    def validate(self, settings) -> None:
        super().validate(settings)
        if not (self.gem_kappa >= 0 and self.gem_kappa < float("inf")):
            raise ValueError(f"gem_kappa must be a finite number >= 0, got {self.gem_kappa}")
        if not FLOAT32_TINY <= self.gem_epsilon < float("inf"):
            raise ValueError(f"gem_epsilon must be a normal float32 > 0 (>= {FLOAT32_TINY:.3g}), "
                             f"got {self.gem_epsilon}")
        try:
            parse_clamp(self.gem_clamp)
        except ValueError as exc:
            raise ValueError(f"gem_clamp: {exc}") from None
        if settings is not None and settings.role == "worker" and self.ps_policy != "proxy" and not settings.ps_address:
            raise ValueError("a worker needs --ps-address HOST:PORT of the parameter server")
        if settings is not None and self.ps_policy == "proxy":
            if settings.role == "ps":
                raise ValueError("--ps-policy proxy trains on one worker process without a parameter server; run it "
                                 "with --role worker")
            if settings.world_size != 1:
                raise ValueError("--ps-policy proxy is synchronous momentum SGD on one process: use --world-size 1 "
                                 "(its batch is --batch-size)")


register(AlgorithmSpec(
    "gem", "asynchronous parameter server; workers commit π ⊙ Δθ, π from gradient energy matching (seed 001)",
    GemOptions, None, role="parameter-server"))

__all__ = ["POLICIES", "DEFAULT_KAPPA", "DEFAULT_CLAMP", "DEFAULT_EPSILON", "parse_clamp", "gem_pi", "staleness_scale",
           "pi_median",
           "WorkerRule", "GemRule", "DownpourRule", "AdaptiveStalenessRule", "build_rule", "GemOptions"]
