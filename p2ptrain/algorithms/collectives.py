"""Ring all-reduce (reduce-scatter + all-gather) over the node's Comm: an algorithm-side collective
(as in hivemind's averaging), so the transport never learns about codecs or segments.

The flat tensor is cut into n nearly equal segments. Reduce-scatter: in round r node i sends its
running sum of segment (i - r) mod n to i+1 and adds what i-1 sends it, so after n-1 rounds node i
owns the full sum of segment (i+1) mod n. All-gather: n-1 more rounds pass the finished segments
around the ring. Small rings take each phase in one hop (segments straight to and from their owner,
summed in the ring's order). Each node sends 2(n-1)/n of the tensor, bandwidth-optimal (seed 004).

Invariants: all nodes end with bit-identical results, a lossy codec's too; with error feedback the
sum out plus every node's residual is the sum in (to float rounding). Never: a call completes on a
ring its members disagree on, or the caller writes the tensor before the call returns (see _ring).
"""
from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import TYPE_CHECKING

from p2ptrain import compression
from p2ptrain.algorithms.base import Comm, Kind, buffer_like, delivery_failure

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

KIND = Kind.ALLREDUCE
# A predecessor heard more than this many steps past a call's step has given that step up (its
# Acks and Hellos may run ahead of its rings by their delay: overlap 1, Pipe-SGD's one-step-stale
# ring; RingAllReduce(delay=) raises it, e.g. Streaming DiLoCo's τ)
AHEAD_SLACK = 3
DEFAULT_CHUNK_KB = 0  # measured in bench peers: see the README's pipelined-ring paragraph
# Rings of at most this many members finish the all-gather in one round: each owner sends its finished
# segment to every member at once (the bytes each node sends are the ring's; m-1 hops of latency fewer)
DIRECT_GATHER_MAX = 8
CHUNK_KB_HELP = ("pipeline the ring all-reduce: cut each segment into chunks of this many KiB, forwarded hop to "
                 "hop as each arrives; 0 = one message per segment")


