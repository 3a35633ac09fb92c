"""Receiving side of the transport: header validation, pooled receive buffers, mailboxes.

Everything here except `BufferPool.release` and `Inbox.holds` (a read-only look, from any thread)
runs on the node's event-loop thread. A tensor message goes through `open()` (validate the
header, count the reception), `Reception.write()` per chunk (straight into a pooled buffer,
taken at the first data chunk; the TCP lane reads into `Reception.space()` instead), then
`deliver()`; any failure rejects the whole message and leaves mailbox state untouched, so a
broken or hostile stream can never half-apply. Exactly once: a message id counts as received only
when `deliver()` has put it in the mailbox, and DUPLICATE is never said of an id that is merely in
flight (Inbox.deliver). Open receptions are capped (Inbox).
"""
from __future__ import annotations

import asyncio
import math
import threading
import time
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Mapping
from typing import Callable, Protocol

import torch

from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.large_pages import host_buffer
from p2ptrain.transport.framing import torch_dtype
from p2ptrain.transport.message import Message
from p2ptrain.transport.validation import (
    ChannelSpec,
    CodecLayout,
    Rejection,
    all_finite,
    peak_magnitude,
    validate_header,
)

# A channel declared without `codecs` accepts raw tensors and, for a floating dtype, the proto's
# fixed-rate codecs of seed 004: codec -> (bytes per element, codec params); the others (fp16, bf16, int4,
# top-k) only where a channel declares them. compression.py implements them;
# tests/test_compression.py pins these numbers to it.
MASS_TRANSFERS = (pb.MESSAGE_KIND_STATE, pb.MESSAGE_KIND_LEAVE)  # taken at any step: no step window
FIXED_RATE_CODECS = {pb.CODEC_TRUNC16: (2, 0), pb.CODEC_INT8_QUANTIZE: (1, 1)}


