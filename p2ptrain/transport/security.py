"""Optional TLS and a shared-secret token for every gRPC server and channel of p2ptrain.

Without settings everything stays plaintext and open (a trusted LAN, a laptop). With a token, every
RPC (PushTensor, Hello, Settle, the parameter server's Pull / Commit / Done, server reflection) must
carry `authorization: P2P-HMAC ...`, a one-call proof of the token for this method, sender, receiver
and time (tokenauth.py), or is aborted with UNAUTHENTICATED before any handler runs: the token itself
never travels, and a captured value opens nothing else. With TLS (server cert + key, clients trusting
`tls_ca`) the tensors are also encrypted and the server is authenticated; with `require_client_cert`
the server also demands a client certificate signed by `tls_ca` (mutual TLS). The one exception to
the token is the standard health check (TOKEN_EXEMPT_PREFIX). The token is never printed or logged.
"""
from __future__ import annotations

import asyncio
import logging
import ssl
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from p2ptrain.transport.health import HEALTH_SERVICE_NAME
from p2ptrain.transport.tokenauth import CallRefused, CallVerifier, authorization, check_name

log = logging.getLogger(__name__)

TOKEN_METADATA_KEY = "authorization"  # gRPC metadata keys are lower case
PS_NAME = "ps"  # the parameter server's name in call authorization (nodes and workers: their rank)
# A refused client stream is read (up to this many bytes, for at most this long) before the refusal.
DRAIN_BYTES = 8 << 20
DRAIN_SECONDS = 2.0
# Methods callable without the token: exactly the standard health check (grpc.health.v1.Health, health.py): its
# Check and Watch need none. Kubernetes' native gRPC probe cannot send metadata, and the answer reveals nothing
# but SERVING / NOT_SERVING (up and set up, or not): no tensor, setting or peer. TLS and mutual TLS still apply.
TOKEN_EXEMPT_PREFIX = f"/{HEALTH_SERVICE_NAME}/"


class SecurityError(ValueError):
    """Unusable TLS / token settings (missing file, cert without key, empty token, ...)."""


def check_token(token: str) -> str:
    """A token must be non-empty visible ASCII: it travels as an HTTP/2 header value."""
    if not token or not token.strip():
        raise SecurityError("the auth token is empty")
    if any(not 0x21 <= ord(c) <= 0x7E for c in token):
        raise SecurityError("the auth token must be visible ASCII without spaces (it travels as a header value)")
    return token


