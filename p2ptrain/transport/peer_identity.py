"""Who is on the other end of a connection: node identity under mutual TLS (issue 23).

Identity is in force when a process demands client certificates (Security.require_client_cert) and
its own certificate names a node of a run (`p2ptrain://<run-id>/<rank>` or `/ps`: pki.py). Then a
peer's claim to be node r (a header's sender, a Hello's node_id, a worker id) is believed only on a
connection whose certificate names r of the same run; a relayed message is judged by the hop that
brought it (TensorHeader.via). `identity_check` returns None otherwise: nothing is checked.
`IdentityCheck` reads the peer's certificate from a grpc.aio ServicerContext or a lane's TLS
transport and decides; the servers refuse and count (reason IDENTITY). `server_problem`: a client's
look at the certificate of the server it calls (the parameter server's workers). No gRPC types here.
"""
from __future__ import annotations

import asyncio
import logging
import re
import socket
import ssl
import time
from pathlib import Path

from p2ptrain.addresses import split_address
from p2ptrain.pki import PS_NAME, CertIdentity, PkiError, certificate_identities, certificate_identity
from p2ptrain.transport.security import DRAIN_BYTES, DRAIN_SECONDS, Security, SecurityError

log = logging.getLogger(__name__)

IDENTITY = "identity"      # the reason refusals are counted and answered with
LOG_INTERVAL = 10.0        # seconds between two warnings about refused claims (the count goes in the next)
_CACHE_SIZE = 256          # peer certificates whose identity is remembered (one per peer connection, in practice)
_SHOWN = 40                # characters of a peer-controlled string that reach a log line or an answer


def certified_identity(security: Security) -> CertIdentity | None:
    """The node this process's own certificate names; None when identity is not in force (no mutual
    TLS, or a certificate naming no p2ptrain node; one that cannot be read or parsed names none, and
    TLS says what is wrong with it when it loads it, as without identity). Raises SecurityError with
    a one-line reason for a certificate naming several nodes."""
    if not (security.require_client_cert and security.tls_cert):
        return None
    path = security.tls_cert
    try:
        found = certificate_identities(Path(path).read_bytes())
    except (OSError, PkiError, ValueError):
        return None
    if not found:
        return None
    if len(found) > 1:
        raise SecurityError(f"the TLS certificate {path} names {len(found)} p2ptrain nodes "
                            f"({', '.join(i.uri for i in found)[:200]}); a node's certificate names one")
    return found[0]


def own_identity(security: Security, name: int | str, run_id: str | None = None) -> CertIdentity | None:
    """certified_identity, checked against this process's own `name` (rank or "ps") and, when
    given, the run id of its settings. Raises SecurityError with a one-line reason."""
    identity = certified_identity(security)
    if identity is None:
        return None
    path = security.tls_cert
    expected = str(name)
    if identity.name != expected:
        what = "the parameter server" if expected == PS_NAME else f"node {expected}"
        wanted = "ps.crt" if expected == PS_NAME else f"node-{expected}.crt"
        raise SecurityError(f"this process is {what}, but its TLS certificate {path} names {identity.uri}: give it "
                            f"{wanted} (`p2ptrain pki issue`)")
    if run_id is not None and not same_run(identity.run_id, run_id):
        raise SecurityError(f"the TLS certificate {path} names run {identity.run_id!r}, but this node's run_id is "
                            f"{run_id!r}: set --run-id {identity.run_id}, or issue certificates from a CA made "
                            f"for run {run_id!r} (`p2ptrain pki init --run-id`)")
    return identity


def same_run(certified: str, run_id: str) -> bool:
    """The settings' run id is the certified one (torchrun's restarts add `-restart<N>` to it)."""
    return run_id == certified or re.fullmatch(re.escape(certified) + r"-restart\d+", run_id) is not None


def identity_check(security: Security, name: int | str, run_id: str | None = None) -> "IdentityCheck | None":
    """The IdentityCheck of a process named `name` with `security`; None when identity is not in
    force (own_identity), so that nothing is checked."""
    identity = own_identity(security, name, run_id)
    return IdentityCheck(identity) if identity is not None else None


