"""Random faults for `p2ptrain launch --chaos COUNT`: a seeded, reproducible plan of kills (each with
its restart), stalls, leaves and joins spread over a run, as real clusters fail (PCCL's stress test,
torchft's punisher), instead of one scripted fault.

The plan is a set of `--kill/--restart/--stall/--leave/--join` specs, so it goes through the same
validation (fault_plan) and execution as hand-written faults. At every step at least `min_alive`
nodes are members and not killed; a killed node is restarted 5-40 steps later; nothing happens in
the first 10% or the last 15% of the run (a restart must find a cluster to rejoin), joins only in
the first 60% (a joiner must find donors) and at most nodes / 2 of them (each is a process from the start).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

KINDS = ("kill", "stall", "leave", "join")
DEFAULT_MAX_STALL = 30.0  # seconds
MIN_ALIVE = 2


@dataclass
class ChaosPlan:
    """The plan as launch's fault flags (RANK@STEP, RANK@STEP:SECONDS, COUNT@STEP)."""

    kills: list[str] = field(default_factory=list)
    restarts: list[str] = field(default_factory=list)
    stalls: list[str] = field(default_factory=list)
    leaves: list[str] = field(default_factory=list)
    joins: list[str] = field(default_factory=list)

    @property
    def events(self) -> int:
        """Faults in the plan (a kill and its restart count as one)."""
        return len(self.kills) + len(self.stalls) + len(self.leaves) + len(self.joins)


def parse_kinds(text: str) -> tuple[str, ...]:
    """`kill,stall,...` -> the kinds; ValueError naming an unknown one."""
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or not kinds:
        raise ValueError(f"--chaos-kinds {text!r}: choose from {', '.join(KINDS)}")
    return kinds


def chaos_plan(nodes: int, steps: int, count: int, *, seed: int = 0, kinds: tuple[str, ...] = KINDS,
               max_stall: float = DEFAULT_MAX_STALL, min_alive: int = MIN_ALIVE) -> ChaosPlan:
    """`count` random faults over a run of `steps` steps on `nodes` nodes (same seed, same plan)."""
    if nodes < min_alive:
        raise ValueError(f"--chaos needs at least {min_alive} nodes (it keeps {min_alive} alive), got {nodes}")
    first, last = max(1, steps // 10), int(steps * 0.85)
    if count < 1 or last - first < count:
        raise ValueError(f"--chaos {count}: between 1 and {max(0, last - first)} faults fit a run of {steps} steps")
    if not max_stall >= 1.0:
        raise ValueError(f"--chaos-max-stall must be >= 1 second, got {max_stall}")
    rng = random.Random(seed)
    plan = ChaosPlan()
    members = set(range(nodes))         # ranks that have not left
    down_until: dict[int, int] = {}     # killed rank -> the step of its restart
    joined = nodes                      # the next joiner's rank
    last_join, max_joins = int(steps * 0.6), max(1, nodes // 2)
    for step in sorted(rng.sample(range(first, last), count)):
        down_until = {r: s for r, s in down_until.items() if s > step}
        up = sorted(members - set(down_until))
        joins_left = step < last_join and joined - nodes < max_joins
        choices = [k for k in kinds if _possible(k, up, min_alive) and (k != "join" or joins_left)]
        if not choices:
            continue
        kind = rng.choice(choices)
        if kind == "join":
            plan.joins.append(f"1@{step}")
            members.add(joined)
            down_until[joined] = step + 1  # (it is set up and admitted at its step: busy until then)
            joined += 1
            continue
        rank = rng.choice(up)
        if kind == "kill":
            back = min(step + rng.randint(5, 40), last)
            plan.kills.append(f"{rank}@{step}")
            plan.restarts.append(f"{rank}@{back}")
            down_until[rank] = back + 1
        elif kind == "stall":
            plan.stalls.append(f"{rank}@{step}:{rng.uniform(1.0, max_stall):.1f}")
        else:
            plan.leaves.append(f"{rank}@{step}")
            members.discard(rank)
    return plan


def _possible(kind: str, up: list[int], min_alive: int) -> bool:
    """Whether a fault of `kind` keeps `min_alive` members running (a stall is over in seconds)."""
    return kind in ("join", "stall") or len(up) > min_alive


__all__ = ["ChaosPlan", "DEFAULT_MAX_STALL", "KINDS", "MIN_ALIVE", "chaos_plan", "parse_kinds"]
