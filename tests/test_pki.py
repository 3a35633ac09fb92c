"""`p2ptrain pki`: a run's CA and per-node certificates, as a user makes them from the command line."""
from __future__ import annotations

import ssl
import stat

import pytest

from p2ptrain.cli import main
from p2ptrain.exit_codes import EXIT_CONFIG
from p2ptrain.pki import (
    CertIdentity,
    PkiError,
    ca_run_id,
    certificate_identity,
    identity_uri,
    init_ca,
    issue,
    parse_identity_uri,
)


def test_pki_commands_make_a_ca_and_certificates_that_name_their_nodes(tmp_path, capsys):
    folder = tmp_path / "pki"
    assert main(["pki", "init", "--dir", str(folder), "--run-id", "run-7"]) == 0
    assert main(["pki", "issue", "--dir", str(folder), "--nodes", "3", "--ps", "--host", "node-{rank}",
                 "--host", "127.0.0.1"]) == 0
    out = capsys.readouterr().out
    assert "p2ptrain://run-7/2" in out and "p2ptrain://run-7/ps" in out
    assert ca_run_id(folder) == "run-7"
    for rank in range(3):
        cert = (folder / f"node-{rank}.crt").read_bytes()
        assert certificate_identity(cert, "run-7") == CertIdentity("run-7", str(rank))
        assert certificate_identity(cert, "another-run") is None
        assert stat.S_IMODE((folder / f"node-{rank}.key").stat().st_mode) == 0o600
    assert certificate_identity((folder / "ps.crt").read_bytes()).rank is None
    assert stat.S_IMODE((folder / "ca.key").stat().st_mode) == 0o600
    # the chain verifies with the ssl module, and the key matches the certificate
    context = ssl.create_default_context(cafile=str(folder / "ca.crt"))
    context.load_cert_chain(folder / "node-1.crt", folder / "node-1.key")


def test_pki_refuses_to_overwrite_and_explains_bad_input(tmp_path, capsys):
    folder = tmp_path / "pki"
    with pytest.raises(PkiError, match="p2ptrain pki init"):
        issue(folder, 0)  # no CA yet
    init_ca(folder, "r")
    with pytest.raises(PkiError, match="--force"):
        init_ca(folder, "r")
    issue(folder, 0)
    with pytest.raises(SystemExit) as exc:
        main(["pki", "issue", "--dir", str(folder), "--rank", "0"])
    assert exc.value.code == EXIT_CONFIG and "--force" in capsys.readouterr().err
    issue(folder, 0, force=True)
    for bad_run in ("", "a b", "x/y", "r" * 49):
        with pytest.raises(PkiError, match="run id"):
            init_ca(tmp_path / "other", bad_run)
    for bad_name in (-1, "node", "1/2"):
        with pytest.raises(PkiError, match="rank"):
            issue(folder, bad_name)


def test_identity_uris_round_trip_and_reject_lookalikes():
    assert identity_uri("r", 3) == "p2ptrain://r/3"
    assert parse_identity_uri("p2ptrain://r/3") == CertIdentity("r", "3")
    assert parse_identity_uri("p2ptrain://r/ps").rank is None
    for uri in ("spiffe://r/3", "p2ptrain://r/3/4", "p2ptrain:///3", "p2ptrain://r/x", "p2ptrain://r/ca"):
        assert parse_identity_uri(uri) is None, uri
