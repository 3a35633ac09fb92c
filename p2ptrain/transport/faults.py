"""WAN emulation on the sending side: per-link bandwidth cap, added latency (+ jitter), drop probability.

Decentralized algorithms are meant for slow, lossy links; loopback is neither. A LinkTable says
what each directed link (src rank -> dst rank) looks like, and the Transport of node `src` runs
every message to `dst` through that link's LinkEmulator before the real gRPC push. Off by default:
with no table (or an all-default one) the send path is untouched. A blocked link fails every send
at once with LinkUnreachable, which the send path treats like a refused connect. The spec text
(``--link``, ``--link-override``, TOML, env) is described by LinkSpec and LinkTable.parse. Link bursts
(``--link-burst``) change a link for a window of steps: the node moves its EmulatedLinks to each step.
"""
from __future__ import annotations

import asyncio
import math
import random
import re
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from p2ptrain.settings.parsers import LinkBurst, LinkEntry, link_entries
from p2ptrain.transport.errors import FailureKind, SendFailure

DEFAULT_BURST_BYTES = 64 * 1024  # bytes a capped idle link may pass at once (token-bucket depth)

_NUMBER = re.compile(r"^\s*([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*(.*?)\s*$")
_BIT_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
_BYTE_UNIT = re.compile(r"^([kKmMgG]?)(i?)B/s$")
_PREFIX = {"": 0, "k": 1, "m": 2, "g": 3}
_DURATION_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6}
_UNLIMITED = ("unlimited", "none", "inf")


class MessageDropped(SendFailure):
    """The link emulation lost this message: it never reached the peer."""

    def __init__(self, detail: str):
        super().__init__(FailureKind.DROPPED, detail)


class LinkUnreachable(SendFailure):
    """The emulated link is blocked: the peer cannot be reached directly (nothing was sent)."""

    def __init__(self, detail: str):
        super().__init__(FailureKind.UNREACHABLE, detail)


def _split_number(text: str, what: str) -> tuple[float, str]:
    match = _NUMBER.match(text) if isinstance(text, str) else None
    if not match:
        raise ValueError(f"{what} {text!r} is not a number with an optional unit")
    value = float(match.group(1))
    if value < 0:
        raise ValueError(f"{what} {text!r} is negative")
    return value, match.group(2)


def parse_bandwidth(text: str) -> float:
    """Bytes per second from ``200mbit`` / ``25MB/s`` / ``1MiB/s`` / ``1000000`` (see module doc).

    ``mbps``-style units are refused on purpose: tc reads them as bytes, most people as bits.
    """
    value, unit = _split_number(text, "bandwidth")
    if unit.lower() in _BIT_UNITS:
        rate = value * _BIT_UNITS[unit.lower()] / 8
    elif unit == "":
        rate = value
    elif match := _BYTE_UNIT.match(unit):
        rate = value * (1024 if match.group(2) else 1000) ** _PREFIX[match.group(1).lower()]
    else:
        raise ValueError(f"unknown bandwidth unit {unit!r} in {text!r}: use bit, kbit, mbit, gbit (bits/s) "
                         "or B/s, KB/s, MB/s, GB/s, KiB/s, MiB/s, GiB/s (bytes/s)")
    if rate <= 0:
        raise ValueError(f"bandwidth {text!r} must be > 0 (leave it out, or say 'unlimited', for no cap)")
    return rate


def parse_duration(text: str) -> float:
    """Seconds from ``5ms`` / ``0.5s`` / ``200us`` / ``0.01`` (a plain number is seconds)."""
    value, unit = _split_number(text, "duration")
    if unit not in _DURATION_UNITS:
        raise ValueError(f"unknown duration unit {unit!r} in {text!r}: use s, ms or us")
    return value * _DURATION_UNITS[unit]


def _parse_probability(text: str) -> float:
    value, unit = _split_number(text, "drop probability")
    if unit not in ("", "%"):
        raise ValueError(f"drop probability {text!r}: give a fraction like 0.01 or a percentage like 1%")
    return value / 100 if unit == "%" else value


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("true", "yes", "1", "on"):
        return True
    if value in ("false", "no", "0", "off"):
        return False
    raise ValueError(f"blocked={text!r}: give true or false")


