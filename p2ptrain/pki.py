"""A run's own certificate authority: who is who under mutual TLS.

`init_ca` makes a CA for one run; `issue` signs a node's certificate whose SAN URI
`p2ptrain://<run-id>/<rank>` (or `.../ps` for the parameter server) names the node. A peer's claim to be
node r is believed only on a connection whose client certificate names r (transport/peer_identity.py), so
a certified node cannot speak for another. Keys are EC P-256, written 0600; nothing is overwritten
without `force`.
"""
from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

SCHEME = "p2ptrain"
PS_NAME = "ps"  # the parameter server's name in its identity URI
CA_CERT, CA_KEY = "ca.crt", "ca.key"
DEFAULT_DAYS = 365


class PkiError(ValueError):
    """A CA or certificate cannot be made or read (missing CA, existing file, bad run id or rank)."""


@dataclass(frozen=True)
class CertIdentity:
    """Whom a certificate names: a run and a node of it (a rank, or "ps")."""

    run_id: str
    name: str

    @property
    def rank(self) -> int | None:
        """The node rank, None for the parameter server."""
        return int(self.name) if self.name.isdigit() else None

    @property
    def uri(self) -> str:
        return f"{SCHEME}://{self.run_id}/{self.name}"


def identity_uri(run_id: str, name: int | str) -> str:
    """`p2ptrain://<run-id>/<rank>`: the SAN URI naming node `name` of run `run_id`."""
    return CertIdentity(_check_run_id(run_id), _check_name(name)).uri


def parse_identity_uri(uri: str) -> CertIdentity | None:
    """The identity a SAN URI names; None for a URI that is no p2ptrain node identity."""
    prefix = f"{SCHEME}://"
    if not uri.startswith(prefix):
        return None
    run_id, _, name = uri[len(prefix):].partition("/")
    if not run_id or not (name.isdigit() or name == PS_NAME) or "/" in name:
        return None
    return CertIdentity(run_id, name)


def certificate_identities(certificate: bytes | x509.Certificate) -> list[CertIdentity]:
    """Every node identity a certificate (PEM or DER bytes) names in its SAN URIs."""
    cert = _load(certificate) if isinstance(certificate, bytes) else certificate
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    found = (parse_identity_uri(uri) for uri in names.get_values_for_type(x509.UniformResourceIdentifier))
    return [identity for identity in found if identity is not None]


def certificate_identity(certificate: bytes | x509.Certificate, run_id: str | None = None) -> CertIdentity | None:
    """The one node identity (of `run_id`, when given) a certificate names; None if none or several."""
    found = [i for i in certificate_identities(certificate) if run_id is None or i.run_id == run_id]
    return found[0] if len(found) == 1 else None


def certificate_hosts(certificate: bytes | x509.Certificate) -> list[str]:
    """The DNS names and IP addresses a certificate (PEM or DER bytes) is valid for, as a server."""
    cert = _load(certificate) if isinstance(certificate, bytes) else certificate
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return [*san.get_values_for_type(x509.DNSName), *map(str, san.get_values_for_type(x509.IPAddress))]


def ca_run_id(directory: str | Path) -> str:
    """The run id the CA in `directory` was made for."""
    cert = _load(_read(Path(directory) / CA_CERT))
    runs = [uri.removeprefix(f"{SCHEME}://").partition("/")[0] for uri in _uris(cert) if uri.endswith("/ca")]
    if not runs:
        raise PkiError(f"{Path(directory) / CA_CERT} is no p2ptrain CA (it names no run)")
    return runs[0]