def segment_bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    """[start, end) of each of `parts` nearly equal consecutive segments."""
    edges = [k * numel // parts for k in range(parts + 1)]
    return list(zip(edges[:-1], edges[1:]))


def chunk_bounds(start: int, end: int, chunk_numel: int) -> list[tuple[int, int]]:
    """[start, end) cut into nearly equal chunks of at most `chunk_numel` elements (one if 0)."""
    parts = max(1, -(-(end - start) // chunk_numel)) if chunk_numel > 0 else 1
    return [(start + a, start + b) for a, b in segment_bounds(end - start, parts)]


def codec_and_dtype(codec, dtype):
    """A ring collective's codec (a Codec, its name, or None: none) and dtype (None: float32)."""
    codec = codec if isinstance(codec, compression.Codec) else compression.get_codec(codec or "none")
    if dtype is None:
        import torch  # (here, not at import: the algorithm registry loads without torch)

        dtype = torch.float32
    return codec, dtype


def ring_order(members, placed: tuple[int, ...]) -> tuple[int, ...]:
    """`members` in the order of the step's placement `placed` (Members.placed: private peers
    behind different NATs are no neighbours), any not in it after them by rank."""
    members = set(int(m) for m in members)
    first = [m for m in placed if m in members]
    return tuple(first + sorted(members.difference(first)))


class CollectiveIncomplete(TimeoutError):
    """A collective could not complete (a peer missed the link deadline, refused, or is dead)."""


class RingLayout:
    """Who is where on one ring: `members` in ring order (ring_order), this node at `position`; segment k is
    flat[bounds[k]], sent as the chunks chunks[k] (absolute [start, end) ranges). `direct`: a ring of
    at most DIRECT_GATHER_MAX members exchanges with owners in one hop (RingAllReduce)."""

    def __init__(self, members: tuple[int, ...], rank: int, numel: int, chunk_numel: int = 0,
                 direct_gather: bool = False):
        self.members, self.m = members, len(members)
        self.direct = direct_gather and self.m <= DIRECT_GATHER_MAX
        self.position = members.index(rank)
        self.bounds = segment_bounds(numel, self.m)
        self.chunks = [chunk_bounds(start, end, chunk_numel) for start, end in self.bounds]
        self.messages = 2 * sum(len(self.chunks[self.rs_send(r)]) for r in range(self.m - 1))  # sent per call
        self.next = members[(self.position + 1) % self.m]
        self.prev = members[(self.position - 1) % self.m]

    # Which segment moves where in round r
    def rs_send(self, r: int) -> int:
        return (self.position - r) % self.m

    def rs_recv(self, r: int) -> int:
        return (self.position - r - 1) % self.m

    def ag_send(self, r: int) -> int:
        return (self.position + 1 - r) % self.m

    def ag_recv(self, r: int) -> int:
        return (self.position - r) % self.m

    def owned(self) -> int:
        """The segment this node finishes in reduce-scatter: (position + 1) mod m."""
        return (self.position + 1) % self.m

    def owner(self, segment: int) -> int:
        """The member that finishes `segment` in reduce-scatter (at position segment - 1)."""
        return self.members[(segment - 1) % self.m]

    def ag_round_at(self, member: int, segment: int) -> int:
        """The all-gather round in which `member` receives `segment` (ag_recv at its position)."""
        return (self.members.index(member) - segment) % self.m


class RingAllReduce:
    """All-reduce of one fixed-size flat tensor on the ring i -> i+1; declare before comm.ready().

    With a lossy codec every reduce-scatter hop decompresses, sums and recompresses (seed 004 §3.2);
    an owner compresses its finished segment once and the all-gather forwards those bytes untouched,
    and the owner adopts the decoded value itself, so all nodes end with bit-identical results.
    Error feedback (`residual=`): every point where this node compresses (one reduce-scatter hop per
    segment, and its owned segment) writes what it lost into the caller's residual, so the sum that
    comes out plus every node's residual is exactly the sum that went in (to float rounding).

    Every round has its own channel, so the receiver knows the exact size of each segment (and
    accepts only this ring's codec, in the layout compression.py gives it) and the mailbox never
    mixes rounds; the step number keeps consecutive all-reduces apart.

    Pipelining (`chunk_bytes`): each segment is cut into chunks of about that many bytes, each its
    own message on its own channel. The segment a node receives in round r is the one it sends in
    round r+1, so it forwards chunk c as soon as chunk c has arrived and been summed, while chunk
    c+1 is still on the wire: hops overlap, and a ring of m nodes takes about (m-1 + chunks-1) chunk
    times per phase instead of (m-1) segment times. Each element is summed in the same order either
    way, so without a lossy codec the result is bit-identical to the unpipelined ring's.

    Small rings (`direct_gather`, the default, up to DIRECT_GATHER_MAX members) take each phase in
    one hop. Reduce-scatter sends every segment this node does not own straight from the tensor to
    its owner, who adds the contributions in the ring's order (so the sum has the ring's bits; a
    lossy codec keeps the ring's recompressing hops); the all-gather sends each owner's finished
    segment, compressed once, to every member. The same messages and bytes per node as the ring, two
    hops of latency instead of 2(m-1); every member then talks to every other, hence the bound.

    Re-forming the ring (`elastic=True`): a call may name its `members` (the caller passes itself
    and `comm.membership.live(...)` peers): the ring is those ranks in the step's placement order
    (ring_order: rank order unless private peers were placed apart), cut into len(members)
    segments. Channels are then named by ring size and segment, declared for every size up front,
    so a segment always arrives with its exact size whoever forwards it. Members must agree on the
    member list: a node with another view waits on channels nobody sends on and the call fails on
    every node (it never completes on a wrong ring: each segment of an m-ring is one
    channel). A failed call throws away, at the next call, the segments of earlier steps that arrive
    late."""

    def __init__(self, comm: Comm, numel: int, dtype: torch.dtype | None = None, *,
                 codec: compression.Codec | str | None = None, tag: str = "", kind: int = KIND,
                 elastic: bool = False, chunk_bytes: int = 0, delay: int = 0, direct_gather: bool = True):
        self.comm = comm
        self.direct_gather = direct_gather
        # steps a node's other messages of this kind may run ahead of this ring's calls (Streaming
        # DiLoCo: the next fragment's versions while a sync still runs τ steps)
        self.delay = delay
        self.hops = RingHops(comm, kind, elastic=elastic, delay=delay)
        self.rank, self.n = comm.rank, comm.world_size
        self.numel = numel
        self.codec, self.dtype = codec_and_dtype(codec, dtype)
        dtype = self.dtype
        self.chunk_numel = chunk_bytes // dtype.itemsize if chunk_bytes > 0 else 0
        self._failed_at: int | None = None  # step of the last incomplete round
        self._backup: torch.Tensor | None = None  # the input, to restore on failure (one buffer, reused)
        self._forward: dict[tuple, torch.Tensor] = {}  # (members, round, chunk) -> compressed all-gather forward
        self._sums: torch.Tensor | None = None  # an owner's partial sums (_scatter_to_owners)
        self.tag, self.kind = tag, kind
        self.elastic = elastic
        self._full = RingLayout(tuple(range(self.n)), self.rank, numel, self.chunk_numel, direct_gather)
        self._last_members: tuple[int, ...] = self._full.members
        self.bounds = self._full.bounds
        self.next, self.prev = self._full.next, self._full.prev
        if elastic:  # every ring size, segment and chunk: ring re-formation needs no new declaration
            for m in range(2, self.n + 1):
                for segment, (start, end) in enumerate(segment_bounds(numel, m)):
                    for c, (a, b) in enumerate(chunk_bounds(start, end, self.chunk_numel)):
                        for phase in ("rs", "ag"):
                            comm.expect(kind, dtype, b - a, channel=self._channel(m, phase, 0, segment, c),
                                        codecs=self._layout(b - a), preallocate=2 if m == self.n else 0)
        else:
            for r in range(self.n - 1):  # the segment node `rank` receives in each round
                for phase, segment in (("rs", self._full.rs_recv(r)), ("ag", self._full.ag_recv(r))):
                    for c, (a, b) in enumerate(self._full.chunks[segment]):
                        comm.expect(kind, dtype, b - a, channel=self._channel(self.n, phase, r, segment, c),
                                    codecs=self._layout(b - a))

    def _layout(self, numel: int) -> dict[int, tuple[int, int]]:
        """What a segment of `numel` elements arrives as: this ring's codec, with its exact payload
        bytes and number of codec params."""
        codec = self.codec
        return {codec.wire_id: (codec.payload_bytes(numel, self.dtype), codec.param_count)}

    def _channel(self, m: int, phase: str, r: int, segment: int, chunk: int) -> str:
        return f"{self.tag}{m}.{phase}{segment}.{chunk}" if self.elastic else f"{self.tag}{phase}{r}.{chunk}"

    @property
    def messages_per_call(self) -> int:
        """Messages this node sends in one call over the full ring (2 rounds x chunks per segment)."""
        return self._full.messages

    # The collective -------------------------------------------------------------------------------
    def __call__(self, tensor: torch.Tensor, step: int, *, average: bool = True, members=None,
                 residual: torch.Tensor | None = None, deadline: float | None = None,
                 restore: bool = True, out: torch.Tensor | None = None) -> torch.Tensor:
        """Sum (or mean) of `tensor` over the ring's members, written into `out` (default: `tensor`
        itself, in place) and returned.

        `members` (elastic rings only): the ranks to reduce over, this node among them (default:
        all). `deadline`: how long each segment is waited for (default: the link deadline).
        `residual` (sums only): tensor of the same size that receives what this node's
        compressions lost (error feedback; zeros without a lossy codec).

        `out`: the sums are built there and `tensor` is only read, so nothing needs restoring after
        a failure (`out` then holds partial sums) and no backup of the input is taken.
        `restore=False` (in place): the caller keeps its own copy of the input (gradient buckets
        reduce a scratch copy), so `tensor` is not backed up and holds partial sums after a failure.

        When the call returns, completed or not, the transport no longer reads `tensor` or `out`
        (the sends are made straight from them: see "Zero-copy sends" in _ring).

        Raises CollectiveIncomplete, with `tensor` and `residual` restored, when a ring neighbour's
        segment misses the link deadline or a node is dead (callers fall back to their local value
        for this step and the next call tries again; an elastic caller passes the live members)."""
        if tensor.numel() != self.numel or tensor.dtype != self.dtype:
            raise ValueError(f"all-reduce declared for {self.numel} x {self.dtype}, "
                             f"got {tensor.numel()} x {tensor.dtype}")
        if out is not None and (out.numel() != self.numel or out.dtype != self.dtype):
            raise ValueError(f"all-reduce output must be {self.numel} x {self.dtype}, got {out.numel()} x {out.dtype}")
        if residual is not None and (average or residual.numel() != self.numel):
            raise ValueError("a residual is kept for sums (average=False) of the declared size only")
        in_place = out is None or out is tensor
        out = tensor if out is None else out
        ring = self._ring_of(members, step)
        if ring.m == 1:
            if residual is not None:
                residual.zero_()
            return out if in_place else out.copy_(tensor)
        catching_up = self._failed_at is not None
        if catching_up or ring.members != self._last_members:
            self._discard_through(step - 1)  # segments of a failed or re-formed ring may still come
        self._last_members = ring.members
        if not self.elastic and not self.comm.membership.all_alive():
            self._failed_at = step
            raise CollectiveIncomplete(f"node {self.rank}: all-reduce of step {step} skipped: a node is dead")
        if not self.comm.make_room(ring.next, ring.messages):  # a stalled neighbour holds our last round
            self._failed_at = step
            raise CollectiveIncomplete(f"node {self.rank}: all-reduce of step {step} skipped: node {ring.next} "
                                       "acknowledges nothing")
        original = None
        if restore and in_place:
            if self._backup is None:
                self._backup = buffer_like(tensor)
            original = self._backup.copy_(tensor)
        kept = residual.clone() if residual is not None else None
        acks: list[concurrent.futures.Future] = []
        try:
            self._ring(tensor.view(-1), out.view(-1), step, average, ring, residual, acks, deadline, catching_up)
            return out
        except CollectiveIncomplete:
            self.hops.fence(acks, ring.next)
            if original is not None:
                tensor.copy_(original)
            if residual is not None:
                residual.copy_(kept)
            self._failed_at = step
            raise

    def reduce_or_keep(self, tensor: torch.Tensor, step: int, *, average: bool = True,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        """The all-reduce (into `out` if given), or `tensor` unchanged when it cannot complete (a
        dropped link costs this step's averaging, never the run)."""
        try:
            return self(tensor, step, average=average, out=out)
        except CollectiveIncomplete as exc:
            log.warning("%s; keeping the local value for this step", exc)
            return tensor

    def _ring_of(self, members, step: int) -> RingLayout:
        if members is None:
            return self._full
        members = ring_order(members, self.comm.membership.placed(step))
        if members == self._full.members:
            return self._full
        if not self.elastic:
            raise ValueError("only an elastic ring (elastic=True) is re-formed over other members")
        if self.rank not in members or not all(0 <= m < self.n for m in members):
            raise ValueError(f"members {list(members)} must be ranks of this cluster, node {self.rank} among them")
        return RingLayout(members, self.rank, self.numel, self.chunk_numel, self.direct_gather)

    def _discard_through(self, step: int) -> None:
        if self.elastic:
            channels = [self._channel(m, phase, 0, segment, c) for m in range(2, self.n + 1)
                        for segment, (start, end) in enumerate(segment_bounds(self.numel, m))
                        for c in range(len(chunk_bounds(start, end, self.chunk_numel))) for phase in ("rs", "ag")]
        else:
            channels = [self._channel(self.n, phase, r, segment, c) for r in range(self.n - 1)
                        for phase, segment in (("rs", self._full.rs_recv(r)), ("ag", self._full.ag_recv(r)))
                        for c in range(len(self._full.chunks[segment]))]
        self.hops.discard_through(step, channels)
        self._failed_at = None

    def _encode(self, segment: torch.Tensor, residual: torch.Tensor | None):
        """(encoded, decoded or None): with a residual, what the encoding lost goes into it."""
        if residual is None:
            return self.codec.encode(segment), None
        return compression.encode_with_feedback(self.codec, segment, residual)

    def _ring(self, source: torch.Tensor, flat: torch.Tensor, step: int, average: bool, ring: RingLayout,
              residual: torch.Tensor | None, acks: list[concurrent.futures.Future], deadline: float | None = None,
              catching_up: bool = False) -> None:
        """The ring on flat views: `source` is read, the sums are built in `flat` (the same tensor
        in place); every send's future goes into `acks`.

        Zero-copy sends: without a lossy codec a message's payload is the tensor itself, flat[a:b],
        which the transport reads until the peer acknowledges it; nothing is copied into send
        buffers and no send buffer is kept. That is safe because the ring's causality keeps every
        segment unwritten until its send has been received. Node i (ring position) writes only on
        receipt, and:
        - reduce-scatter round r sends segment i-r and adds what comes in to segment i-r-1, which it
          sends in round r+1: each of the segments i-1, ..., i-(m-1) is written once, before it is
          sent; segment i is never written there, and the owned segment i+1 (averaged in place) is
          sent only after.
        - all-gather round r overwrites segment i-r, the one sent in reduce-scatter round r, with
          its finished sum. That sum was completed after node i+1 added node i's round-r message
          into it, so the overwrite comes after that send was received. The owned segment is not
          overwritten.
        - all-gather round r+1 forwards segment i-r from the tensor, written in round r; the
          all-gather writes each segment once, so nothing rewrites it. (A compressed chunk is
          forwarded as received, from a copy: the pooled buffer it arrived in goes back at once.)
        - one hop each (RingLayout.direct): reduce-scatter sends only `source`, never written; in
          place, a segment this node does not own is overwritten only by its owner's sum, which
          needs this node's contribution to it, so that send was received first.
        A retried send may read a segment again after the peer has it: that copy is answered
        DUPLICATE and dropped. With `out=`, the sums are built in `out` and the input is only read:
        the same argument holds for `out`. Before a call returns, each send has been acknowledged
        or, if the call failed, has settled (the fence, instead of copies): the caller may then
        write the tensor, and a peer that still completes its own call with a late message gets the
        values it was sent with."""
        import torch  # (here, not at import: the algorithm registry loads without torch)

        # Falling back into step: when a round fails, each node gives up a link deadline after the
        # one before it stopped sending, so the last to give up is up to (m-1) deadlines behind the
        # first. If the next call waited only one deadline for its first segment, the node ahead
        # would give up on its laggard predecessor, start the same cascade, and every round would
        # fail from then on. So the first segment after a failed call is awaited m link deadlines
        # (or the call's own deadline, if longer); later ones one.
        link_deadline = self.comm.link_deadline
        first_deadline = max(deadline or link_deadline, ring.m * link_deadline) if catching_up else deadline
        lost = (lambda a, b: residual.view(-1)[a:b]) if residual is not None else (lambda a, b: None)  # noqa: E731
        failures: list[str] = []  # why sends of this call failed (their futures' callbacks note it)

        def sent(future: concurrent.futures.Future) -> None:
            self.hops.watch(future, acks, failures)

        def hopeless_from(sender: int):
            return lambda: self.hops.hopeless(ring.members, sender, step, failures)

        hopeless = hopeless_from(ring.prev)

        coming = self.hops.approach(ring.members, ring.prev, step)

        def push(values: torch.Tensor, phase: str, r: int, segment: int, c: int, a: int, b: int) -> None:
            """Encode values[a:b] (with error feedback) and send it as chunk c of (phase, round r):
            uncompressed, the payload is values[a:b] itself."""
            encoded, _ = self._encode(values[a:b], lost(a, b))
            sent(self._send(ring, encoded.payload, encoded.codec, encoded.params, step, phase, r, segment, c))

        def finish(c: int, a: int, b: int) -> None:  # a chunk of the owned segment is final: it starts the all-gather
            self._finish_owned(flat, a, b, ring, average, lost(a, b), acks, step, c)

        if ring.direct and self.codec.wire_id == compression.UNCOMPRESSED:  # one hop: every segment to its owner
            if residual is not None:
                residual.zero_()  # (a lossless codec loses nothing: as each hop of the ring writes)
            for c, a, b in self._scatter_to_owners(source, step, ring, sent, hopeless_from, coming,
                                                   first_deadline, deadline, flat):
                finish(c, a, b)
        else:  # m-1 hops: decompress, sum, recompress at every hop
            first = ring.rs_send(0)
            for c, (a, b) in enumerate(ring.chunks[first]):
                push(source, "rs", 0, first, c, a, b)  # this node's own values, never written by the call
            for r in range(ring.m - 1):
                segment = ring.rs_recv(r)  # = rs_send(r + 1): each summed chunk goes on at once
                for c, (a, b) in enumerate(ring.chunks[segment]):
                    received = self._recv(ring, step, "rs", r, segment, c,
                                          first_deadline if r == c == 0 else deadline, hopeless, coming)
                    torch.add(source[a:b], self._decode(received, b - a), out=flat[a:b])
                    received.release()
                    if r < ring.m - 2:
                        push(flat, "rs", r + 1, segment, c, a, b)
                    else:
                        finish(c, a, b)

        for r in range(ring.m - 1):  # all-gather: finished chunks travel on (or come from their owner), bytes untouched
            segment = ring.ag_recv(r)  # = ag_send(r + 1)
            sender = ring.owner(segment) if ring.direct else ring.prev
            for c, (a, b) in enumerate(ring.chunks[segment]):
                received = self._recv(ring, step, "ag", r, segment, c, deadline, hopeless_from(sender), coming,
                                      sender)
                flat[a:b].copy_(self._decode(received, b - a))
                if r < ring.m - 2 and not ring.direct:  # forward: uncompressed from flat[a:b], never written again
                    payload = flat[a:b] if received.codec == compression.UNCOMPRESSED else \
                        self._buffer(ring, r + 1, c, received.tensor).copy_(received.tensor)
                    sent(self._send(ring, payload, received.codec, received.codec_params, step, "ag",
                                    r + 1, segment, c))
                received.release()
        self.hops.check(acks, ring.next)

    def _scatter_to_owners(self, source: torch.Tensor, step: int, ring: RingLayout, sent, hopeless_from, coming,
                           first_deadline: float | None, deadline: float | None, flat: torch.Tensor):
        """Reduce-scatter in one hop (lossless rings of at most DIRECT_GATHER_MAX): each segment this
        node does not own goes from `source` straight to its owner, and the owner adds what comes in
        in the ring's order (positions owned, owned + 1, ..., its own values last), so the sum has
        the ring's bits. Yields (chunk, start, end) of the owned segment as each chunk is summed
        into `flat`. The same messages and bytes as the ring's m-1 hops; one hop of latency."""
        import torch

        for segment in range(ring.m):
            owner = ring.owner(segment)
            if owner == self.rank:
                continue
            for c, (a, b) in enumerate(ring.chunks[segment]):
                sent(self._send(ring, source[a:b], compression.UNCOMPRESSED, (), step, "rs", ring.m - 2, segment, c,
                                to=owner))
        owned = ring.owned()
        senders = [ring.members[(owned + k) % ring.m] for k in range(ring.m - 1)]  # the ring's order of addition
        for c, (a, b) in enumerate(ring.chunks[owned]):
            partial = None
            for k, sender in enumerate(senders):
                received = self._recv(ring, step, "rs", ring.m - 2, owned, c,
                                      first_deadline if k == c == 0 else deadline, hopeless_from(sender), coming,
                                      sender)
                values = received.tensor.view(-1)
                partial = self._partial(b - a).copy_(values) if partial is None else partial.add_(values)
                received.release()
            torch.add(partial, source[a:b], out=flat[a:b])
            yield c, a, b

    def _partial(self, numel: int) -> torch.Tensor:
        """Where an owner sums its segment's contributions before adding its own (one buffer, reused)."""
        if self._sums is None or self._sums.numel() < numel:
            import torch

            self._sums = torch.empty(numel, dtype=self.dtype)
        return self._sums[:numel]

    def _finish_owned(self, flat: torch.Tensor, a: int, b: int, ring: RingLayout, average: bool,
                      lost: torch.Tensor | None, acks: list, step: int, c: int) -> None:
        """Chunk c of the owned segment holds the full sum: average it, compress it once, adopt the
        value everybody else will decode, and send it as the all-gather's first round."""
        owned = flat[a:b]
        if average:
            owned.div_(ring.m)
        encoded, decoded = self._encode(owned, lost)
        if encoded.codec != compression.UNCOMPRESSED:
            if decoded is None:
                decoded = self.codec.decode(encoded.payload, encoded.params, owned.shape, owned.dtype)
            owned.copy_(decoded)
        segment = ring.owned()
        for peer in ring.members[ring.position + 1:] + ring.members[:ring.position] if ring.direct else (ring.next,):
            acks.append(self._send(ring, encoded.payload, encoded.codec, encoded.params, step, "ag",
                                   ring.ag_round_at(peer, segment), segment, c, to=peer))

    def _buffer(self, ring: RingLayout, r: int, c: int, like: torch.Tensor) -> torch.Tensor:
        """The buffer a compressed all-gather chunk is forwarded from (round r, chunk c), reused
        from call to call (every send has settled when a call returns): its bytes must outlive the
        pooled receive buffer they came in, which goes back at once."""
        key = (ring.members, r, c)
        buffer = self._forward.get(key)
        if buffer is None or buffer.numel() != like.numel() or buffer.dtype != like.dtype:
            buffer = self._forward[key] = buffer_like(like.view(-1))
        return buffer

    def _recv(self, ring: RingLayout, step: int, phase: str, r: int, segment: int, c: int,
              deadline: float | None = None, hopeless=None, coming=None, sender: int | None = None):
        return self.hops.receive(ring.prev if sender is None else sender, step,
                                 self._channel(ring.m, phase, r, segment, c),
                                 f"all-reduce segment ({phase} round {r})", deadline, hopeless, coming)

    def _send(self, ring: RingLayout, payload: torch.Tensor, codec_id: int, params: tuple[float, ...], step: int,
              phase: str, r: int, segment: int, c: int, to: int | None = None) -> concurrent.futures.Future:
        a, b = ring.chunks[segment][c]
        numel = b - a
        return self.comm.send(ring.next if to is None else to, payload, kind=self.kind, step=step,
                              channel=self._channel(ring.m, phase, r, segment, c), codec=codec_id, codec_params=params,
                              dtype=self.dtype, numel=numel, shape=(numel,), reliable=True)

    def _decode(self, received, numel: int) -> torch.Tensor:
        if received.codec == compression.UNCOMPRESSED:
            return received.tensor.view(-1)
        codec = compression.get_codec(received.codec)
        return codec.decode(received.tensor, received.codec_params, (numel,), self.dtype)

class Approach:
    """Whether a ring that is out of step is coming together at this call's step: another member
    was heard two or more steps behind it, a member was heard at a later step up to this one within
    `patience` seconds (a call's first deadline: members behind skip steps their predecessor gave
    up at once, so they move faster than that; before any move is seen, one more deadline), and
    the predecessor has not gone past this step. A node ahead then waits rather than give the step
    up: giving up kept a ring out of step for good, each node failing every step at its own step
    number (a rejoiner admitted at a switch that the others reached minutes later). A ring in step
    (members at most one step apart, a ring's jitter) and a lost message (nobody moves) still give
    a step up after the deadline, as before. Fault-free the segments arrive first and this is never
    asked (only its baseline, m dictionary reads, is taken per call)."""

    def __init__(self, prev: int, peers: list[int], step: int, membership, *, patience: float):
        self.prev, self.step, self.membership, self.patience = prev, step, membership, patience
        self.last = {peer: self._heard(peer) for peer in peers}
        self.out_of_step = False
        self.moved_at: float | None = None
        self.looked = False

    def __call__(self) -> bool:
        now = time.monotonic()
        for peer, before in self.last.items():
            seen = self._heard(peer)
            if seen is not None and seen < self.step - 1:
                self.out_of_step = True
            if before is not None and seen is not None and before < seen <= self.step:
                self.moved_at = now
            self.last[peer] = seen
        prev = self.last.get(self.prev)
        if not self.out_of_step or (prev is not None and prev > self.step):
            return False
        if self.moved_at is None:  # none seen moving yet: one more deadline to see one move, once
            first, self.looked = not self.looked, True
            return first
        return now - self.moved_at < self.patience

    def _heard(self, peer: int) -> int | None:
        """`peer`'s step, heard since this node was one step before the call's (older news says
        nothing about where it is now)."""
        return self.membership.peer_step(peer, heard_since=self.step - 1)


def note_failure(future: concurrent.futures.Future, failures: list[str]) -> None:
    failure = delivery_failure(future)
    if failure is not None:
        failures.append(f"a message of this call {failure}")  # (to its successor, or an owner)


class RingHops:
    """What every ring collective does at each hop, whatever it sends (RingAllReduce's segments,
    RingAllGather's payloads): wait for the predecessor's message on a channel, awaiting a lagging
    member but giving up at once when the call cannot complete (hopeless), note why its own sends
    failed, and fence them when a call fails. `what` names the collective in its errors; `delay`:
    steps a node's other messages of this kind may run ahead of its calls (see RingAllReduce)."""

    def __init__(self, comm: Comm, kind: int, *, elastic: bool, delay: int = 0, what: str = "all-reduce"):
        self.comm, self.kind, self.elastic, self.what = comm, kind, elastic, what
        self.rank = comm.rank
        # its current step runs ahead by up to the bounded delay besides (overlapped rounds), hence the slack
        self.delay = delay
        self.ahead_slack = max(AHEAD_SLACK, delay + 2)

    def approach(self, members: tuple[int, ...], prev: int, step: int) -> Approach:
        """This call's watch on a ring that is out of step (see Approach)."""
        return Approach(prev, [p for p in members if p != self.rank], step, self.comm.membership,
                        patience=len(members) * self.comm.link_deadline)

    def watch(self, future: concurrent.futures.Future, acks: list[concurrent.futures.Future],
              failures: list[str]) -> None:
        """A send of this call: its future goes into `acks`, why it failed (if it does) into `failures`."""
        future.add_done_callback(lambda done: note_failure(done, failures))
        acks.append(future)

    def receive(self, prev: int, step: int, channel: str, label: str, deadline: float | None = None,
                hopeless=None, coming=None):
        """The step-`step` message of `channel` from `prev` (`label` says what it is in the error);
        raises CollectiveIncomplete when it misses the deadline or the call is hopeless."""
        # a lagging member is awaited too: the ring cannot complete without it, and a node that
        # skipped it at once would race ahead alone and leave it further behind
        got = self.comm.gather(self.kind, step, [prev], channel=channel, deadline=deadline, abandon=hopeless,
                               laggards=True)
        while prev not in got and coming is not None and (hopeless is None or hopeless() is None) and coming():
            got = self.comm.gather(self.kind, step, [prev], channel=channel, abandon=hopeless, laggards=True)
        if prev not in got:
            reason = hopeless() if hopeless is not None else None
            raise CollectiveIncomplete(f"node {self.rank}: step-{step} {label} from node {prev} " +
                                       (f"not awaited: {reason}" if reason else "missed the link deadline"))
        return got[prev]

    def hopeless(self, members: tuple[int, ...], prev: int, step: int, failures: list[str]) -> str | None:
        """Why this call's ring cannot complete, known before any deadline: a send of it failed, a
        member is dead, or (elastic) a newer view drops a member without its say. None while it may
        (always, without faults: the wait then ends only by arrival or deadline)."""
        if failures:
            return failures[0]
        dead = self.comm.membership.dead().intersection(members)
        if dead:
            return f"node(s) {sorted(dead)} of the ring are dead"
        asking = self.comm.membership.asking_for_state().intersection(members)
        if asking:  # (they wait for this node's next step boundary: waiting for them stalls both)
            return f"node(s) {sorted(asking)} of the ring gave their state up and wait for this node's"
        dropped = self.comm.membership.departing(step).intersection(members) if self.elastic else ()
        if dropped:
            return f"a newer view drops node(s) {sorted(dropped)}"
        split = self.comm.membership.split_members(step) if self.elastic else None
        if split is not None and split != members:
            return f"nodes that took a view this node refused train over members {list(split)} at this step"
        # the predecessor gave this step up: catch up rather than wait. Its ring messages say so
        # exactly (calls run one after another, each until its sends are acknowledged: one of a
        # later call means this one is over there); its Acks and Hellos, its current step, only
        # past the slack
        sent = self.comm.membership.sent_step(prev, self.kind)
        if sent is not None and sent > step + self.delay:
            return f"node {prev} already runs the {self.what} of step {sent}"
        ahead = self.comm.membership.peer_step(prev)
        if ahead is not None and ahead > step + self.ahead_slack:
            return f"node {prev} is already at step {ahead}"
        # ... and exactly once it reached a view's switch past this step's bounded delay: a member
        # drains its rounds in flight before it starts a switch step (Algorithm.members_changed),
        # so it runs none of an earlier step from there on. (Nodes on either side of a refused
        # eviction reach the switch that ends it at different steps: those behind would otherwise
        # wait out a deadline at each step short of the slack, tens of seconds in a chaos run.)
        switch = self.comm.membership.first_switch(step + self.delay, ahead) \
            if self.elastic and ahead is not None else None
        if switch is not None:
            return f"node {prev} is already at step {ahead}, past the view switch at step {switch}"
        return None

    def check(self, acks: list[concurrent.futures.Future], next_peer: int) -> None:
        """Wait for every send of the call; raises CollectiveIncomplete if one was not delivered."""
        for future in acks:
            failure = delivery_failure(future)
            if failure is not None:
                raise CollectiveIncomplete(f"node {self.rank}: {self.what} message to node {next_peer} {failure}")

    def fence(self, acks: list[concurrent.futures.Future], next_peer: int) -> None:
        """A failed call waits until each of its sends has settled before anything is restored or
        rewritten: they read the caller's tensors (no copies), and a peer that still completes its
        call with them must get the values they were sent with. Each send ends by its transport
        deadline at the latest (a stalled neighbour: the send timeout)."""
        pending = [future for future in acks if not future.done()]
        if not pending:
            return
        began = time.monotonic()
        concurrent.futures.wait(pending)
        waited = time.monotonic() - began
        if waited > self.comm.link_deadline:
            log.warning("node %d: a failed %s waited %.1f s for %d message(s) to node %d to settle",
                        self.rank, self.what, waited, len(pending), next_peer)

    def discard_through(self, step: int, channels) -> None:
        """Throw away the messages of steps <= `step` on `channels`: segments or payloads of a
        failed or re-formed ring that may still come."""
        for channel in channels:
            for stale in self.comm.take(self.kind, step, channel=channel):
                stale.release()


