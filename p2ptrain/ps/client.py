"""A worker's connection to the parameter server: blocking Pull / Commit / Done.

This uses grpc's synchronous API rather than a grpc.aio client on an event-loop thread (what a node's
Transport does): a worker makes exactly one call at a time, from its training thread, and waits for
each answer before going on (Algorithm 1 is pull, then commit, then compute), so there is nothing
to overlap and an event loop would only add a thread hop per call. The sync channel is thread-safe,
so several workers in one process (tests) may also share one. Framing is the transport's: the
same hand-encoded data chunks, decoded zero-copy into a preallocated buffer. Under mutual TLS with
identity certificates the client also checks, once, that the server's certificate names the
parameter server of its run (transport/peer_identity.py) before it commits or reports Done.
"""
from __future__ import annotations

import itertools
import secrets
import time

import grpc
import torch

from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.ps.server import COMMIT_METHOD, DONE_METHOD, PULL_METHOD, grpc_options
from p2ptrain.transport import tokenauth
from p2ptrain.transport.framing import (
    DEFAULT_CHUNK_BYTES,
    FramingError,
    check_chunk_bytes,
    deserialize_chunk,
    encode_header,
    iter_data_chunks,
    serialize_identity,
    tensor_bytes,
)
from p2ptrain.transport.peer_identity import IDENTITY, certified_identity, server_problem
from p2ptrain.transport.security import PLAINTEXT, PS_NAME, Security
from p2ptrain.transport.server import PROTOCOL_VERSION

_RETRY_CODES = (grpc.StatusCode.UNAVAILABLE,)


class PsError(RuntimeError):
    """The parameter server is unreachable, refused a call, or sent something malformed.
    `reason` is the server's reason code for a rejected commit, else a gRPC status name."""

    def __init__(self, message: str, reason: str = ""):
        super().__init__(message)
        self.reason = reason


