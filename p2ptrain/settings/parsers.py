"""The small languages inside settings, each with one parser that raises ValueError in one line
(NodeConfig wraps it as a ConfigError naming the setting):

  Slowdown          "4" (every node) or "0=4,3=2" (per rank): compute slow-down factors >= 1
  AtStep            "RANK@STEP" (inject_nan; launch --kill, --restart, --leave), "COUNT@STEP" (launch
                    --join), "RANK@STEP:SECONDS" (launch --stall)
  LinkEntry         "SRC->DST:REST" / "SRC<->DST:REST", the entries of relay routes and link overrides
  LinkBurst, SlowWindow  "SRC<->DST@STEP+STEPS:SPEC", "RANK@STEP+STEPS:FACTOR": faults for a window of steps
  parse_relay_routes  "SRC->DST:VIA[,VIA2]" / "SRC<->DST:VIA" -> {(src, dst): relays}
  parse_relays      "1,2" / "any" -> relay candidates

Link specs keep their grammar with the emulator (transport/faults.py). Pure text: no files, no torch.
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple


@dataclass(frozen=True)
class Slowdown:
    """Compute slow-down factors (1 = full speed): one for every node, or per rank (others 1)."""

    every: float | None = None
    per_rank: Mapping[int, float] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str | float | None) -> "Slowdown":
        """"4" -> every node 4; "0=4,3=2" -> ranks 0 and 3; None or "" -> full speed."""
        entries = [e.strip() for e in str(text if text is not None else "").split(",") if e.strip()]
        per_rank: dict[int, float] = {}
        for entry in entries:
            rank_text, sep, factor_text = entry.rpartition("=")
            try:
                factor = float(factor_text)
            except ValueError:
                raise ValueError(f"{factor_text!r} is not a number (FACTOR or RANK=FACTOR,...)") from None
            if not 1.0 <= factor < math.inf:
                raise ValueError(f"factor {factor_text} must be >= 1 (1 = full speed)")
            if not sep:
                if len(entries) > 1:
                    raise ValueError("give one FACTOR for every node, or RANK=FACTOR entries")
                return cls(every=factor)
            if not rank_text.strip().isdigit():
                raise ValueError(f"rank {rank_text!r} is not a rank number")
            per_rank[int(rank_text)] = factor
        return cls(per_rank=per_rank)

    def factors(self, world_size: int) -> dict[int, float]:
        """The factor of every slowed rank; ValueError for a rank outside the run."""
        for rank in self.per_rank:
            if not 0 <= rank < world_size:
                raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
        if self.every is not None:
            return {rank: self.every for rank in range(world_size)}
        return dict(self.per_rank)


class AtStep(NamedTuple):
    """NUMBER@STEP[:SECONDS]: node NUMBER (or NUMBER nodes) is acted on once the run reaches STEP."""

    number: int
    step: int
    seconds: float | None = None

    @classmethod
    def parse(cls, text: str, *, number: str = "RANK", seconds: bool = False, example: str = "2@50") -> "AtStep":
        """`number` names the first part in messages (RANK, COUNT); `seconds` wants a ":SECONDS" tail
        (> 0); `example` is shown when the form is wrong."""
        first, at, rest = str(text).partition("@")
        step, colon, duration = rest.partition(":")
        if not (at and first.strip().isdigit() and step.strip().isdigit()) or bool(colon) != seconds:
            raise ValueError(f"expected {number}@STEP{':SECONDS' if seconds else ''}, e.g. {example}")
        if not seconds:
            return cls(int(first), int(step))
        try:
            how_long = float(duration)
        except ValueError:
            raise ValueError(f"{duration!r} is not a number of seconds") from None
        if not 0 < how_long < math.inf:
            raise ValueError(f"it must last > 0 seconds, not {duration}")
        return cls(int(first), int(step), how_long)


_LINK = re.compile(r"^\s*(\d+)\s*(<->|->)\s*(\d+)\s*$")


class LinkEntry(NamedTuple):
    """"SRC->DST:REST" (one direction) or "SRC<->DST:REST" (both)."""

    src: int
    dst: int
    both_ways: bool
    rest: str

    @classmethod
    def parse(cls, entry: str) -> "LinkEntry | None":
        """The entry, or None when it is not of that form (each caller says what it expected)."""
        link, sep, rest = str(entry).partition(":")
        match = _LINK.match(link)
        if not sep or not match:
            return None
        return cls(int(match.group(1)), int(match.group(3)), match.group(2) == "<->", rest)


class StepWindow(NamedTuple):
    """Steps [start, start + steps) of a fault that a node applies at its own step boundaries."""

    start: int
    steps: int

    @property
    def end(self) -> int:
        return self.start + self.steps

    def __contains__(self, step: object) -> bool:
        return isinstance(step, int) and self.start <= step < self.start + self.steps

    @classmethod
    def parse(cls, text: str) -> "StepWindow":
        """"100+20" -> steps 100..119; ValueError unless STEP >= 0 and STEPS >= 1."""
        start, plus, steps = str(text).partition("+")
        if not (plus and start.strip().isdigit() and steps.strip().isdigit()):
            raise ValueError(f"{text!r} is not STEP+STEPS (e.g. 100+20: steps 100 to 119)")
        if int(steps) < 1:
            raise ValueError(f"{text!r} lasts no step: STEPS must be >= 1")
        return cls(int(start), int(steps))


class LinkBurst(NamedTuple):
    """"SRC->DST@STEP+STEPS:SPEC" (one direction) or "SRC<->DST@STEP+STEPS:SPEC" (both): link SPEC
    (the emulator's grammar, checked there) on top of the link's own spec for that window."""

    src: int
    dst: int
    both_ways: bool
    window: StepWindow
    spec: str

    @classmethod
    def parse(cls, entry: str) -> "LinkBurst":
        """The entry, or ValueError naming it."""
        head, colon, spec = str(entry).partition(":")
        link, at, window = head.partition("@")
        match = _LINK.match(link)
        if not (colon and at and match):
            raise ValueError(f"link burst {entry!r} is not SRC->DST@STEP+STEPS:SPEC or SRC<->DST@STEP+STEPS:SPEC "
                             "(e.g. 0<->2@100+20:block)")
        src, dst = int(match.group(1)), int(match.group(3))
        if src == dst:
            raise ValueError(f"link burst {entry!r}: a node has no link to itself")
        if not spec.strip():
            raise ValueError(f"link burst {entry!r} has no SPEC (e.g. drop=0.5, block or latency=200ms)")
        try:
            steps = StepWindow.parse(window)
        except ValueError as exc:
            raise ValueError(f"link burst {entry!r}: {exc}") from None
        return cls(src, dst, match.group(2) == "<->", steps, spec.strip())

    def directed(self) -> list["LinkBurst"]:
        """One entry per direction it applies to (SRC->DST, and DST->SRC for SRC<->DST)."""
        one_way = self._replace(both_ways=False)
        return [one_way, one_way._replace(src=self.dst, dst=self.src)] if self.both_ways else [one_way]


class SlowWindow(NamedTuple):
    """"RANK@STEP+STEPS:FACTOR": node RANK's compute is FACTOR (>= 1) times slower for that window."""

    rank: int
    window: StepWindow
    factor: float

    @classmethod
    def parse(cls, entry: str) -> "SlowWindow":
        """The entry, or ValueError naming it."""
        rank, at, rest = str(entry).partition("@")
        window, colon, factor_text = rest.partition(":")
        if not (at and colon and rank.strip().isdigit()):
            raise ValueError(f"slow window {entry!r} is not RANK@STEP+STEPS:FACTOR (e.g. 1@100+30:4)")
        try:
            steps = StepWindow.parse(window)
            factor = float(factor_text)
        except ValueError as exc:
            detail = exc if "STEP" in str(exc) else f"FACTOR {factor_text!r} is not a number"
            raise ValueError(f"slow window {entry!r}: {detail}") from None
        if not 1.0 <= factor < math.inf:
            raise ValueError(f"slow window {entry!r}: FACTOR must be >= 1 (1 = full speed)")
        return cls(int(rank), steps, factor)


@dataclass(frozen=True)
class SlowSchedule:
    """One node's compute slow-down at each step: `base` (its --slowdown factor) times the factor of
    every slow window it is in. Called with a step, as the trainer does at each step."""

    base: float
    windows: tuple[SlowWindow, ...]

    def __call__(self, step: int) -> float:
        factor = self.base
        for window in self.windows:
            if step in window.window:
                factor *= window.factor
        return factor


def link_entries(entries: Iterable[str] | Mapping[str, str]) -> list[str]:
    """Entries as a list, a mapping {"SRC->DST": REST} (a TOML table) as "SRC->DST:REST" in its order."""
    return [f"{k}:{v}" for k, v in entries.items()] if isinstance(entries, Mapping) else list(entries)


def parse_relay_routes(entries: Iterable[str] | Mapping[str, str], world_size: int | None = None
                       ) -> dict[tuple[int, int], tuple[int, ...]]:
    """``SRC->DST:VIA[,VIA2...]`` (one direction) or ``SRC<->DST:VIA[,...]`` (both; the way back
    goes through the relays in reverse order), or a mapping ``{"SRC->DST": "VIA,..."}`` (TOML).
    Later entries for the same (SRC, DST) replace earlier ones. Raises ValueError."""
    routes: dict[tuple[int, int], tuple[int, ...]] = {}
    for entry in link_entries(entries):
        parsed = LinkEntry.parse(entry)
        if parsed is None:
            raise ValueError(f"relay route {entry!r} is not SRC->DST:VIA[,VIA2] or SRC<->DST:VIA "
                             "(e.g. 0->3:1)")
        try:
            via = tuple(int(v) for v in parsed.rest.split(","))
        except ValueError:
            raise ValueError(f"relay route {entry!r}: relays must be comma-separated ranks") from None
        nodes = (parsed.src, parsed.dst, *via)
        if world_size is not None and not all(0 <= n < world_size for n in nodes):
            raise ValueError(f"relay route {entry!r} names a rank outside 0..{world_size - 1}")
        if len(set(nodes)) != len(nodes):
            raise ValueError(f"relay route {entry!r} visits a node twice (a loop, or a relay that is "
                             "the sender or receiver)")
        routes[(parsed.src, parsed.dst)] = via
        if parsed.both_ways:
            routes[(parsed.dst, parsed.src)] = via[::-1]
    return routes


def parse_relays(text: str | Iterable | None, world_size: int | None = None) -> tuple[int, ...] | None:
    """Relay candidates for found-out routes: ``None`` / "" = detection off, ``"any"`` = any peer
    this node reached directly, ``"1,2"`` = these first (then any reached peer). Raises ValueError."""
    if text is None:
        return None
    parts = [str(p).strip() for p in (text.split(",") if isinstance(text, str) else text)]
    parts = [p for p in parts if p]
    if not parts:
        return None
    if parts == ["any"]:
        return ()
    try:
        ranks = tuple(int(p) for p in parts)
    except ValueError:
        raise ValueError(f"relays {text!r}: give comma-separated ranks, or 'any'") from None
    if world_size is not None and not all(0 <= r < world_size for r in ranks):
        raise ValueError(f"relays {text!r} names a rank outside 0..{world_size - 1}")
    return tuple(dict.fromkeys(ranks))


__all__ = ["AtStep", "LinkBurst", "LinkEntry", "SlowSchedule", "SlowWindow", "Slowdown", "StepWindow", "link_entries",
           "parse_relay_routes", "parse_relays"]