@dataclass(frozen=True)
class LinkSpec:
    """What one directed link does to a message. bandwidth in bytes/s (None = no cap), times in s.

    Spec text (``--link``, ``--link-override``, TOML, env): comma-separated ``key=value`` with keys

      bandwidth  ``200mbit``, ``1gbit``, ``500kbit``, ``64bit`` (bits/s, SI: 10^3 / 10^6 / 10^9);
                 ``25MB/s``, ``1GB/s``, ``512KB/s`` (bytes/s, SI) or ``KiB/s``, ``MiB/s``, ``GiB/s``
                 (bytes/s, binary); a plain number is bytes/s; ``unlimited`` lifts a cap
      latency    one-way delay added to every message: ``5ms``, ``0.5s``, ``200us``; a plain number
                 is seconds
      jitter     the added delay varies uniformly in latency ± jitter (never below 0)
      drop       probability in [0, 1) that a message is lost, e.g. ``0.01`` or ``1%``
      block      (no value, or ``blocked=true``) the link is down, as behind a firewall or NAT: every
                 send fails at once with LinkUnreachable, which the send path treats like a refused
                 connect (it goes through a relay, see paths/router.py); ``blocked=false`` lifts it"""

    bandwidth: float | None = None
    latency: float = 0.0
    jitter: float = 0.0
    drop: float = 0.0
    blocked: bool = False

    def __post_init__(self) -> None:
        if self.bandwidth is not None and not (0 < self.bandwidth < math.inf):
            raise ValueError(f"bandwidth must be a positive number of bytes/s, got {self.bandwidth}")
        for name in ("latency", "jitter"):
            value = getattr(self, name)
            if not 0 <= value < math.inf:
                raise ValueError(f"{name} must be >= 0 seconds, got {value}")
        if not 0 <= self.drop < 1:  # drop = 1 would make a reliable send retry forever
            raise ValueError(f"drop probability must be in [0, 1), got {self.drop}")

    @property
    def is_noop(self) -> bool:
        return (self.bandwidth is None and self.latency == 0 and self.jitter == 0 and self.drop == 0
                and not self.blocked)

    @classmethod
    def parse(cls, text: str, base: "LinkSpec | None" = None) -> "LinkSpec":
        """``bandwidth=200mbit,latency=5ms,jitter=1ms,drop=0.01`` (or ``block``); keys left out keep
        `base`'s values."""
        parsers = {"bandwidth": lambda v: None if v.strip().lower() in _UNLIMITED else parse_bandwidth(v),
                   "latency": parse_duration, "jitter": parse_duration, "drop": _parse_probability,
                   "blocked": _parse_bool}
        values: dict[str, float | None] = {}
        for item in (text or "").split(","):
            if not item.strip():
                continue
            key, sep, value = item.partition("=")
            key = key.strip().lower()
            if key in ("block", "blocked") and not sep:  # bare flag: "0<->2:block"
                key, sep, value = "blocked", "=", "true"
            if not sep:
                raise ValueError(f"link spec item {item.strip()!r} is not key=value (in {text!r})")
            if key not in parsers:
                raise ValueError(f"unknown link spec key {key!r} in {text!r}; valid: {', '.join(parsers)}")
            if key in values:
                raise ValueError(f"link spec {text!r} sets {key} twice")
            values[key] = parsers[key](value)
        return replace(base or cls(), **values)

    def __str__(self) -> str:
        bandwidth = "unlimited" if self.bandwidth is None else f"{self.bandwidth * 8 / 1e6:g}mbit"
        return (f"bandwidth={bandwidth},latency={self.latency * 1e3:g}ms,jitter={self.jitter * 1e3:g}ms,"
                f"drop={self.drop:g}" + (",blocked=true" if self.blocked else ""))