class IdentityCheck:
    """Decides whether a claimed sender may speak on a connection, for the process named by
    `own` (its certificate's identity: peers must be of the same run)."""

    def __init__(self, own: CertIdentity):
        self.own = own
        self.run_id = own.run_id
        self.refused = 0           # claims refused so far
        self._names: dict[bytes, str | None] = {}
        self._logged_at = -LOG_INTERVAL
        self._unlogged = 0

    # Who is on the other end --------------------------------------------------------------------
    def name_in(self, certificate: bytes | None) -> str | None:
        """The node (rank as text, or "ps") of this run that a peer certificate (PEM or DER) names;
        None for no certificate, or one naming no node (or several) of this run."""
        if not certificate:
            return None
        if certificate not in self._names:
            try:
                identity = certificate_identity(certificate, self.run_id)
            except (PkiError, ValueError):
                identity = None
            if len(self._names) >= _CACHE_SIZE:
                self._names.clear()
            self._names[certificate] = identity.name if identity is not None else None
        return self._names[certificate]

    def grpc_peer(self, context) -> str | None:
        """The authenticated peer of a gRPC call (grpc.aio ServicerContext), by its client certificate."""
        certificates = context.auth_context().get("x509_pem_cert") or ()
        return self.name_in(next(iter(certificates), None))

    def lane_peer(self, transport) -> str | None:
        """The authenticated peer of a lane connection (an asyncio TLS transport)."""
        ssl_object = transport.get_extra_info("ssl_object") if transport is not None else None
        return self.name_in(ssl_object.getpeercert(binary_form=True)) if ssl_object is not None else None

    # Decisions ----------------------------------------------------------------------------------
    def claim_problem(self, peer: str | None, claimed: int | str, what: str) -> str | None:
        """Why `peer` (the connection's node) may not send `what` claiming to be `claimed`; None if it may."""
        if peer is not None and peer == str(claimed):
            return None
        return self.refusal(f"{what} claims to be node {_shown(claimed)} on a connection authenticated as "
                            f"{_who(peer)}")

    def header_problem(self, peer: str | None, header, *, relayed: bool = True) -> str | None:
        """Why `peer` may not deliver this TensorHeader: the connection must be authenticated as
        the hop that sent it (`via` when set, else the sender), and a hop is never the sender.
        Where nothing is relayed (`relayed` False: the lane, the parameter server) `via` is refused."""
        if not header.HasField("via"):
            return self.claim_problem(peer, header.sender, "a message")
        if not relayed:
            return self.refusal(f"a message from node {header.sender} names relay {header.via}, but nothing is "
                                f"relayed here (connection authenticated as {_who(peer)})")
        if header.via == header.sender:
            return self.refusal(f"a message from node {header.sender} names itself as its relay")
        return self.claim_problem(peer, header.via, f"a message relayed for node {header.sender}")

    def refusal(self, detail: str) -> str:
        """Note one refused claim (a warning at most every LOG_INTERVAL seconds); returns `detail`."""
        self.refused += 1
        self._unlogged += 1
        now = time.monotonic()
        if now - self._logged_at >= LOG_INTERVAL:
            log.warning("%s %s refused %d claim(s) its peers' certificates do not back (latest: %s)",
                        "parameter server" if self.own.rank is None else "node", self.own.name, self._unlogged,
                        detail)
            self._logged_at, self._unlogged = now, 0
        return detail


def server_certificate(security: Security, address: str, timeout: float = 10.0) -> bytes | None:
    """The certificate (DER) the TLS server at `address` ("host:port") shows; None when identity is
    not in force here, or for an address that is no host:port. gRPC shows a client no certificate,
    so this opens one TLS connection of its own (CA and host name checked as the lane does). Raises
    OSError when the server cannot be reached, SecurityError when the TLS handshake fails."""
    if certified_identity(security) is None:
        return None
    context = security.lane_client_context()
    split = split_address(address)
    if context is None or split is None:
        return None  # (unix sockets and the like: nothing to look at)
    host, port = split
    try:
        with socket.create_connection((host, port), timeout=timeout) as raw, \
                context.wrap_socket(raw, server_hostname=security.lane_server_name(host)) as tls:
            return tls.getpeercert(binary_form=True)
    except ssl.SSLError as exc:
        raise SecurityError(f"the TLS handshake with {_shown(address)} failed: {exc.reason or exc}") from None


def server_problem(security: Security, address: str, expected: int | str = PS_NAME,
                   timeout: float = 10.0) -> str | None:
    """Why the server at `address` ("host:port") is not node `expected` of this process's run;
    None if it is, or when identity is not in force here (server_certificate). Raises OSError
    when the server cannot be reached."""
    try:
        certificate = server_certificate(security, address, timeout)
    except SecurityError as exc:
        return str(exc)
    return None if certificate is None else _not_named(security, address, certificate, expected)


def certified_server(security: Security, address: str, expected: int | str, timeout: float = 10.0) -> bytes | None:
    """The certificate of the server at `address` when it names node `expected` of this run (a
    private node's check of the peer whose calls come down its reverse stream); None when identity
    is not in force. Raises SecurityError with server_problem's reason, OSError when unreachable."""
    certificate = server_certificate(security, address, timeout)
    problem = None if certificate is None else _not_named(security, address, certificate, expected)
    if problem is not None:
        raise SecurityError(problem)
    return certificate


def _not_named(security: Security, address: str, certificate: bytes, expected: int | str) -> str | None:
    own = certified_identity(security)
    if own is None:
        return None
    try:
        identity = certificate_identity(certificate, own.run_id) if certificate else None
    except (PkiError, ValueError):
        identity = None
    if identity is not None and identity.name == str(expected):
        return None
    what = "the parameter server" if str(expected) == PS_NAME else f"node {expected}"
    return (f"the server at {_shown(address)} is not {what} of run {own.run_id!r}: its certificate names "
            f"{identity.uri if identity is not None else 'no node of this run'}")


async def drain(chunks, max_bytes: int = DRAIN_BYTES, seconds: float = DRAIN_SECONDS) -> None:
    """Read and drop what is left of a refused client stream (at most `max_bytes`, for at most
    `seconds`): a call ended while its caller still writes can reach it as a broken stream instead
    of the refusal."""
    drained = 0
    try:
        async with asyncio.timeout(seconds):
            async for chunk in chunks:
                data = getattr(chunk, "data", None)
                drained += len(data) if data is not None else 0
                if drained > max_bytes:
                    break
    except Exception:  # noqa: BLE001 - a timeout, an idle or broken stream: the refusal follows anyway
        pass


def _shown(value: int | str) -> str:
    text = str(value)
    return text if len(text) <= _SHOWN else text[:_SHOWN] + "..."


def _who(peer: str | None) -> str:
    return f"node {_shown(peer)}" if peer is not None else "no node of this run"


__all__ = ["IDENTITY", "LOG_INTERVAL", "IdentityCheck", "certified_identity", "certified_server", "drain",
           "identity_check", "own_identity", "same_run", "server_certificate", "server_problem"]
