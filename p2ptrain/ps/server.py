"""The parameter server: central variable θ (flat float32) and its version, served over gRPC.

Pull streams a consistent snapshot of θ with its version; Commit receives a worker's update into a
buffer and applies it only once the stream is complete and valid, in one synchronous step on the
server's event loop: commits are applied one at a time, never torn, never lost, and each is recorded
with its staleness τ = (version when applied) − (version its gradient was computed at).
A commit is applied exactly once (a retry is answered DUPLICATE), and one that would make θ
non-finite is refused whole. Done ends the run once every worker that pulled θ has said it.
Everything of grpc.aio lives on one dedicated event-loop thread (transport/loop_thread.py, like the
node Transport); the owning thread talks to it through ParameterServer's blocking methods.
"""
from __future__ import annotations

import collections
import hashlib
import json
import logging
import math
import threading
import time
from dataclasses import dataclass

import grpc
import torch

from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.algorithms.gem import staleness_scale
from p2ptrain.pki import PS_NAME
from p2ptrain.train.progress import SnapshotSeries
from p2ptrain.transport.framing import (
    DEFAULT_CHUNK_BYTES,
    MAX_CHUNK_BYTES,
    check_chunk_bytes,
    deserialize_chunk,
    encode_header,
    iter_data_chunks,
    serialize_identity,
    tensor_bytes,
)
from p2ptrain.transport.health import ServingStatus
from p2ptrain.transport.inbox import BufferPool, Reception
from p2ptrain.transport.loop_thread import LoopThread
from p2ptrain.transport.options import TransportOptions
from p2ptrain.transport.peer_identity import IDENTITY, IdentityCheck, drain, identity_check
from p2ptrain.transport.security import PLAINTEXT, Security
from p2ptrain.transport.server import PROTOCOL_VERSION, serve
from p2ptrain.transport.streams import REFUSAL_STATUS, MessageStream, wait_for_cancel
from p2ptrain.transport.validation import ChannelSpec, Rejection, all_finite, check_finite, validate_header

log = logging.getLogger(__name__)

PS_SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ParameterServer"].full_name  # "p2ptrain.v1.ParameterServer"
PULL_METHOD = f"/{PS_SERVICE_NAME}/Pull"
COMMIT_METHOD = f"/{PS_SERVICE_NAME}/Commit"
DONE_METHOD = f"/{PS_SERVICE_NAME}/Done"
_ITEMSIZE = 4  # θ is float32
_DEDUP_WINDOW = 64  # remembered message ids per worker (a retried commit is acknowledged, not re-applied)
_RECENT = 256  # commits in the "recent" staleness mean


def grpc_options() -> list[tuple[str, object]]:
    """Channel / server options of both sides: messages up to the largest chunk any peer may use
    (so a worker and the server need not agree on --chunk-mb), the node transport's keepalive."""
    return TransportOptions(chunk_bytes=MAX_CHUNK_BYTES).channel_options()