def read_token_file(path: str | Path) -> str:
    """The token in `path` (surrounding whitespace, e.g. the final newline, removed)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise SecurityError(f"cannot read the auth token file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise SecurityError(f"the auth token file {path} is not text") from None
    return check_token(text.strip())


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise SecurityError(f"cannot read the TLS {what} {path}: {exc.strerror or exc}") from None


@dataclass(frozen=True)
class Security:
    """TLS files and token of one process; the default (all None) is plaintext without a token.

    One `Security` value describes a process: its server side (cert, key, client-cert policy) and
    its client side (trusted CA, optional client cert, target-name override, token to send). The
    TCP lane (lane.py) uses the same files through `lane_server_context` / `lane_client_context`
    (ssl module), and the token through a challenge-response (laneframes.auth_proof). Neither gRPC
    nor the lane ever sends the token itself."""

    tls_cert: str | None = None          # PEM certificate chain this process presents (server; client under mTLS)
    tls_key: str | None = None           # its PEM private key
    tls_ca: str | None = None            # PEM CA bundle trusted for peers' certificates (None: system roots)
    tls_server_name: str | None = None   # expected name in the server cert, when it differs from the address host
    token: str | None = field(default=None, repr=False)  # shared secret; never printed
    require_client_cert: bool = False    # server: demand a client cert signed by tls_ca (mutual TLS)

    def __post_init__(self):
        if (self.tls_cert is None) != (self.tls_key is None):
            raise SecurityError("--tls-cert and --tls-key come together")
        if self.require_client_cert and not (self.tls_ca and self.tls_cert):
            raise SecurityError("--tls-require-client-cert needs --tls-ca (to check client certificates) "
                                "and --tls-cert/--tls-key")
        if self.token is not None:
            check_token(self.token)

    @property
    def tls(self) -> bool:
        """Channels use TLS when this process has a certificate or trusts a CA."""
        return bool(self.tls_cert or self.tls_ca)

    # Server side --------------------------------------------------------------------------------
    def server_credentials(self) -> grpc.ServerCredentials:
        if not self.tls_cert:
            raise SecurityError("a TLS server needs --tls-cert and --tls-key")
        pair = (_read(self.tls_key, "key"), _read(self.tls_cert, "certificate"))
        roots = _read(self.tls_ca, "CA bundle") if self.require_client_cert else None
        return grpc.ssl_server_credentials([pair], root_certificates=roots,
                                           require_client_auth=self.require_client_cert)

    def add_port(self, server, address: str) -> int:
        """Bind `address` (TLS when a server cert is set); returns the port, 0 on failure."""
        if self.tls_cert:
            return server.add_secure_port(address, self.server_credentials())
        return server.add_insecure_port(address)

    def server_interceptors(self, metrics=None, name: str = "") -> list:
        """The token check of a server whose callers address it as `name` (its rank, PS_NAME)."""
        if not self.token:
            return []
        if not name:
            raise SecurityError("a server with an auth token needs its own name (rank or 'ps')")
        return [TokenInterceptor(self.token, name, metrics)]

    # Client side --------------------------------------------------------------------------------
    def channel_credentials(self) -> grpc.ChannelCredentials:
        roots = _read(self.tls_ca, "CA bundle") if self.tls_ca else None
        key = cert = None
        if self.tls_cert:  # offered only when the server asks for one (mutual TLS)
            key, cert = _read(self.tls_key, "key"), _read(self.tls_cert, "certificate")
        return grpc.ssl_channel_credentials(root_certificates=roots, private_key=key, certificate_chain=cert)

    def channel_options(self, options: list[tuple[str, object]]) -> list[tuple[str, object]]:
        if self.tls and self.tls_server_name:
            return [*options, ("grpc.ssl_target_name_override", self.tls_server_name)]
        return list(options)

    def aio_channel(self, address: str, options: list[tuple[str, object]]) -> grpc.aio.Channel:
        """A grpc.aio channel to `address`: TLS or plaintext as configured."""
        if self.tls:
            return grpc.aio.secure_channel(address, self.channel_credentials(), options=self.channel_options(options))
        return grpc.aio.insecure_channel(address, options=options)

    def channel(self, address: str, options: list[tuple[str, object]]) -> grpc.Channel:
        """A synchronous grpc channel (the parameter-server client)."""
        if self.tls:
            return grpc.secure_channel(address, self.channel_credentials(), options=self.channel_options(options))
        return grpc.insecure_channel(address, options=options)

    # TCP lane (paths/lane_path.py, lane_server.py) -------------------------------------------------
    def lane_server_context(self) -> ssl.SSLContext | None:
        """TLS of the lane's listening side (the gRPC server's certificate; client certificates
        checked against tls_ca under require_client_cert); None: this process serves plaintext."""
        if not self.tls_cert:
            return None
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            context.load_cert_chain(self.tls_cert, self.tls_key)
            if self.require_client_cert:
                context.verify_mode = ssl.CERT_REQUIRED
                context.load_verify_locations(cafile=self.tls_ca)
        except (OSError, ssl.SSLError) as exc:
            raise SecurityError(f"TLS of the TCP lane: {exc}") from None
        return context

    def lane_client_context(self) -> ssl.SSLContext | None:
        """TLS of lane connections (server checked against tls_ca, or the system roots; our
        certificate offered for mutual TLS); None: plaintext, as the gRPC channels."""
        if not self.tls:
            return None
        try:
            context = ssl.create_default_context(cafile=self.tls_ca)
            if self.tls_cert:
                context.load_cert_chain(self.tls_cert, self.tls_key)
        except (OSError, ssl.SSLError) as exc:
            raise SecurityError(f"TLS of the TCP lane: {exc}") from None
        return context

    def lane_server_name(self, host: str) -> str:
        """The name a lane server's certificate must hold: tls_server_name, else the address host."""
        return self.tls_server_name or host

    def call_metadata(self, method: str, sender: str, receiver: str) -> tuple[tuple[str, str], ...] | None:
        """Metadata of one call of `method` from `sender` to `receiver` (names: ranks, PS_NAME): a
        fresh proof of the token (never the token), when one is set. Make it just before the call
        goes out: the receiver accepts it for about a minute (tokenauth.WINDOW_SECONDS), once."""
        if not self.token:
            return None
        return ((TOKEN_METADATA_KEY, authorization(self.token, method, str(sender), str(receiver))),)