@dataclass(frozen=True)
class LinkTable:
    """A default LinkSpec for every link, per-(src, dst) overrides, link bursts (a spec on top for a
    window of steps, one entry per direction) and the seed of the links' RNGs."""

    default: LinkSpec = LinkSpec()
    overrides: Mapping[tuple[int, int], LinkSpec] = field(default_factory=dict, hash=False)
    seed: int = 0
    bursts: tuple[LinkBurst, ...] = ()

    @classmethod
    def parse(cls, default: str | None = None, per_link: Iterable[str] | Mapping[str, str] = (),
              seed: int = 0, bursts: Iterable[str] | Mapping[str, str] = ()) -> "LinkTable":
        """From ``--link`` text, ``--link-override`` entries (``SRC->DST:SPEC`` / ``SRC<->DST:SPEC``,
        or a mapping ``{"SRC->DST": SPEC}`` as in a TOML table) and ``--link-burst`` entries
        (``SRC->DST@STEP+STEPS:SPEC``, or a mapping ``{"SRC->DST@STEP+STEPS": SPEC}``). Entries apply in
        order: each applies on top of what the link had so far (the default spec, then earlier entries),
        so ``0->1:latency=50ms`` keeps the default bandwidth cap; a burst applies on top of them all."""
        base = LinkSpec.parse(default or "")
        overrides: dict[tuple[int, int], LinkSpec] = {}
        for entry in link_entries(per_link):
            parsed = LinkEntry.parse(entry)
            if parsed is None:
                raise ValueError(f"link override {entry!r} is not SRC->DST:SPEC or SRC<->DST:SPEC "
                                 "(e.g. 0->1:latency=50ms)")
            src, dst = parsed.src, parsed.dst
            if src == dst:
                raise ValueError(f"link override {entry!r}: a node has no link to itself")
            pairs = [(src, dst), (dst, src)] if parsed.both_ways else [(src, dst)]
            for pair in pairs:
                overrides[pair] = LinkSpec.parse(parsed.rest, overrides.get(pair, base))
        directed: list[LinkBurst] = []
        for entry in link_entries(bursts):
            burst = LinkBurst.parse(entry)
            try:
                LinkSpec.parse(burst.spec)
            except ValueError as exc:
                raise ValueError(f"link burst {entry!r}: {exc}") from None
            directed += burst.directed()
        return cls(base, overrides, seed, tuple(directed))

    @property
    def is_noop(self) -> bool:
        return self.default.is_noop and all(spec.is_noop for spec in self.overrides.values()) and not self.bursts

    def spec_for(self, src: int, dst: int) -> LinkSpec:
        """The link's spec outside any burst."""
        return self.overrides.get((src, dst), self.default)

    def spec_at(self, src: int, dst: int, step: int) -> LinkSpec:
        """The link's spec at `step`: spec_for with the bursts in force then on top, in order."""
        spec = self.spec_for(src, dst)
        for burst in self.bursts:
            if (burst.src, burst.dst) == (src, dst) and step in burst.window:
                spec = LinkSpec.parse(burst.spec, spec)
        return spec

    def is_blocked(self, src: int, dst: int) -> bool:
        """Whether link src -> dst is emulated as down (the peer is reachable only through a relay)."""
        return self.spec_for(src, dst).blocked

    def check_ranks(self, world_size: int) -> None:
        """Raise ValueError for an override or burst naming a rank outside 0..world_size-1 (a likely typo)."""
        for src, dst in self.overrides:
            if not (0 <= src < world_size and 0 <= dst < world_size):
                raise ValueError(f"link override {src}->{dst} names a rank outside 0..{world_size - 1}")
        for burst in self.bursts:
            if not (0 <= burst.src < world_size and 0 <= burst.dst < world_size):
                raise ValueError(f"link burst {burst.src}->{burst.dst}@{burst.window.start}+{burst.window.steps} "
                                 f"names a rank outside 0..{world_size - 1}")

    def emulator(self, src: int, dst: int, spec: LinkSpec | None = None) -> "LinkEmulator | None":
        """The emulator of link src -> dst (with `spec`, default its spec_for), None where that link is
        untouched. Its RNG is seeded from (seed, src, dst), so a run's drops and jitter are reproducible."""
        spec = self.spec_for(src, dst) if spec is None else spec
        if spec.is_noop:
            return None
        return LinkEmulator(spec, random.Random(f"p2ptrain-link/{self.seed}/{src}->{dst}"))


class LinkEmulator:
    """One directed link, used on the sending node's event-loop thread (not thread-safe, except that
    a link burst swaps `spec` from the training thread: transmit() reads it once per message).

    transmit() first paces the message through a token bucket (`burst` bytes deep, refilled at the
    bandwidth): messages occupy the link one after another in call order, N bytes for
    N / bandwidth. Then it waits latency ± jitter, concurrently with later messages, so latency
    delays but does not serialize them. A dropped message still occupied the link, and fails only
    when it would have arrived: loss is noticed late, and a retransmission pays for the link again.
    """

    def __init__(self, spec: LinkSpec, rng: random.Random, burst: int = DEFAULT_BURST_BYTES):
        self.spec = spec
        self.rng = rng
        self.burst = burst
        self._idle_at = 0.0  # when the link would be idle had every message left at full rate

    async def transmit(self, nbytes: int) -> None:
        """Wait as the link would for an `nbytes` message; raise MessageDropped if it is lost, and
        LinkUnreachable at once (before any wait or draw) if the link is blocked."""
        spec = self.spec
        if spec.blocked:
            raise LinkUnreachable("link blocked by link emulation (peer unreachable directly)")
        # Draw everything before the first await: the RNG sequence follows call order, not timing.
        dropped = spec.drop > 0 and self.rng.random() < spec.drop
        delay = spec.latency + (self.rng.uniform(-spec.jitter, spec.jitter) if spec.jitter else 0.0)
        if spec.bandwidth is not None:
            loop = asyncio.get_running_loop()
            now = loop.time()
            self._idle_at = max(self._idle_at, now) + nbytes / spec.bandwidth
            wait = self._idle_at - self.burst / spec.bandwidth - now  # a full bucket lets `burst` through early
            if wait > 0:
                await asyncio.sleep(wait)
        if delay > 0:
            await asyncio.sleep(delay)
        if dropped:
            raise MessageDropped(f"message of {nbytes} bytes dropped by link emulation (drop={spec.drop:g})")