class BufferPool:
    """Reusable byte buffers keyed by size, pinned when CUDA is in use (fast async H2D copies),
    else on 2 MiB pages where large (large_pages.py)."""

    def __init__(self, pin_memory: bool = False, max_free_per_size: int = 8):
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self.max_free_per_size = max_free_per_size
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._lock = threading.Lock()  # release() may come from the training thread

    def preallocate(self, nbytes: int, count: int) -> None:
        with self._lock:
            while len(self._free[nbytes]) < min(count, self.max_free_per_size):
                self._free[nbytes].append(self._allocate(nbytes))

    def acquire(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                return free.pop()
        return self._allocate(nbytes)

    def release(self, buffer: torch.Tensor) -> None:
        with self._lock:
            free = self._free[buffer.numel()]
            if len(free) < self.max_free_per_size:
                free.append(buffer)

    def _allocate(self, nbytes: int) -> torch.Tensor:
        if self.pin_memory:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return host_buffer(nbytes)  # 2 MiB pages: the socket's copy into it walks 512x fewer


class Reception:
    """One message being received: chunks are written at increasing offsets into a byte buffer
    that `allocate(payload_bytes)` supplies at the first data chunk, so a stream that sent only
    its header holds no payload memory. The owner (Inbox, the parameter server) gives it back."""

    def __init__(self, header: pb.TensorHeader, allocate: Callable[[int], torch.Tensor]):
        self.header = header
        self.opened = time.monotonic()  # its header arrived (Message.arrived_since)
        self.buffer: torch.Tensor | None = None
        self.received = 0
        self.scanned = 0          # payload bytes already checked for NaN / Inf (Inbox.scan)
        self.finite = True        # ... and whether they were all finite
        self.peak: float | None = None  # ... and their max |v|, where the channel measures it (ChannelSpec.peak)
        self._allocate = allocate
        self._view = memoryview(b"")

    def write(self, data: memoryview) -> None:
        """Copy a received chunk in (gRPC: the chunk already sits in grpcio's memory)."""
        self._check_room(len(data))
        self.space()[:len(data)] = data
        self.received += len(data)

    def space(self) -> memoryview:
        """The part of the buffer still to fill, for a socket to read straight into (the TCP lane,
        lane_server.py); call filled() with what it read. Takes the buffer now if none was yet."""
        if self.buffer is None:
            self.payload()
        return self._view[self.received:]

    def filled(self, nbytes: int) -> None:
        """`nbytes` more bytes were read into space()."""
        self._check_room(nbytes)
        self.received += nbytes

    def _check_room(self, nbytes: int) -> None:
        if self.received + nbytes > self.header.payload_bytes:
            raise Rejection("payload_overflow", f"stream carries more than the announced "
                                                f"{self.header.payload_bytes} bytes")

    def complete(self) -> bool:
        return self.received == self.header.payload_bytes

    def check(self, values: torch.Tensor) -> None:
        """Scan the next received `values` for NaN / Inf; where the peak is measured, that pass
        (max |v|, inf for a NaN or Inf) is the check, done while the bytes are still in cache."""
        if self.peak is None:
            self.finite = self.finite and all_finite(values)
            return
        peak = peak_magnitude(values)
        self.peak = max(self.peak, peak)
        self.finite = self.finite and math.isfinite(peak)

    def payload(self) -> torch.Tensor:
        """The byte buffer (taken now if no data chunk came yet: an empty message)."""
        if self.buffer is None:
            self.buffer = self._allocate(self.header.payload_bytes)
            if self.buffer.numel():
                self._view = memoryview(self.buffer.numpy()).cast("B")
        return self.buffer


class Senders(Protocol):
    """What the Inbox knows of the senders (membership's liveness): this node's step, the centre of
    the accepted step window; who is dead (not waited for); and who was just heard from."""

    step: int

    def dead(self) -> frozenset[int]: ...

    def finished(self) -> frozenset[int]: ...

    def heard_from(self, peer: int, step: int | None = None, kind: int | None = None) -> None: ...


class Inbox:
    """Validates incoming headers and keeps delivered messages until an algorithm takes them.

    Streams are not free: open receptions are capped per claimed sender and in buffered bytes, and
    the server (streams.py) cuts a stream that sends nothing for `stream_idle_timeout` seconds.
    Limits on what open (not yet delivered) receptions may hold, against half-open streams:
      stream_idle_timeout        seconds a stream may go without a chunk before the server cuts it
                                 (server.py; must exceed chunk size / slowest link bandwidth)
      max_receptions_per_sender  open receptions per claimed sender; more are refused with
                                 `too_many_streams` (RESOURCE_EXHAUSTED: the sender retries)
      max_buffered_bytes         payload bytes held by open receptions; a reception whose buffer
                                 would exceed it is refused with `buffer_limit`, unless it is the only
                                 one holding a buffer (any single valid message still fits)
    """

    def __init__(self, rank: int, world_size: int, senders: Senders, *, step_window: int = 64, pin_memory: bool = False,
                 dedup_window: int = 4096, stream_idle_timeout: float = 30.0, max_receptions_per_sender: int = 8,
                 max_buffered_bytes: int = 256 << 20):
        if stream_idle_timeout <= 0 or max_receptions_per_sender < 1 or max_buffered_bytes < 0:
            raise ValueError(f"stream_idle_timeout {stream_idle_timeout} must be > 0, max_receptions_per_sender "
                             f"{max_receptions_per_sender} >= 1, max_buffered_bytes {max_buffered_bytes} >= 0")
        self.rank = rank
        self.world_size = world_size
        self.senders = senders
        self.step_window = step_window
        self.stream_idle_timeout = stream_idle_timeout
        self.max_receptions_per_sender = max_receptions_per_sender
        self.max_buffered_bytes = max_buffered_bytes
        self.pool = BufferPool(pin_memory=pin_memory)
        self.buffered_bytes = 0  # held by open receptions
        self._specs: dict[tuple[int, str | None], ChannelSpec] = {}  # (kind, channel or None=any)
        # (kind, channel) -> step -> sender -> Message
        self._mail: dict[tuple[int, str], dict[int, dict[int, Message]]] = defaultdict(
            lambda: defaultdict(dict))
        self._delivered: dict[int, OrderedDict[int, None]] = defaultdict(OrderedDict)  # sender -> ids
        self._voided: dict[int, OrderedDict[int, None]] = defaultdict(OrderedDict)  # settled, never delivered
        self._open: set[Reception] = set()
        # (sender, kind, channel, step) -> the byte tensor that message lands in (receive_into), and
        # the open receptions writing into one, with its key (it goes back there if they fail)
        self._destinations: dict[tuple[int, int, str, int], torch.Tensor] = {}
        self._lent: dict[Reception, tuple[int, int, str, int]] = {}
        self._open_per_sender: Counter[int] = Counter()
        self._dedup_window = dedup_window
        self._waiters: list[tuple[object, asyncio.Future]] = []
        self._awaited: Counter[int] = Counter()  # senders the waiters wait for (hangups.py asks)
        # called (loop thread) with the ps_weight of every delivered message that carries one: the
        # push-sum mass acknowledged to its sender (a push-sum node's mass record, train/mass_record.py)
        self.on_mass: Callable[[float], None] | None = None
        self.mass_delivered = 0.0  # Σ of those weights since the start (a record made later starts from it)

    # Configuration (thread-safe enough: plain attribute writes read on the loop thread) ---------
    def expect(self, kind: int, dtype: torch.dtype, numel: int, *, channel: str | None = None,
               preallocate: int = 2, codecs: Mapping[int, CodecLayout] | None = None, peak: bool = False,
               voidable: bool = False) -> None:
        """Accept messages of `kind` holding `numel` elements of `dtype`; preallocates buffers.

        With `channel` the spec holds only for that channel (e.g. one ring all-reduce segment,
        whose size differs per round); otherwise for every channel without a spec of its own.
        `codecs` are the encodings accepted, each with its exact layout (the declarer knows its
        codec); by default raw tensors and FIXED_RATE_CODECS. `peak`: measure each raw float
        payload's max |v| as it arrives (Message.peak; push-sum's plausibility check reads it).
        `voidable`: also accept header-only push-sum void notices (CODEC_VOID, weight 0), which
        arrive as messages with an empty payload."""
        if codecs is None:
            codecs = dict(ChannelSpec.uncompressed(dtype, numel).codecs)
            if dtype.is_floating_point:
                codecs.update({codec: CodecLayout(per_element * numel, params)
                               for codec, (per_element, params) in FIXED_RATE_CODECS.items()})
        if voidable:
            codecs = {**codecs, pb.CODEC_VOID: CodecLayout(0)}
        self._specs[(kind, channel)] = ChannelSpec(dtype, numel, codecs, peak)
        self.pool.preallocate(numel * dtype.itemsize, preallocate)

    def unexpect(self, kind: int, channel: str | None = None) -> None:
        """Stop accepting messages of `kind` (e.g. state transfers once a rejoin is done)."""
        self._specs.pop((kind, channel), None)

    def receive_into(self, sender: int, kind: int, channel: str, step: int, buffer: torch.Tensor | None) -> None:
        """Land `sender`'s step-`step` message of `kind` on `channel` straight in `buffer` (a
        contiguous CPU byte tensor of its exact payload size) instead of a pooled buffer: a large
        transfer the receiver saw coming (a state hand-out) then needs no copy after it, and
        takes no page faults while its bytes arrive if the caller touched `buffer` beforehand.
        One reception at a time writes into it; any other (a copy sent on another connection, a
        payload of another size or codec) takes a pooled buffer as usual. None forgets it."""
        key = (sender, kind, channel, step)
        if buffer is None:
            self._destinations.pop(key, None)
        elif buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous() or buffer.is_cuda:
            raise ValueError("a receive destination is a contiguous 1-D uint8 CPU tensor")
        else:
            self._destinations[key] = buffer

    def settle(self, sender: int, message_ids: list[int]) -> list[int]:
        """Of `sender`'s `message_ids` (sent while a link failed), the ones delivered; the others are
        voided for good, so a copy still on its way is refused and the sender may take them back."""
        seen, voided = self._delivered[sender], self._voided[sender]
        delivered = [m for m in message_ids if m in seen]
        for message_id in message_ids:
            if message_id not in seen:
                voided[message_id] = None
        while len(voided) > self._dedup_window:
            voided.popitem(last=False)
        return delivered

    # Receive path (loop thread) ---------------------------------------------------------------
    def open(self, header: pb.TensorHeader) -> Reception:
        """Validate a header and start a reception (no buffer yet); raises Rejection, with reason
        `duplicate` for an id already delivered."""
        spec = self._validate(header)
        sender = header.sender
        if header.message_id in self._voided[sender]:
            raise Rejection("voided", f"message {header.message_id} from {sender} was settled as never delivered")
        if header.message_id in self._delivered[sender]:
            raise Rejection("duplicate", f"message {header.message_id} from {sender} already received")
        if self._open_per_sender[sender] >= self.max_receptions_per_sender:
            raise Rejection("too_many_streams", f"{self._open_per_sender[sender]} streams from {sender} are open "
                                                f"already (at most {self.max_receptions_per_sender})")
        key = (sender, header.kind, header.channel, header.step)
        destination = self._destinations.pop(key, None) if self._destinations else None
        if destination is not None and (header.codec != pb.CODEC_NONE or destination.numel() != header.payload_bytes):
            self._destinations[key], destination = destination, None  # not this one's size: a pooled buffer
        reception = Reception(header, self._hold if destination is None else lambda nbytes: destination)
        if spec.peak:
            reception.peak = 0.0
        if destination is not None:
            self._lent[reception] = key
        self._open.add(reception)
        self._open_per_sender[sender] += 1
        return reception

    def _hold(self, nbytes: int) -> torch.Tensor:
        """A receive buffer for an open reception, within max_buffered_bytes."""
        if self.buffered_bytes and self.buffered_bytes + nbytes > self.max_buffered_bytes:
            raise Rejection("buffer_limit", f"open receptions hold {self.buffered_bytes} bytes; {nbytes} more would "
                                            f"exceed the {self.max_buffered_bytes} allowed")
        buffer = self.pool.acquire(nbytes)
        self.buffered_bytes += nbytes
        return buffer

    def abort(self, reception: Reception) -> None:
        """Drop a half-received message: buffer back to the pool (or a destination back to its
        message's key, for a retry to land in), nothing marked (idempotent)."""
        key = self._lent.get(reception)
        if not self._close(reception) or reception.buffer is None:
            return
        if key is None:
            self.pool.release(reception.buffer)
        else:
            self._destinations.setdefault(key, reception.buffer)

    def _close(self, reception: Reception) -> bool:
        if reception not in self._open:
            return False
        self._open.discard(reception)
        self._open_per_sender[reception.header.sender] -= 1
        if not self._open_per_sender[reception.header.sender]:
            del self._open_per_sender[reception.header.sender]
        if self._lent.pop(reception, None) is None and reception.buffer is not None:
            self.buffered_bytes -= reception.buffer.numel()  # (a destination was never counted: it is the caller's)
        return True

    def receiving(self) -> set[tuple[int, int]]:
        """(sender, message id) of every open reception."""
        return {(r.header.sender, r.header.message_id) for r in self._open}

    def deliver(self, reception: Reception) -> Message:
        """Turn a complete reception into a mailbox message, or reject it (and release it).

        Refused: a truncated stream; an id another stream delivered meanwhile (`duplicate`); a
        second message for an occupied (kind, channel, step, sender) slot, which would otherwise
        overwrite and destroy the first one's push-sum mass (`duplicate_slot`: checked after the
        id, so a late copy of a delivered share is never refused, which would make its sender
        re-absorb mass that was delivered); a float payload holding NaN or Inf (`non_finite`).

        Exactly once: several streams may carry the same id at once (a sender retrying over a
        connection that has not yet been noticed as broken); each fills its own buffer, the first
        to complete is delivered, later ones are answered DUPLICATE, and one that breaks off
        releases its buffer and marks nothing. DUPLICATE tells a sender its message *was* delivered
        (it stops retrying), so it is never said of an id that is merely in flight."""
        header = reception.header
        try:
            if not reception.complete():
                raise Rejection("truncated", f"stream ended after {reception.received} of "
                                             f"{header.payload_bytes} payload bytes")
            if header.message_id in self._delivered[header.sender]:
                raise Rejection("duplicate", f"message {header.message_id} from {header.sender} was delivered "
                                             "by another stream meanwhile")
            if header.message_id in self._voided[header.sender]:  # settled while it was being received
                raise Rejection("voided", f"message {header.message_id} from {header.sender} was settled as never "
                                          "delivered")
            box = self._mail[(header.kind, header.channel)][header.step]
            if header.sender in box:
                raise Rejection("duplicate_slot", f"already holding a step-{header.step} message of this "
                                                  f"kind/channel from {header.sender}")
            buffer = reception.payload()
            # Codec payloads stay raw bytes: the algorithm's codec decodes them (and checks them).
            tensor = buffer.view(torch_dtype(header.dtype)) if header.codec == pb.CODEC_NONE else buffer
            if header.codec == pb.CODEC_NONE and tensor.is_floating_point():
                if reception.finite:
                    reception.check(tensor[reception.scanned // tensor.element_size():])
                if not reception.finite:
                    raise Rejection("non_finite", f"the payload from {header.sender} holds NaN or Inf")
        except Rejection:
            self.abort(reception)
            raise
        lent = reception in self._lent
        self._close(reception)  # the buffer now belongs to the message
        delivered = self._delivered[header.sender]
        delivered[header.message_id] = None
        while len(delivered) > self._dedup_window:
            delivered.popitem(last=False)
        message = Message(
            sender=header.sender, step=header.step, kind=header.kind, channel=header.channel,
            tensor=tensor, ps_weight=header.ps_weight, relay_count=header.relay_count,
            codec=header.codec, codec_params=tuple(header.codec_params),
            shape=tuple(header.shape) or (header.numel,), message_id=header.message_id,
            arrived_since=reception.opened, landed=time.monotonic(),
            peak=reception.peak if header.codec == pb.CODEC_NONE and tensor.is_floating_point() else None,
            _release=None if lent else lambda: self.pool.release(buffer))
        box[header.sender] = message
        if header.ps_weight > 0:
            self.mass_delivered += header.ps_weight
            if self.on_mass is not None:
                self.on_mass(header.ps_weight)
        self.senders.heard_from(header.sender, header.step, header.kind)
        self._wake_waiters()
        return message

    def scan(self, reception: Reception) -> None:
        """Check the whole elements that arrived so far for NaN / Inf now, so that deliver() checks
        only the rest: the TCP lane calls this while the rest of a payload is still on its way, which
        takes the check (a pass over the payload) off the time between the last byte and the Ack.
        A NaN found here is refused by deliver(), when the message is complete, as ever."""
        header = reception.header
        if header.codec != pb.CODEC_NONE or reception.buffer is None or not reception.finite:
            return
        dtype = torch_dtype(header.dtype)
        end = reception.received - reception.received % dtype.itemsize
        if dtype.is_floating_point and end > reception.scanned:
            reception.check(reception.buffer[reception.scanned:end].view(dtype))
            reception.scanned = end

    def _validate(self, header: pb.TensorHeader) -> ChannelSpec:
        """The node's own checks (sender, receiver, route, kind, step window) around the shared
        header checks of validation.py."""
        if not 0 <= header.sender < self.world_size or header.sender == self.rank:
            raise Rejection("unknown_sender", f"sender {header.sender} is not a peer of node {self.rank} "
                                              f"(world size {self.world_size})")
        if header.receiver != self.rank:
            raise Rejection("wrong_receiver", f"message for node {header.receiver} reached node {self.rank}")
        if header.route:
            raise Rejection("bad_route", f"message for node {self.rank} still has relay hops {list(header.route)}")
        spec = self._specs.get((header.kind, header.channel)) or self._specs.get((header.kind, None))
        if spec is None:
            kind = pb.MessageKind.Name(header.kind) if header.kind in pb.MessageKind.values() else header.kind
            raise Rejection("unexpected_kind", f"node {self.rank} does not accept message kind {kind}")
        validate_header(header, spec, world_size=self.world_size)
        step = self.senders.step
        if header.kind not in MASS_TRANSFERS and abs(header.step - step) > self.step_window:
            # (a state transfer carries the donor's step, which a rejoining node is far behind of; a
            # leaver's mass is taken at any step, or it would leave with the leaver)
            raise Rejection("stale_step" if header.step < step else "future_step",
                            f"step {header.step} outside [{step - self.step_window}, {step + self.step_window}]")
        return spec

    # Consumer side (loop thread; the training thread reaches it through the Transport) ----------
    def _wake_waiters(self) -> None:
        for ready, future in list(self._waiters):
            if not future.done() and ready():
                future.set_result(None)

    def awaited(self) -> set[int]:
        """The senders some wait_for is waiting for now."""
        return set(self._awaited)

    def wake(self) -> None:
        """Re-check every waiter (e.g. a peer was declared dead: stop waiting for it)."""
        self._wake_waiters()

    async def wait_for(self, kind: int, step: int, senders: list[int], channel: str = "",
                       timeout: float | None = None, partial: bool = False) -> dict[int, Message]:
        """Wait until every sender's step-`step` message is here (dead senders are not waited for,
        nor finished ones: what they sent was acknowledged before they said so); pop and return
        them. After `timeout` raise TimeoutError, or with `partial` return the messages that did
        arrive (the rest will be late)."""
        wanted = set(senders)

        def ready() -> bool:
            return (wanted - self.senders.dead() - self.senders.finished()).issubset(
                self._mail[(kind, channel)].get(step, {}))

        if not ready():
            waiter = (ready, asyncio.get_running_loop().create_future())
            self._waiters.append(waiter)
            self._awaited.update(wanted)
            try:
                await asyncio.wait_for(waiter[1], timeout)
            except asyncio.TimeoutError:
                if not partial:
                    have = set(self._mail[(kind, channel)].get(step, {}))
                    raise TimeoutError(f"node {self.rank}: step-{step} messages from {sorted(wanted - have)} "
                                       f"did not arrive within {timeout:.1f}s") from None
            finally:
                self._waiters.remove(waiter)
                self._awaited.subtract(wanted)
                for sender in wanted:
                    if not self._awaited[sender]:
                        del self._awaited[sender]
        return self._pop(kind, channel, step, wanted)

    def take(self, kind: int, max_step: int, channel: str = "") -> list[Message]:
        """Pop every delivered message of `kind` with step <= max_step (late messages to fold in)."""
        boxes = self._mail[(kind, channel)]
        taken: list[Message] = []
        for step in sorted(s for s in boxes if s <= max_step):
            taken.extend(self._pop(kind, channel, step, set(boxes[step])).values())
        return taken

    def holds(self, kind: int, max_step: int, channel: str = "") -> bool:
        """Whether a delivered message of `kind` with step <= max_step may be here: safe from any
        thread (it only reads, and each read is atomic under the GIL), so a caller that finds none
        skips the round trip to the loop. False: there was none an instant ago, as take() would
        have found; a message delivered meanwhile is taken next time, as it would have been."""
        boxes = self._mail.get((kind, channel))  # (get: the defaultdict grows only on the loop)
        if not boxes:
            return False
        try:
            return any(box and step <= max_step for step, box in list(boxes.items()))
        except RuntimeError:  # (resized while copied: another thread's Python code ran; look properly)
            return True

    def _pop(self, kind: int, channel: str, step: int, senders: set[int]) -> dict[int, Message]:
        boxes = self._mail[(kind, channel)]
        box = boxes.get(step, {})
        out = {s: box.pop(s) for s in sorted(senders) if s in box}
        if not box:
            boxes.pop(step, None)
        return out

    def pending(self) -> int:
        return sum(len(box) for boxes in self._mail.values() for box in boxes.values())


__all__ = ["Inbox", "Message", "Rejection", "Reception", "ChannelSpec", "BufferPool", "Senders"]