PLAINTEXT = Security()


def security_from_settings(settings) -> Security:
    """The Security (TLS files, token) of a node's security settings (NodeConfig.security: the
    tls_* and auth_token* settings); PLAINTEXT when none is set."""
    token = read_token_file(settings.auth_token_file) if settings.auth_token_file else settings.auth_token
    if token is None and not (settings.tls_cert or settings.tls_ca):
        return PLAINTEXT
    return Security(tls_cert=settings.tls_cert, tls_key=settings.tls_key, tls_ca=settings.tls_ca,
                    tls_server_name=settings.tls_server_name, token=token,
                    require_client_cert=settings.tls_require_client_cert)


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Aborts every RPC (reflection included) whose `authorization` metadata does not prove the
    token for this method, to this server (`name`), now, for the first time (tokenauth.CallVerifier)
    with UNAUTHENTICATED, before the handler (and so before any state) is reached; a full replay
    cache answers RESOURCE_EXHAUSTED (retry later). Health checks (TOKEN_EXEMPT_PREFIX) pass without
    it, so that probes which cannot send metadata work. Runs on the server's event loop."""

    DETAILS = "missing or wrong auth token"

    def __init__(self, token: str, name: str, metrics=None):
        self.verifier = CallVerifier(check_token(token), check_name(name))
        self.metrics = metrics
        self.refused = 0

    def _refusal(self, handler_call_details) -> str | None:
        value = None
        for key, given in handler_call_details.invocation_metadata or ():
            if key == TOKEN_METADATA_KEY:
                value = given.decode("ascii", "replace") if isinstance(given, bytes) else given
                break
        try:
            self.verifier.verify(handler_call_details.method, value)
        except CallRefused as refused:
            return refused.reason
        return None

    async def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(TOKEN_EXEMPT_PREFIX):
            return await continuation(handler_call_details)
        reason = self._refusal(handler_call_details)
        if reason is None:
            return await continuation(handler_call_details)
        self.refused += 1
        if self.metrics is not None:
            self.metrics.on_rejected("unauthenticated")
        if self.refused == 1 or self.refused % 100 == 0:
            log.warning("refused %d call(s) without a valid proof of the auth token (latest: %s, %s)", self.refused,
                        handler_call_details.method, reason)
        status = grpc.StatusCode.RESOURCE_EXHAUSTED if reason == "replay_cache_full" else \
            grpc.StatusCode.UNAUTHENTICATED
        # Answer with a handler of the method's own shape, so gRPC reads the call the way it was made.
        handler = await continuation(handler_call_details)
        return _refusing_handler(handler, status, f"{self.DETAILS} ({reason})")


async def _drain(requests) -> None:
    """Read a refused client stream until the caller has finished writing it (at most DRAIN_BYTES,
    for at most DRAIN_SECONDS): a call ended while the caller still writes can reach it as a broken
    stream (INTERNAL) instead of the refusal."""
    drained = 0
    try:
        async with asyncio.timeout(DRAIN_SECONDS):
            async for request in requests:
                drained += len(request)
                if drained > DRAIN_BYTES:
                    break
    except (TimeoutError, grpc.RpcError):
        pass


def _refusing_handler(handler, status: grpc.StatusCode, details: str) -> grpc.RpcMethodHandler:
    async def abort(request, context):
        await context.abort(status, details)

    async def abort_after_reading(requests, context):
        await _drain(requests)
        await context.abort(status, details)

    async def abort_streaming(request, context):
        await context.abort(status, details)
        yield  # pragma: no cover - makes this an async generator, as response-streaming handlers are

    request_streaming = bool(handler and handler.request_streaming)
    response_streaming = bool(handler and handler.response_streaming)
    if request_streaming and response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort_streaming)
    if request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort_after_reading)
    if response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort_streaming)
    return grpc.unary_unary_rpc_method_handler(abort)


__all__ = ["Security", "SecurityError", "TokenInterceptor", "PLAINTEXT", "PS_NAME", "TOKEN_METADATA_KEY",
           "TOKEN_EXEMPT_PREFIX", "check_token", "read_token_file"]
