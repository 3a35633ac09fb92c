"""`p2ptrain pki`: a run's CA and per-node certificates, as a user makes them from the command line."""
from __future__ import annotations

import json
import shutil
import ssl
import stat
import subprocess
import sys

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
from tests.conftest import ROOT, node_env


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


def test_launch_with_pki_runs_a_cluster_in_which_each_node_holds_only_its_own_identity(tmp_path):
    """`launch --pki DIR`: every node gets its own certificate (issued here), mutual TLS and the CA's
    run id; the run trains to the end with push-sum mass intact. A certificate that names another
    node stops the launch before any node starts, with a one-line reason."""
    folder, out = tmp_path / "pki", tmp_path / "run"
    init_ca(folder, "launch-run")
    argv = [sys.executable, "-m", "p2ptrain", "launch", "--nodes", "3", "--algorithm", "sgp", "--steps", "30",
            "--model", "mlp", "--dataset", "synthetic", "--no-live", "--no-metrics", "--timeout", "180",
            "--pki", str(folder)]
    proc = subprocess.run([*argv, "--out", str(out)], env=node_env(), capture_output=True, text=True, timeout=240,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert sum(node["ps_weight"] for node in report["nodes"]) == pytest.approx(3.0, abs=1e-6)
    assert [certificate_identity((folder / f"node-{r}.crt").read_bytes(), "launch-run").rank for r in range(3)] \
        == [0, 1, 2]
    shutil.copy(folder / "node-1.crt", folder / "node-0.crt")  # node 0 would speak as node 1
    proc = subprocess.run([*argv, "--out", str(tmp_path / "bad")], env=node_env(), capture_output=True, text=True,
                          timeout=240, cwd=ROOT)
    assert proc.returncode == EXIT_CONFIG and "does not name node 0" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "bad" / "report.json").exists()