_UNMADE = object()  # EmulatedLinks: no emulator made for that peer yet


class EmulatedLinks:
    """The outgoing links of node `rank` as `table` emulates them: what every send (direct, relayed,
    forwarded) waits on before its real gRPC push. Used on the node's event-loop thread; at_step()
    (link bursts) comes from the training thread and swaps specs under a lock, so a send sees a
    link's spec before or after a step boundary, never half of it."""

    def __init__(self, table: LinkTable, rank: int, metrics=None):
        self.table = table
        self.rank = rank
        self.metrics = metrics
        self._emulators: dict[int, LinkEmulator | None] = {}  # per peer, made on first use
        self._waiting: set[asyncio.Task] = set()  # sends inside emulate(), cancelled by cancel()
        self._bursts = tuple(b for b in table.bursts if b.src == rank)  # this node's sending side only
        self._in_force: tuple[int, ...] = ()  # indexes of the bursts in force
        self._timed: dict[int, LinkSpec] = {}  # peer -> its spec while a burst is in force
        self._lock = threading.Lock()  # at_step vs an emulator's first use
        if self._bursts:
            self.at_step(0)

    @property
    def scheduled(self) -> bool:
        """Whether link bursts change this node's links at some steps (then call at_step)."""
        return bool(self._bursts)

    def at_step(self, step: int) -> None:
        """Put in force the link bursts of `step`, lift those that ended: call it at every step
        boundary (and where a node starts, at its first step). Thread-safe; cheap when nothing changes."""
        in_force = tuple(i for i, burst in enumerate(self._bursts) if step in burst.window)
        if in_force == self._in_force:
            return
        peers = {burst.dst for burst in self._bursts}
        timed = {peer: self.table.spec_at(self.rank, peer, step) for peer in {self._bursts[i].dst for i in in_force}}
        with self._lock:
            self._in_force, self._timed = in_force, timed
            for peer in peers:
                emulator = self._emulators.get(peer)
                if emulator is not None:  # keep its RNG stream and bucket: only what the link does changes
                    emulator.spec = self.spec(peer)
                else:
                    self._emulators.pop(peer, None)  # made again, for the new spec, on its next use

    def spec(self, peer: int) -> LinkSpec:
        """What link rank -> peer does now (its table spec, or a burst's while one is in force)."""
        timed = self._timed.get(peer)
        return timed if timed is not None else self.table.spec_for(self.rank, peer)

    def blocked(self, peer: int) -> bool:
        """Whether link rank -> peer is emulated as down now (known from the table, before any attempt)."""
        return self.spec(peer).blocked

    async def emulate(self, peer: int, nbytes: int, reliable: bool) -> None:
        """Wait as link rank -> peer would; every emulated loss is counted, and re-drawn if
        `reliable` (a retransmission pays for the link again). Raises MessageDropped (unreliable)
        or LinkUnreachable (blocked link)."""
        emulator = self._emulators.get(peer, _UNMADE)
        if emulator is _UNMADE:
            with self._lock:
                emulator = self._emulators.setdefault(peer, self.table.emulator(self.rank, peer, self.spec(peer)))
        task = asyncio.current_task()
        self._waiting.add(task)
        try:
            while emulator is not None:
                try:
                    return await emulator.transmit(nbytes)
                except MessageDropped:
                    if self.metrics is not None:
                        self.metrics.on_dropped(peer)
                    if not reliable:
                        raise
        finally:
            self._waiting.discard(task)

    def cancel(self) -> None:
        """At shutdown: cancel every send still waiting on a link, else it would die pending with the
        loop and its future would never be done."""
        for task in list(self._waiting):
            task.cancel()
