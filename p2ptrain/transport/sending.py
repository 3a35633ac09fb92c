"""The send core of a node: one tensor message from the training thread to a peer's Ack.

A message gets its id once and keeps it on every attempt (retries, relays), so a copy that did
arrive is answered DUPLICATE and never applied twice. Which way it goes (direct or relayed, through
the emulated link) is the router's choice; when the link fails after bytes left, a push-sum share is
*settled* with the receiver (Settle RPC) instead of being guessed lost or delivered. Outstanding
sends are kept per peer so the caller can bound what a silent peer soaks up.

It runs its coroutines on the node's loop thread (loop_thread.py) and never decides what a tensor means.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import secrets
import time

import torch

from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.transport.errors import FailureKind, PeerUnreachable, SendFailure, describe
from p2ptrain.transport.faults import LinkUnreachable, MessageDropped
from p2ptrain.transport.framing import tensor_bytes, wire_dtype
from p2ptrain.transport.loop_thread import LoopThread
from p2ptrain.transport.membership.greetings import Greetings
from p2ptrain.transport.membership.liveness import Liveness
from p2ptrain.transport.options import TransportOptions
from p2ptrain.transport.paths.grpc_path import GrpcPath
from p2ptrain.transport.paths.router import Router

log = logging.getLogger(__name__)

VOIDED = "voided"  # Ack reason of a settled message the receiver never delivered (it refuses it for good)


class Sender:
    """Sends of node `rank`: ids, retries, settling and the outstanding futures per peer."""

    def __init__(self, rank: int, world_size: int, options: TransportOptions, loop: LoopThread,
                 router: Router, grpc: GrpcPath, greetings: Greetings, liveness: Liveness, metrics=None):
        self.rank = rank
        self.world_size = world_size
        self.options = options
        self.loop = loop
        self.router = router
        self.grpc = grpc
        self.greetings = greetings
        self.liveness = liveness
        self.metrics = metrics
        self.message_ids = itertools.count((secrets.randbits(31) << 32) | 1)  # unique across restarts
        # Sends whose Ack has not come yet, per peer, oldest first (Communicator.make_room bounds them),
        # and settle-able sends whose outcome is unknown (the link failed after bytes left).
        self._outstanding: dict[int, dict[int, concurrent.futures.Future]] = {p: {} for p in range(world_size)}
        self._sent_to: set[int] = set()  # every peer a send went to
        self._unsettled: dict[int, dict[int, asyncio.Future]] = {}
        self._settling: set[int] = set()
        # pushes waiting for a peer to come up (wait_for_ready), ended when it is declared dead
        self._waiting: dict[int, set[asyncio.Future]] = {}
        liveness.subscribe(self._peer_news)

    def send(self, peer: int, tensor: torch.Tensor, *, kind: int, step: int, ps_weight: float = 0.0,
             relay_count: float = 0.0, channel: str = "", codec: int = pb.CODEC_NONE,
             codec_params: tuple[float, ...] = (), dtype: torch.dtype | None = None,
             numel: int | None = None, shape: tuple[int, ...] | None = None,
             reliable: bool = False, settle: bool = False, even_if_dead: bool = False) -> concurrent.futures.Future:
        """Push `tensor` (CPU; ownership passes to the transport until the future is done).

        Returns a future of the peer's Ack. For codec payloads `tensor` holds the encoded bytes and
        dtype / numel / shape describe the decoded tensor. Under link emulation (options.links) a
        lost message fails the future with MessageDropped, unless `reliable`: then it is sent again
        (paying the link's bandwidth and latency again, like a retransmission) until it arrives.

        `settle` (for messages that carry push-sum mass): when the link fails after bytes left, the
        outcome is unknown, so instead of failing the future waits until the peer answers a Settle:
        an Ack ACCEPTED if it had delivered the message, REJECTED with reason "voided" if not (it
        then refuses any late copy). The future fails with PeerUnreachable only when nothing was
        sent (the peer was already dead) or the transport stops first.

        `even_if_dead`: send although liveness holds the peer dead, because it has answered us since
        (a Settle reply: a stalled peer that woke up and has not rejoined yet).
        """
        if not 0 <= peer < self.world_size or peer == self.rank:
            raise ValueError(f"node {self.rank} cannot send to {peer}")
        payload = tensor_bytes(tensor)
        header = pb.TensorHeader(
            sender=self.rank, receiver=peer, step=step, kind=kind,
            dtype=wire_dtype(dtype or tensor.dtype), numel=numel if numel is not None else tensor.numel(),
            shape=list(shape if shape is not None else tensor.shape), payload_bytes=len(payload),
            codec=codec, codec_params=list(codec_params), ps_weight=ps_weight, relay_count=relay_count,
            message_id=next(self.message_ids), channel=channel)
        future = self.loop.submit(self._send(peer, header, payload, tensor, reliable, settle, even_if_dead))
        self._sent_to.add(peer)
        outstanding = self._outstanding[peer]
        outstanding[header.message_id] = future
        future.add_done_callback(lambda _: outstanding.pop(header.message_id, None))
        return future

    async def _unless_dead(self, peer: int, push) -> pb.Ack | None:
        """`push`'s Ack, or None once `peer` is declared dead first: a push that waits for a peer to
        come up (its first contact) would otherwise wait out the send timeout for a dead one."""
        task = asyncio.ensure_future(push)
        dead = asyncio.get_running_loop().create_future()
        waiting = self._waiting.setdefault(peer, set())
        waiting.add(dead)
        try:
            await asyncio.wait([task, dead], return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiting.discard(dead)
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return None

    def _peer_news(self) -> None:
        """A peer was declared dead or alive (Liveness listener, any thread): end the waits for the dead."""
        if self._waiting:
            with contextlib.suppress(RuntimeError):  # (the loop has stopped: nothing waits any more)
                self.loop.call_soon(self._end_waits_for_dead)

    def _end_waits_for_dead(self) -> None:
        for peer, waiting in self._waiting.items():
            if not self.liveness.alive(peer):
                for dead in waiting:
                    if not dead.done():
                        dead.set_result(None)

    def sent_to(self) -> set[int]:
        """The peers this node ever sent a message to."""
        return set(self._sent_to)

    def outstanding(self, peer: int) -> list[concurrent.futures.Future]:
        """Futures of our sends to `peer` not acknowledged yet, oldest first."""
        return list(self._outstanding[peer].values())

    async def _send(self, peer: int, header: pb.TensorHeader, payload: memoryview, keepalive,
                    reliable: bool = False, settle: bool = False, even_if_dead: bool = False) -> pb.Ack:
        deadline = time.monotonic() + self.options.send_timeout
        attempted = False  # once bytes may have left, only the receiver knows whether it delivered
        while True:
            # (a joiner asks for a state transfer while we hold it dead)
            if not (even_if_dead or self.liveness.alive(peer) or header.kind == pb.MESSAGE_KIND_STATE):
                failure = PeerUnreachable(f"node {self.rank}: peer {peer} is considered dead")
                if settle and attempted:
                    return await self._settle_later(peer, header.message_id, failure)
                raise failure
            # Until a peer was reached once, wait for it to come up (nodes start in any order);
            # afterwards a refused connect fails at once, so a crash is noticed within a probe.
            wait = peer not in self.greetings.reached
            remaining = max(0.05, deadline - time.monotonic())
            try:  # direct or through relays (declared, or when the peer proves unreachable): the router
                attempted = True
                push = self.router.push(peer, header, payload, reliable, remaining, wait_for_ready=wait)
                ack = await (self._unless_dead(peer, push) if wait else push)
                if ack is None:
                    continue  # declared dead while we waited for it to come up: the check above ends it
                break
            except (MessageDropped, LinkUnreachable):
                raise  # the emulated link lost it, or is down with no relay: it was never delivered
            except SendFailure as exc:
                if self.metrics is not None:
                    self.metrics.on_send_error(peer)
                unreachable = exc.kind.no_connection and not await self.greetings.probe(peer)
                if not reliable or not exc.kind.retryable or time.monotonic() >= deadline or unreachable:
                    if settle:
                        return await self._settle_later(peer, header.message_id, exc)
                    if unreachable:
                        raise PeerUnreachable(f"node {self.rank}: peer {peer} unreachable: {exc}") from exc
                    raise
                await asyncio.sleep(0.05)  # then the same message id again: a delivered copy is a duplicate
        self.greetings.reached.add(peer)
        self._heard_back(peer, ack)
        if self.metrics is not None:
            if ack.status == pb.Ack.STATUS_ACCEPTED:
                self.metrics.on_sent(peer, len(payload))
            elif ack.status == pb.Ack.STATUS_REJECTED:
                self.metrics.on_refused_send(peer)
        del keepalive  # the tensor behind `payload` may be freed now
        return ack

    def _heard_back(self, peer: int, ack: pb.Ack) -> None:
        """What an Ack tells about its sender: its step, and whether it excludes us."""
        self.liveness.note_step(peer, ack.step)
        if ack.sender_excluded:
            self.liveness.excluded(by_peer=peer)

    # Settling -----------------------------------------------------------------------------------
    async def _settle_later(self, peer: int, message_id: int, why: BaseException) -> pb.Ack:
        """Wait until `peer` says whether it delivered `message_id` (see send's `settle`)."""
        log.info("node %d: outcome of message %d to node %d unknown (%s); settling it when the peer answers",
                 self.rank, message_id, peer, describe(why))
        waiter = asyncio.get_running_loop().create_future()
        self._unsettled.setdefault(peer, {})[message_id] = waiter
        if peer not in self._settling:
            self._settling.add(peer)
            self.loop.spawn(self._settle_loop(peer))
        return await waiter

    async def _settle_loop(self, peer: int) -> None:
        """Ask `peer` (every settle_interval, until it answers) which unsettled messages it delivered."""
        try:
            while self._unsettled.get(peer):
                pending = self._unsettled[peer]
                request = pb.SettleRequest(sender=self.rank, message_ids=sorted(pending))
                try:
                    reply = await self.grpc.client(peer).settle(request, self.options.probe_timeout)
                except SendFailure as exc:
                    if exc.kind is not FailureKind.GONE:  # stalled, partitioned, restarting: ask again later
                        await asyncio.sleep(self.options.settle_interval)
                        continue
                    # Nothing listens on its port any more: the process died and its state (with
                    # whatever it had delivered) went with it, so taking the messages back cannot
                    # count any mass twice. (A stalled process still accepts connections.)
                    reply = pb.SettleReply()
                delivered = set(reply.delivered)
                for message_id in list(request.message_ids):
                    waiter = pending.pop(message_id, None)
                    if waiter is None or waiter.done():
                        continue
                    if message_id in delivered:
                        waiter.set_result(pb.Ack(status=pb.Ack.STATUS_ACCEPTED, message_id=message_id,
                                                 detail="settled: delivered"))
                    else:
                        waiter.set_result(pb.Ack(status=pb.Ack.STATUS_REJECTED, reason=VOIDED, message_id=message_id,
                                                 detail="settled: never delivered, voided by the receiver"))
                log.info("node %d: settled %d message(s) with node %d: %d delivered", self.rank,
                         len(request.message_ids), peer, len(delivered & set(request.message_ids)))
        finally:
            self._settling.discard(peer)

    def abandon_unsettled(self) -> None:
        """At shutdown: every send still waiting for a Settle fails (its outcome stays unknown)."""
        for unsettled in self._unsettled.values():
            for waiter in unsettled.values():
                if not waiter.done():
                    waiter.set_exception(PeerUnreachable(f"node {self.rank}: stopped before the peer "
                                                         "settled this message (its outcome is unknown)"))


__all__ = ["Sender", "VOIDED"]
