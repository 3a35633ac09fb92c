"""Random faults for `p2ptrain launch --chaos COUNT`: a seeded, reproducible plan of kills (each with
its restart), stalls, leaves, joins, link bursts (drops, or a block) and slow nodes over a run, as
real clusters fail (PCCL's stress test, torchft's punisher), instead of one scripted fault.

The plan is launch's fault flags plus the nodes' `--link-burst/--slow` entries, validated and run as
hand-written ones are. At every step at least `min_alive` nodes are members and not killed; a killed
node is restarted 5-40 steps later; nothing happens in the first 10% or the last 15% of the run (a
restart must find a cluster to rejoin; windows end by then); joins only in the first 60% and at most
nodes / 2 of them; leaves only while more than nodes / 2 + 1 members remain (however long the run,
the cluster does not wither to two); at most one link is blocked at a time, only while 3 members are up, and they stay
up while it is (every pair keeps a route); a node's slow windows never overlap (factors multiply).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

KINDS = ("kill", "stall", "leave", "join", "link", "slow")
DEFAULT_MAX_STALL = 30.0  # seconds
MIN_ALIVE = 2
DROP_STEPS, DROP_RATE = (5, 30), (0.3, 0.9)  # a drop burst: how many steps, what share of messages lost
BLOCK_STEPS = (5, 50)                        # a blocked link: how many steps
SLOW_STEPS, SLOW_FACTOR = (10, 100), (2.0, 6.0)


@dataclass
class ChaosPlan:
    """The plan as launch's fault flags (RANK@STEP, RANK@STEP:SECONDS, COUNT@STEP) and the nodes'
    scheduled faults (--link-burst SRC<->DST@STEP+STEPS:SPEC, --slow RANK@STEP+STEPS:FACTOR)."""

    kills: list[str] = field(default_factory=list)
    restarts: list[str] = field(default_factory=list)
    stalls: list[str] = field(default_factory=list)
    leaves: list[str] = field(default_factory=list)
    joins: list[str] = field(default_factory=list)
    link_bursts: list[str] = field(default_factory=list)
    slows: list[str] = field(default_factory=list)

    @property
    def events(self) -> int:
        """Faults in the plan (a kill and its restart count as one)."""
        return (len(self.kills) + len(self.stalls) + len(self.leaves) + len(self.joins) + len(self.link_bursts)
                + len(self.slows))


def parse_kinds(text: str) -> tuple[str, ...]:
    """`kill,stall,...` -> the kinds; ValueError naming an unknown one."""
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or not kinds:
        raise ValueError(f"--chaos-kinds {text!r}: choose from {', '.join(KINDS)}")
    return kinds


def chaos_plan(nodes: int, steps: int, count: int, *, seed: int = 0, kinds: tuple[str, ...] = KINDS,
               max_stall: float = DEFAULT_MAX_STALL, min_alive: int = MIN_ALIVE) -> ChaosPlan:
    """`count` random faults over a run of `steps` steps on `nodes` nodes (same seed, same plan). A
    `link` fault drops 30-90% of one link's messages (one direction or both) for 5-30 steps, or, half
    the time where it may, blocks it both ways for 5-50 steps; a `slow` one slows a node 2-6x for
    10-100 steps."""
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
    blocked_until = 0                   # the step the blocked link (one at a time) is back
    slow_until: dict[int, int] = {}     # slowed rank -> the step it is at full speed again
    last_join, max_joins = int(steps * 0.6), max(1, nodes // 2)
    for step in sorted(rng.sample(range(first, last), count)):
        down_until = {r: s for r, s in down_until.items() if s > step}
        up = sorted(members - set(down_until))
        keep = min_alive + (step < blocked_until)  # a blocked pair keeps a third node to relay
        joins_left = step < last_join and joined - nodes < max_joins
        fast = [r for r in up if slow_until.get(r, 0) <= step]  # (windows never overlap: factors would multiply)
        may_leave = len(members) > nodes // 2 + 1
        choices = [k for k in kinds if _possible(k, up if k != "slow" else fast, keep)
                   and (k != "join" or joins_left) and (k != "leave" or may_leave)]
        if not choices:
            continue
        kind = rng.choice(choices)
        if kind == "link":
            a, b = sorted(rng.sample(up, 2))
            if step >= blocked_until and len(up) >= 3 and rng.random() < 0.5:
                lasts = _lasting(rng, BLOCK_STEPS, step, last)
                plan.link_bursts.append(f"{a}<->{b}@{step}+{lasts}:block")
                blocked_until = step + lasts
            else:
                src, dst = (a, b) if rng.random() < 0.5 else (b, a)
                link = f"{src}{rng.choice(('->', '<->'))}{dst}"
                plan.link_bursts.append(f"{link}@{step}+{_lasting(rng, DROP_STEPS, step, last)}:"
                                        f"drop={rng.uniform(*DROP_RATE):.2f}")
            continue
        if kind == "slow":
            rank, lasts = rng.choice(fast), _lasting(rng, SLOW_STEPS, step, last)
            plan.slows.append(f"{rank}@{step}+{lasts}:{rng.uniform(*SLOW_FACTOR):.1f}")
            slow_until[rank] = step + lasts
            continue
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
    """Whether a fault of `kind` keeps `min_alive` members running (a stall is over in seconds; a
    link burst or slow window stops no one, but needs a link or a node up)."""
    if kind in ("link", "slow"):
        return len(up) >= (2 if kind == "link" else 1)
    return kind in ("join", "stall") or len(up) > min_alive


def _lasting(rng: random.Random, steps: tuple[int, int], step: int, last: int) -> int:
    """A window's length: `steps` (low, high) drawn, cut to end by `last` (the quiet end of the run)."""
    return min(rng.randint(*steps), last - step)


__all__ = ["ChaosPlan", "DEFAULT_MAX_STALL", "KINDS", "MIN_ALIVE", "chaos_plan", "parse_kinds"]