def init_ca(directory: str | Path, run_id: str, *, days: int = DEFAULT_DAYS, force: bool = False) -> Path:
    """Make a CA for run `run_id` in `directory` (ca.crt, ca.key); returns the certificate's path."""
    _check_run_id(run_id)
    directory = Path(directory)
    cert_path, key_path = directory / CA_CERT, directory / CA_KEY
    _may_write(force, cert_path, key_path)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"p2ptrain CA {run_id}"[:64])])
    cert = (_builder(name, name, key.public_key(), days)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(f"{SCHEME}://{run_id}/ca")]),
                           critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    _write(key_path, _key_pem(key), private=True)
    _write(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    return cert_path


def node_files(directory: str | Path, name: int | str) -> tuple[Path, Path]:
    """Where `issue` writes node `name`'s certificate and key: node-<rank>.crt/.key, ps.crt/.key."""
    stem = PS_NAME if str(name) == PS_NAME else f"node-{_check_name(name)}"
    return Path(directory) / f"{stem}.crt", Path(directory) / f"{stem}.key"


def issue(directory: str | Path, name: int | str, *, hosts: tuple[str, ...] | list[str] = (),
          days: int = DEFAULT_DAYS, force: bool = False) -> tuple[Path, Path]:
    """Sign a certificate for node `name` (a rank, or "ps") with the CA in `directory`, valid for
    server names `hosts` (DNS names or IP addresses) as well; returns (certificate, key) paths."""
    name = _check_name(name)
    directory = Path(directory)
    run_id = ca_run_id(directory)
    ca_cert = _load(_read(directory / CA_CERT))
    ca_key = serialization.load_pem_private_key(_read(directory / CA_KEY), password=None)
    cert_path, key_path = node_files(directory, name)
    _may_write(force, cert_path, key_path)
    key = ec.generate_private_key(ec.SECP256R1())
    alt_names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(identity_uri(run_id, name))]
    for host in dict.fromkeys(hosts):
        alt_names.append(_host_name(host))
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{run_id}/{name}"[:64])])
    cert = (_builder(subject, ca_cert.subject, key.public_key(), days)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    _write(key_path, _key_pem(key), private=True)
    _write(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path


def describe(path: str | Path) -> str:
    """One line about a certificate file: whom it names, for which hosts, until when."""
    cert = _load(_read(Path(path)))
    hosts = certificate_hosts(cert)
    names = ", ".join(i.uri for i in certificate_identities(cert)) or "no p2ptrain identity"
    return f"{path}: {names}; hosts {hosts or 'none'}; valid until {cert.not_valid_after_utc:%Y-%m-%d}"


# Helpers -------------------------------------------------------------------------------------------
def _check_run_id(run_id: str) -> str:
    if not run_id or not all(c.isalnum() or c in "-_." for c in run_id) or len(run_id) > 48:
        raise PkiError(f"run id {run_id!r} must be 1-48 letters, digits, '-', '_' or '.'")
    return run_id


def _check_name(name: int | str) -> str:
    text = str(name)
    if text == PS_NAME or (text.isdigit() and int(text) < 2 ** 31):
        return str(int(text)) if text.isdigit() else text
    raise PkiError(f"a node is named by its rank (0, 1, ...) or {PS_NAME!r}, not {name!r}")


def _uris(cert: x509.Certificate) -> list[str]:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return [u for u in san.get_values_for_type(x509.UniformResourceIdentifier) if u.startswith(f"{SCHEME}://")]


def _host_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        if not host or any(c.isspace() for c in host):
            raise PkiError(f"host name {host!r} is empty or has spaces") from None
        return x509.DNSName(host)


def _builder(subject: x509.Name, issuer: x509.Name, public_key, days: int) -> x509.CertificateBuilder:
    if not 0 < days <= 36500:
        raise PkiError(f"--days must be between 1 and 36500, got {days}")
    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days)))


def _key_pem(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _load(data: bytes) -> x509.Certificate:
    try:
        if data.lstrip().startswith(b"-----BEGIN"):
            return x509.load_pem_x509_certificate(data)
        return x509.load_der_x509_certificate(data)
    except ValueError as exc:
        raise PkiError(f"not a certificate: {exc}") from None


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        hint = " (make one with `p2ptrain pki init`)" if path.name in (CA_CERT, CA_KEY) else ""
        raise PkiError(f"cannot read {path}: {exc.strerror or exc}{hint}") from None


def _may_write(force: bool, *paths: Path) -> None:
    existing = [str(p) for p in paths if p.exists()]
    if existing and not force:
        raise PkiError(f"{', '.join(existing)} exist(s); pass --force to replace")


def _write(path: Path, data: bytes, *, private: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    fd = os.open(path, flags, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    if private:
        os.chmod(path, 0o600)


__all__ = ["CertIdentity", "PkiError", "PS_NAME", "ca_run_id", "certificate_hosts", "certificate_identities",
           "certificate_identity", "describe", "identity_uri", "init_ca", "issue", "node_files", "parse_identity_uri"]