def ps_fingerprint(config) -> str:
    """Hash of the settings the server and its workers must share: the model (θ's layout) and the
    data sharding (data set, size, seed, Dirichlet α, number of workers = world size)."""
    shared = {k: getattr(config, k) for k in ("world_size", "model", "hidden", "dataset", "num_train", "seed",
                                               "dirichlet_alpha")}
    return hashlib.sha256(json.dumps(shared, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class AppliedCommit:
    """One applied commit: `applied_at` is θ's version just before it (0 for the first commit), so
    the applied_at of all commits are exactly 0, 1, 2, ...; staleness = applied_at − base_version."""

    worker: int
    base_version: int
    applied_at: int
    staleness: int
    scale: float
    message_id: int

    def reply(self, status: int = pb.Ack.STATUS_ACCEPTED, nbytes: int = 0) -> pb.CommitReply:
        return pb.CommitReply(ack=pb.Ack(status=status, message_id=self.message_id, bytes_received=nbytes),
                              version=self.applied_at + 1, staleness=self.staleness, scale=self.scale)


class CentralVariable:
    """θ, its version and the commit book-keeping. Used only on the server's event-loop thread,
    where every method runs to completion without awaiting: that is what makes an apply atomic."""

    def __init__(self, theta: torch.Tensor, workers: int, *, snapshot_every: int = 0, keep_log: bool = False):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.theta = theta.detach().to("cpu", torch.float32, copy=True).contiguous().reshape(-1)
        if self.theta.numel() == 0:
            raise ValueError("the central variable is empty")
        self.numel = self.theta.numel()
        self.nbytes = self.numel * _ITEMSIZE
        self.workers = workers
        self.version = 0
        self.spec = ChannelSpec.uncompressed(torch.float32, self.numel)
        self.pool = BufferPool()
        self.pool.preallocate(self.nbytes, 2)
        self._next_theta = torch.empty_like(self.theta)  # apply() computes here, then swaps it in
        self._snapshot: tuple[int, torch.Tensor] | None = None
        self._open: set[Reception] = set()
        self._seen: dict[int, collections.OrderedDict[int, AppliedCommit]] = collections.defaultdict(
            collections.OrderedDict)
        self.staleness_counts: collections.Counter[int] = collections.Counter()
        self.rejections: collections.Counter[str] = collections.Counter()
        self.scalings: collections.Counter[str] = collections.Counter()
        self.commits_per_worker = [0] * workers
        self.recent_staleness: collections.deque[int] = collections.deque(maxlen=_RECENT)
        self.pull_bytes = 0
        self.commit_bytes = 0
        self.done: dict[int, int] = {}  # worker -> steps it reported
        self.pulled: set[int] = set()    # workers that pulled θ at least once (only they may say Done)
        self.last_activity = time.monotonic()
        self.log: list[AppliedCommit] | None = [] if keep_log else None
        self.snapshots = SnapshotSeries(snapshot_every) if snapshot_every else None  # θ for the report, bounded
        if self.snapshots is not None:
            self.snapshots.add(0, self.theta)

    # Pull -------------------------------------------------------------------------------------
    def snapshot(self) -> tuple[int, torch.Tensor]:
        """(version, θ at that version): a copy made at most once per version, never written again,
        so streaming it while later commits apply cannot tear it."""
        if self._snapshot is None or self._snapshot[0] != self.version:
            self._snapshot = (self.version, self.theta.clone())
        return self._snapshot

    def check_worker(self, worker: int) -> None:
        if not 0 <= worker < self.workers:
            raise Rejection("unknown_worker", f"worker {worker} is not one of the {self.workers} workers "
                                              f"(ids 0..{self.workers - 1}) this server expects")

    # Commit -----------------------------------------------------------------------------------
    def open_commit(self, header: pb.TensorHeader) -> Reception:
        """Validate a commit header and start its reception (the buffer comes with the first data
        chunk); raises Rejection, with reason `duplicate` for a commit applied already. The header
        passes the same validator as a node's messages (transport/validation.py: same defect, same
        reason code) plus the server's own checks (kind, worker id, scaling, version)."""
        self.last_activity = time.monotonic()
        if header.kind != pb.MESSAGE_KIND_PS_COMMIT:
            raise Rejection("unexpected_kind", f"a commit must be of kind MESSAGE_KIND_PS_COMMIT, got {header.kind}")
        self.check_worker(header.sender)
        validate_header(header, self.spec, world_size=self.workers)
        if header.commit_scaling not in pb.CommitScaling.values():
            raise Rejection("bad_scaling", f"unknown commit scaling {header.commit_scaling}")
        if header.step > self.version:
            raise Rejection("future_version", f"base version {header.step} is newer than θ's version {self.version}")
        if header.message_id in self._seen[header.sender]:
            raise Rejection("duplicate", f"commit {header.message_id} of worker {header.sender} was applied already")
        reception = Reception(header, self.pool.acquire)
        self._open.add(reception)
        return reception

    def abort(self, reception: Reception) -> None:
        """Drop a partial or rejected commit: nothing of it reaches θ (idempotent)."""
        if reception in self._open:
            self._open.discard(reception)
            if reception.buffer is not None:
                self.pool.release(reception.buffer)

    def receiving(self) -> set[tuple[int, int]]:
        """(worker, message id) of every commit being received."""
        return {(r.header.sender, r.header.message_id) for r in self._open}

    def apply(self, reception: Reception) -> AppliedCommit:
        """Apply a completely received commit, or reject it whole; returns its record.

        θ + scale·update is computed into a spare buffer and swapped in only when finite: two
        finite commits of 3e38 would otherwise turn θ into Inf."""
        header = reception.header
        try:
            if not reception.complete():
                raise Rejection("truncated", f"stream ended after {reception.received} of {header.payload_bytes} "
                                             "payload bytes")
            if header.message_id in self._seen[header.sender]:
                raise Rejection("duplicate", f"commit {header.message_id} of worker {header.sender} was applied "
                                             "by another stream meanwhile")
            update = reception.payload().view(torch.float32)
            check_finite(update, f"the update of worker {header.sender}")
            tau = self.version - header.step
            scale = staleness_scale(tau) if header.commit_scaling == pb.COMMIT_SCALING_STALENESS else 1.0
            torch.add(self.theta, update, alpha=scale, out=self._next_theta)
            if not all_finite(self._next_theta):
                raise Rejection("non_finite_result", f"the update of worker {header.sender} (scale {scale:g}) would "
                                                     "make θ non-finite")
            self.theta, self._next_theta = self._next_theta, self.theta
        finally:
            self.abort(reception)  # buffer back to the pool, no longer being received
        record = AppliedCommit(worker=header.sender, base_version=header.step, applied_at=self.version,
                               staleness=tau, scale=scale, message_id=header.message_id)
        self.version += 1
        seen = self._seen[header.sender]
        seen[header.message_id] = record
        while len(seen) > _DEDUP_WINDOW:
            seen.popitem(last=False)
        self.staleness_counts[tau] += 1
        self.recent_staleness.append(tau)
        self.commits_per_worker[header.sender] += 1
        self.scalings[pb.CommitScaling.Name(header.commit_scaling)] += 1
        self.commit_bytes += self.nbytes
        if self.log is not None:
            self.log.append(record)
        if self.snapshots is not None and self.snapshots.due(self.version):
            self.snapshots.add(self.version, self.theta)
        return record

    def applied(self, worker: int, message_id: int) -> AppliedCommit | None:
        return self._seen.get(worker, {}).get(message_id)

    # Statistics -------------------------------------------------------------------------------
    def stats(self) -> dict:
        total = sum(self.staleness_counts.values())
        mean = sum(t * c for t, c in self.staleness_counts.items()) / total if total else math.nan
        recent = sum(self.recent_staleness) / len(self.recent_staleness) if self.recent_staleness else math.nan
        return {
            "version": self.version, "commits": total, "workers": self.workers, "workers_done": len(self.done),
            "mean_staleness": mean, "recent_staleness": recent,
            "max_staleness": max(self.staleness_counts) if total else None,
            "staleness_histogram": {str(t): self.staleness_counts[t] for t in sorted(self.staleness_counts)},
            "commits_per_worker": list(self.commits_per_worker), "rejected": dict(self.rejections),
            "scalings": dict(self.scalings), "pull_bytes": self.pull_bytes, "commit_bytes": self.commit_bytes,
        }


class ParameterServerService:
    """gRPC handlers. A bad commit ends in a rejecting CommitReply (the server keeps serving); a bad
    Pull / Done request is aborted with INVALID_ARGUMENT or FAILED_PRECONDITION. A commit stream that
    sends nothing for `stream_idle_timeout` seconds is cut (DEADLINE_EXCEEDED, `idle_stream`). With
    `identity` (transport/peer_identity.py) a Pull, Commit or Done for a worker id that the caller's
    client certificate does not name is refused with PERMISSION_DENIED before anything else."""

    def __init__(self, state: CentralVariable, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES, fingerprint: str = "",
                 metrics=None, on_all_done=lambda: None, stream_idle_timeout: float = 30.0,
                 identity: IdentityCheck | None = None):
        self.state = state
        self.identity = identity
        self.chunk_bytes = check_chunk_bytes(chunk_bytes)
        self.fingerprint = fingerprint
        self.metrics = metrics
        self.on_all_done = on_all_done
        self.stream_idle_timeout = stream_idle_timeout

    async def _refuse(self, context, rejection: Rejection, code=grpc.StatusCode.INVALID_ARGUMENT):
        self.state.rejections[rejection.reason] += 1
        if self.metrics is not None:
            self.metrics.on_rejected(rejection.reason)
        await context.abort(code, f"{rejection.reason}: {rejection.detail}")

    async def _deny(self, context, problem: str | None, rest=None) -> None:
        """Refuse a call whose worker id the caller's certificate does not name (nothing changes);
        `rest`: what is left of a commit stream, read first so that the worker sees the refusal."""
        if problem is not None:
            if rest is not None:
                await drain(rest)
            await self._refuse(context, Rejection(IDENTITY, problem), grpc.StatusCode.PERMISSION_DENIED)

    async def pull(self, request: pb.PullRequest, context):
        if self.identity is not None:
            await self._deny(context, self.identity.claim_problem(self.identity.grpc_peer(context), request.worker,
                                                                  "a Pull"))
        state = self.state
        state.last_activity = time.monotonic()
        try:
            state.check_worker(request.worker)
        except Rejection as rejection:
            await self._refuse(context, rejection)
        if request.protocol_version != PROTOCOL_VERSION:
            await self._refuse(context, Rejection("incompatible", f"protocol {request.protocol_version!r} != "
                                                                  f"{PROTOCOL_VERSION!r}"),
                               grpc.StatusCode.FAILED_PRECONDITION)
        if request.config_fingerprint and self.fingerprint and request.config_fingerprint != self.fingerprint:
            await self._refuse(context, Rejection(
                "incompatible", f"worker {request.worker}'s settings (fingerprint {request.config_fingerprint}) "
                                f"differ from the server's ({self.fingerprint}): model, hidden, dataset, "
                                "num_train, seed, dirichlet_alpha and world_size must agree"),
                grpc.StatusCode.FAILED_PRECONDITION)
        version, theta = state.snapshot()
        payload = tensor_bytes(theta)
        yield encode_header(pb.TensorHeader(
            receiver=request.worker, step=version, kind=pb.MESSAGE_KIND_PS_PARAMS, dtype=pb.DTYPE_FLOAT32,
            shape=[state.numel], numel=state.numel, payload_bytes=len(payload)))
        for chunk in iter_data_chunks(payload, self.chunk_bytes):
            yield chunk
        state.pull_bytes += len(payload)
        state.pulled.add(request.worker)
        if self.metrics is not None:
            self.metrics.on_pull(request.worker, len(payload))

    async def commit(self, requests, context) -> pb.CommitReply:
        """Receive one commit and apply it once it is complete and valid. A commit is applied exactly
        once: streams carrying the same commit may overlap (a retry over a connection not yet
        noticed as broken), the first complete one is applied and later ones are answered DUPLICATE
        with its record. A commit that would make θ non-finite is refused whole
        (`non_finite_result`), θ untouched."""
        state = self.state
        reception = pending = None
        header: pb.TensorHeader | None = None
        try:
            stream = MessageStream(requests, self.stream_idle_timeout, "commit")
            header = await stream.header()
            if header is not None and self.identity is not None:
                await self._deny(context, self.identity.header_problem(self.identity.grpc_peer(context), header,
                                                                       relayed=False), stream.chunks)
            if header is not None:
                reception = state.open_commit(header)
                await stream.fill(reception)
            # never apply a cancelled call
            await wait_for_cancel(context, reception is not None and reception.complete())
            if reception is None:
                raise Rejection("empty_stream", "commit stream closed before any header")
            pending, reception = reception, None  # apply() releases it whatever happens
            record = state.apply(pending)  # synchronous: no other coroutine runs until θ is updated
            state.last_activity = time.monotonic()
            if self.metrics is not None:
                self.metrics.on_commit(record.worker, state.nbytes, record.staleness, state.version)
            return record.reply(nbytes=pending.received)
        except Rejection as rejection:
            received = (reception or pending).received if (reception or pending) is not None else 0
            if reception is not None:
                state.abort(reception)
            reception = pending = None  # (the frame may outlive the call)
            if rejection.reason == "duplicate" and header is not None:
                previous = state.applied(header.sender, header.message_id)
                if previous is not None:  # a retry of an applied commit: acknowledge with the original's record
                    return previous.reply(pb.Ack.STATUS_DUPLICATE)
            state.rejections[rejection.reason] += 1
            if self.metrics is not None:
                self.metrics.on_rejected(rejection.reason)
            count = state.rejections[rejection.reason]
            if count == 1 or count % 100 == 0:  # a diverged worker may send NaNs every step
                log.warning("parameter server rejected a commit (%d so far for this reason): %s", count, rejection)
            status = REFUSAL_STATUS.get(rejection.reason)
            if status is not None:
                await context.abort(status, f"{rejection.reason}: {rejection.detail}")
            return pb.CommitReply(ack=pb.Ack(status=pb.Ack.STATUS_REJECTED, reason=rejection.reason,
                                             detail=rejection.detail, bytes_received=received))
        except BaseException:  # cancelled / connection lost mid-stream: nothing of it was applied
            if reception is not None:
                state.abort(reception)
                state.rejections["aborted_stream"] += 1
                if self.metrics is not None:
                    self.metrics.on_rejected("aborted_stream")
            raise

    async def done(self, request: pb.DoneRequest, context) -> pb.DoneReply:
        """Done ends the run once every worker said it, so it counts only from a worker id that has
        pulled θ from this server (anything else is refused with FAILED_PRECONDITION). That stops
        stray or mistaken calls, not an attacker: on a plaintext server anyone who can reach the port
        can Pull as worker k and then say Done for it. With a token (transport/security.py) only
        holders of the shared secret can call Pull, Commit or Done at all; under mutual TLS with
        identity certificates only worker k itself can speak for worker k."""
        if self.identity is not None:
            await self._deny(context, self.identity.claim_problem(self.identity.grpc_peer(context), request.worker,
                                                                  "a Done"))
        state = self.state
        state.last_activity = time.monotonic()
        try:
            state.check_worker(request.worker)
        except Rejection as rejection:
            await self._refuse(context, rejection)
        if request.worker not in state.pulled:
            await self._refuse(context, Rejection(
                "done_before_pull", f"worker {request.worker} said Done without ever pulling θ from this server: "
                                    "a Done counts only from a worker that took part"),
                grpc.StatusCode.FAILED_PRECONDITION)
        first = request.worker not in state.done
        state.done[request.worker] = request.steps
        if self.metrics is not None:
            self.metrics.on_done(len(state.done))
        if first and len(state.done) == state.workers:
            self.on_all_done()
        return pb.DoneReply(version=state.version, workers_done=len(state.done), workers=state.workers)

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(PS_SERVICE_NAME, {
            "Pull": grpc.unary_stream_rpc_method_handler(
                self.pull, request_deserializer=pb.PullRequest.FromString, response_serializer=serialize_identity),
            "Commit": grpc.stream_unary_rpc_method_handler(
                self.commit, request_deserializer=deserialize_chunk,
                response_serializer=pb.CommitReply.SerializeToString),
            "Done": grpc.unary_unary_rpc_method_handler(
                self.done, request_deserializer=pb.DoneRequest.FromString,
                response_serializer=pb.DoneReply.SerializeToString),
        })


class ParameterServer:
    """Serves θ on `listen` from its own event-loop thread. start() binds (port 0 picks one: see
    .port); wait() blocks until every worker said Done or nothing happened for `idle_timeout`."""

    def __init__(self, theta: torch.Tensor, workers: int, *, listen: str = "[::]:0",
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, fingerprint: str = "", metrics=None,
                 snapshot_every: int = 0, keep_log: bool = False, shutdown_grace: float = 2.0,
                 security: Security = PLAINTEXT, stream_idle_timeout: float = 30.0):
        self.security = security  # TLS / auth token (transport/security.py)
        self.identity = identity_check(security, PS_NAME)  # mTLS with identity certificates: who is which worker
        self.state = CentralVariable(theta, workers, snapshot_every=snapshot_every, keep_log=keep_log)
        self.listen = listen
        self.chunk_bytes = check_chunk_bytes(chunk_bytes)
        self.fingerprint = fingerprint
        self.metrics = metrics
        self.shutdown_grace = shutdown_grace
        self.stream_idle_timeout = stream_idle_timeout  # a commit stream silent this long is cut
        self.port: int | None = None
        self.all_done = threading.Event()
        self._bridge = LoopThread("p2ptrain-ps", "parameter server")
        self._server: grpc.aio.Server | None = None
        self.health: ServingStatus | None = None  # grpc.health.v1: SERVING once started (health.py)

    # Lifecycle ------------------------------------------------------------------------------
    def start(self, timeout: float = 30.0) -> "ParameterServer":
        self._bridge.start(self._start_server, timeout)  # re-raises a bind failure here
        return self

    async def _start_server(self) -> None:
        service = ParameterServerService(self.state, chunk_bytes=self.chunk_bytes, fingerprint=self.fingerprint,
                                         metrics=self.metrics, on_all_done=self.all_done.set,
                                         stream_idle_timeout=self.stream_idle_timeout, identity=self.identity)
        self._server, self.health, port = await serve(
            service.handler(), PS_SERVICE_NAME, listen=self.listen, options=grpc_options() + [("grpc.so_reuseport", 0)],
            security=self.security, metrics=self.metrics, serving=True, name=PS_NAME)
        if port == 0:
            raise OSError(f"parameter server could not listen on {self.listen}")
        self.port = port

    def stop(self) -> None:
        async def shutdown() -> None:
            if self.health is not None:
                await self.health.drain()  # NOT_SERVING while the grace period runs
            if self._server is not None:
                await self._server.stop(self.shutdown_grace)

        self._bridge.stop(shutdown, self.shutdown_grace)

    def __enter__(self) -> "ParameterServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait(self, idle_timeout: float | None = None, poll: float = 0.2) -> bool:
        """True once every worker said Done; False after `idle_timeout` seconds without any Pull,
        Commit or Done (e.g. a worker died)."""
        while not self.all_done.wait(poll):
            if idle_timeout is not None and time.monotonic() - self.state.last_activity > idle_timeout:
                return False
        return True

    # Thread-safe reads ------------------------------------------------------------------------
    def call(self, fn, *args):
        """Run fn(*args) on the server's loop (where the state lives) and return its result."""
        return self._bridge.call(fn, *args, timeout=30)

    def stats(self) -> dict:
        return self.call(self.state.stats)

    def theta(self) -> tuple[int, torch.Tensor]:
        """(version, a copy of θ)."""
        return self.call(lambda: (self.state.version, self.state.theta.clone()))

    def commit_log(self) -> list[AppliedCommit]:
        return self.call(lambda: list(self.state.log or []))

    def snapshots(self) -> SnapshotSeries | None:
        return self.call(lambda: self.state.snapshots.copy() if self.state.snapshots is not None else None)


__all__ = ["ParameterServer", "ParameterServerService", "CentralVariable", "AppliedCommit", "ps_fingerprint",
           "grpc_options", "PS_SERVICE_NAME", "PULL_METHOD", "COMMIT_METHOD", "DONE_METHOD"]
