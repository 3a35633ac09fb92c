"""Per-node certificates for generated clusters (`p2ptrain kubernetes --pki`, `p2ptrain compose --pki`):
the node's certificate and key from a `p2ptrain pki` folder, issued there when missing. A certificate
found there is used only if it names that node of the CA's run and holds every host name its peers
dial; never is the CA key read into anything written out (only `issue` reads it, to sign)."""
from __future__ import annotations

from pathlib import Path

from p2ptrain import pki


def node_certificate(directory: str | Path, name: int | str, hosts: list[str]) -> tuple[Path, Path]:
    """(certificate, key) paths of node `name` (a rank or "ps"), valid for `hosts`; ValueError
    (PkiError) when a certificate there names another node or run, or lacks one of the hosts."""
    run_id = pki.ca_run_id(directory)
    cert_path, key_path = pki.node_files(directory, name)
    if not cert_path.exists() and not key_path.exists():
        pki.issue(directory, name, hosts=hosts)
    cert = read(cert_path)
    read(key_path)
    identity = pki.certificate_identity(cert, run_id)
    if identity is None or identity.name != str(name):
        raise ValueError(f"{cert_path} does not name node {name} of run {run_id} (the CA's): issue it again "
                         f"(p2ptrain pki issue --dir {directory} --force ...) or delete it")
    if missing := sorted(set(hosts) - set(pki.certificate_hosts(cert))):
        raise ValueError(f"{cert_path} is not valid for {', '.join(missing)}, the name its peers dial: delete it "
                         "(it is issued again) or issue it with those --host names")
    return cert_path, key_path


def ca_certificate(directory: str | Path) -> Path:
    return Path(directory) / pki.CA_CERT


def read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None


__all__ = ["ca_certificate", "node_certificate", "read"]