class PsClient:
    """Worker `worker`'s channel to the parameter server at `address` ("host:port")."""

    def __init__(self, address: str, worker: int, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 fingerprint: str = "", timeout: float | None = 120.0, retries: int = 3,
                 security: Security = PLAINTEXT):
        self.address = address
        self.worker = worker
        self.chunk_bytes = check_chunk_bytes(chunk_bytes)
        self.fingerprint = fingerprint
        self.timeout = timeout
        self.retries = retries
        self.security = security
        # Under mutual TLS with identity certificates: is the server the parameter server? (checked once)
        self.server_checked = certified_identity(security) is None
        self.channel = security.channel(address, grpc_options())
        self._pull = self.channel.unary_stream(PULL_METHOD, request_serializer=pb.PullRequest.SerializeToString,
                                               response_deserializer=deserialize_chunk)
        self._commit = self.channel.stream_unary(COMMIT_METHOD, request_serializer=serialize_identity,
                                                 response_deserializer=pb.CommitReply.FromString)
        self._done = self.channel.unary_unary(DONE_METHOD, request_serializer=pb.DoneRequest.SerializeToString,
                                              response_deserializer=pb.DoneReply.FromString)
        self._ids = itertools.count((secrets.randbits(31) << 32) | 1)  # unique across restarts

    def _metadata(self, method: str):
        """A fresh proof of the token for one call (None without one): never the token itself."""
        return self.security.call_metadata(method, str(self.worker), PS_NAME)

    def _expired(self, exc: grpc.RpcError, sent: float) -> bool:
        """A proof refused after the call waited a time window or more for the server (it came up
        late): retried once with a fresh one."""
        return bool(self.security.token) and exc.code() == grpc.StatusCode.UNAUTHENTICATED \
            and time.monotonic() - sent >= tokenauth.WINDOW_SECONDS

    def pull(self, out: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
        """(θ, its version). θ lands in `out` (CPU float32, contiguous, of θ's size) when given;
        waits for the server to come up, until the client's timeout."""
        sent = time.monotonic()
        try:
            return self._pull_once(out)
        except grpc.RpcError as exc:
            if not self._expired(exc, sent):
                raise PsError(f"Pull from the parameter server at {self.address} failed: {_describe(exc)}",
                              exc.code().name) from None
        try:
            return self._pull_once(out)
        except grpc.RpcError as exc:
            raise PsError(f"Pull from the parameter server at {self.address} failed: {_describe(exc)}",
                          exc.code().name) from None

    def _pull_once(self, out: torch.Tensor | None) -> tuple[torch.Tensor, int]:
        request = pb.PullRequest(worker=self.worker, protocol_version=PROTOCOL_VERSION,
                                 config_fingerprint=self.fingerprint)
        call = self._pull(request, timeout=self.timeout, wait_for_ready=True, metadata=self._metadata(PULL_METHOD))
        try:
            header, view, received = None, None, 0
            for chunk in call:
                if isinstance(chunk, FramingError):
                    raise PsError(f"parameter server at {self.address} sent a malformed chunk: {chunk}", "malformed")
                if header is None:
                    header = chunk.header
                    out = self._check_params_header(header, out)
                    view = tensor_bytes(out)
                elif chunk.header is not None:
                    raise PsError("a second header inside one Pull stream", "malformed")
                else:
                    end = received + len(chunk.data)
                    if end > header.payload_bytes:
                        raise PsError("Pull stream carries more bytes than announced", "malformed")
                    view[received:end] = chunk.data
                    received = end
        finally:
            call.cancel()  # no-op once the stream ended; stops it when we bail out early
        if header is None or received != header.payload_bytes:
            raise PsError(f"Pull stream from {self.address} ended early ({received} bytes)", "truncated")
        self.check_server()  # (the server is up now: the Pull waited for it)
        return out, header.step

    def check_server(self) -> None:
        """Under mutual TLS with identity certificates, once: the server's certificate must name the
        parameter server of this worker's run (PsError with reason `identity` otherwise)."""
        if self.server_checked:
            return
        try:
            problem = server_problem(self.security, self.address, timeout=self.timeout or 10.0)
        except OSError as exc:
            raise PsError(f"cannot check the parameter server at {self.address}: {exc}", "UNAVAILABLE") from None
        if problem is not None:
            raise PsError(f"{IDENTITY}: {problem}", IDENTITY)
        self.server_checked = True

    def _check_params_header(self, header: pb.TensorHeader | None, out: torch.Tensor | None) -> torch.Tensor:
        if header is None:
            raise PsError("the first chunk of a Pull stream must be a header", "malformed")
        if header.kind != pb.MESSAGE_KIND_PS_PARAMS or header.dtype != pb.DTYPE_FLOAT32:
            raise PsError(f"Pull answered with kind {header.kind} dtype {header.dtype}, expected float32 "
                          "PS_PARAMS", "malformed")
        if header.payload_bytes != header.numel * 4:
            raise PsError(f"{header.payload_bytes} bytes announced for {header.numel} floats", "malformed")
        if out is None:
            return torch.empty(header.numel, dtype=torch.float32)
        if out.numel() != header.numel or out.dtype != torch.float32 or out.device.type != "cpu":
            raise PsError(f"the server's θ has {header.numel} parameters, this worker's model "
                          f"{out.numel()} ({out.dtype}, {out.device}): different models?", "bad_size")
        return out

    def commit(self, update: torch.Tensor, base_version: int, *,
               scaling: int = pb.COMMIT_SCALING_NONE) -> pb.CommitReply:
        """Stream `update` (CPU float32) computed at θ's version `base_version`; returns the reply,
        whose ack says accepted / duplicate / rejected (with reason). A retry after a lost
        connection reuses the message id, so the server never applies one commit twice."""
        self.check_server()
        flat = update.detach().reshape(-1)
        if flat.dtype != torch.float32:
            raise ValueError(f"updates are float32, got {flat.dtype}")
        payload = tensor_bytes(flat)
        header = pb.TensorHeader(sender=self.worker, step=base_version, kind=pb.MESSAGE_KIND_PS_COMMIT,
                                 dtype=pb.DTYPE_FLOAT32, numel=flat.numel(), shape=[flat.numel()],
                                 payload_bytes=len(payload), message_id=next(self._ids), commit_scaling=scaling)
        chunk_bytes = self.chunk_bytes

        def chunks():
            yield encode_header(header)
            yield from iter_data_chunks(payload, chunk_bytes)

        for attempt in itertools.count():
            sent = time.monotonic()
            try:
                return self._commit(chunks(), timeout=self.timeout, wait_for_ready=True,
                                    metadata=self._metadata(COMMIT_METHOD))
            except grpc.RpcError as exc:
                if (exc.code() in _RETRY_CODES or self._expired(exc, sent)) and attempt < self.retries:
                    continue
                raise PsError(f"Commit to the parameter server at {self.address} failed: {_describe(exc)}",
                              exc.code().name) from None
        raise AssertionError("unreachable")

    def done(self, steps: int) -> pb.DoneReply:
        self.check_server()
        for attempt in range(2):
            sent = time.monotonic()
            try:
                return self._done(pb.DoneRequest(worker=self.worker, steps=steps), timeout=self.timeout,
                                  wait_for_ready=True, metadata=self._metadata(DONE_METHOD))
            except grpc.RpcError as exc:
                if attempt == 0 and self._expired(exc, sent):
                    continue
                raise PsError(f"Done to the parameter server at {self.address} failed: {_describe(exc)}",
                              exc.code().name) from None
        raise AssertionError("unreachable")

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "PsClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _describe(exc: grpc.RpcError) -> str:
    try:
        return f"{exc.code().name}: {exc.details()}"
    except Exception:  # noqa: BLE001 - not a call error
        return str(exc)


__all__ = ["PsClient", "PsError"]
