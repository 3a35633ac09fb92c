"""Reception of one client stream of TensorChunks, shared by every receiver on the wire: a node's
PushTensor (server.py) and the parameter server's Commit (ps/server.py).

A stream is a header, then data chunks written into a Reception. What is read here is checked only
for framing (malformed chunk, missing or second header, idle or cancelled stream); whether the
header is acceptable and where its bytes go is the receiver's business, never this module's.
"""
from __future__ import annotations

import asyncio

from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.transport.framing import FramingError
from p2ptrain.transport.inbox import Reception
from p2ptrain.transport.paths.grpc_path import status_of
from p2ptrain.transport.reception import RETRY_LATER
from p2ptrain.transport.validation import Rejection

# How long a stream that ended short waits for a cancel to show (wait_for_cancel): ~6x the latest cancel seen
# after the end of a stream (3.9 ms in 400 trials on a loaded 2-core host).
CANCEL_GRACE = 0.025
# Rejections answered with a gRPC status rather than an Ack: nothing is wrong with the message, the
# sender may retry it (same id) once streams are reaped or buffers freed (reception.RETRY_LATER).
REFUSAL_STATUS = {reason: status_of(kind) for reason, kind in RETRY_LATER.items()}


class MessageStream:
    """The request stream of one tensor message, read as header() then fill(reception); `noun`
    names it in rejection details ("stream", "commit"). `chunks` is what is left of it (a relay
    pipes that on)."""

    def __init__(self, requests, idle_timeout: float, noun: str = "stream"):
        self.chunks = idle_limited(requests, idle_timeout)
        self.noun = noun

    async def header(self) -> pb.TensorHeader | None:
        """The stream's header; None when it ended before its first chunk."""
        async for chunk in self.chunks:
            if isinstance(chunk, FramingError):
                raise Rejection("malformed_chunk", str(chunk))
            if chunk.header is None:
                raise Rejection("missing_header", f"the first chunk of a {self.noun} must be a header")
            return chunk.header
        return None

    async def fill(self, reception: Reception) -> None:
        """Write the rest of the stream into `reception`, until the client half-closes."""
        async for chunk in self.chunks:
            if isinstance(chunk, FramingError):
                raise Rejection("malformed_chunk", str(chunk))
            if chunk.header is not None:
                raise Rejection("unexpected_header", f"a second header inside one {self.noun}")
            reception.write(chunk.data)
            chunk.data.release()  # copied: let its bytes go (grpc.aio's reader keeps the last message)
            del chunk


async def idle_limited(requests, timeout: float):
    """The chunks of a request stream; Rejection `idle_stream` once the consumer waited `timeout`
    seconds for the next one (a half-open stream must not hold its slot and buffer for ever; time
    spent by the consumer itself, e.g. a relay waiting on its next hop, does not count). Holds no
    chunk while it waits: an idle stream must not pin its last chunk's bytes too."""
    iterator = aiter(requests)
    watch = _IdleWatch(timeout)
    try:
        while True:
            watch.waiting = True
            try:
                chunk = await anext(iterator)
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                if not watch.expired:
                    raise
                watch.forgive()
                raise Rejection("idle_stream", f"no chunk for {timeout:g} s") from None
            finally:
                watch.waiting = False
            watch.touch()
            yield chunk
            del chunk
    finally:
        watch.close()


class _IdleWatch:
    """Cancels the current task once it has been waiting (`waiting` set) for `timeout` seconds
    since the last touch(). One timer per stream, re-armed only when it fires: cheaper per chunk
    than a timed wait per read (that cost 0.3 ms per small message), and unlike wait_for on
    Python < 3.12 it never swallows a client's cancel landing as a read completes."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.waiting = False
        self.expired = False
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self._last = self._loop.time()
        self._timer = self._loop.call_at(self._last + timeout, self._check)

    def touch(self) -> None:
        self._last = self._loop.time()

    def _check(self) -> None:
        due = self._last + self.timeout
        if not self.waiting or self._loop.time() < due:
            self._timer = self._loop.call_at(max(due, self._loop.time() + 0.001), self._check)
            return
        self.expired = True
        self._task.cancel()

    def forgive(self) -> None:
        """Take back our cancel (Python >= 3.11 counts them), so the task may go on to answer."""
        uncancel = getattr(self._task, "uncancel", None)
        if uncancel is not None:
            uncancel()

    def close(self) -> None:
        self._timer.cancel()


async def wait_for_cancel(context, complete: bool) -> None:
    """Let a cancel show before a request stream that ended is delivered (or reported truncated).

    grpc.aio ends the request iterator alike for a half-close and for a cancel (client gone,
    connection lost); the cancel reaches the handler's task separately, as a CancelledError, mostly
    within the same loop iteration, in ~8% of cases some milliseconds later (up to 3.9 ms on a loaded
    host). So: a call past its deadline is refused (`aborted_stream`); a complete message waits one
    loop iteration (no cost on the hot path); an incomplete one, an error path anyway, waits
    CANCEL_GRACE. A cancel later than that is missed: an incomplete message then counts as
    `truncated`, a complete one is delivered, harmless for a sender that retries the same id (its
    retry is answered DUPLICATE)."""
    if context.time_remaining() == 0:
        raise Rejection("aborted_stream", "the caller's deadline passed before its stream ended")
    await asyncio.sleep(0 if complete else CANCEL_GRACE)


__all__ = ["MessageStream", "idle_limited", "wait_for_cancel", "CANCEL_GRACE", "REFUSAL_STATUS"]
