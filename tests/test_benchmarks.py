"""The research studies in the top-level `benchmarks/`: outside the wheel, still runnable from a checkout.

Also holds the house rule for benchmark and launcher code: no module imports another module's
`_private` names (a needed helper gets a public, documented name instead).
"""
from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile

import pytest

from tests.conftest import ROOT, node_env


@pytest.mark.timeout(120)
def test_benchmarks_are_not_in_the_wheel(tmp_path):
    """Build the wheel as a user's pip would (a few seconds: pure Python) and list what it holds.

    From a copy of the checkout: setuptools builds in the source tree, and a stale build/lib
    (say, from before the study moved) would end up in the wheel.
    """
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "runs", "__pycache__", ".pytest_cache", ".hypothesis"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                           "--no-index", str(source), "-w", str(tmp_path)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = tmp_path.glob("p2ptrain-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}
    assert {"p2ptrain", "launcher"} <= top, top
    assert "p2ptrain/bench/transport.py" in names and "p2ptrain/bench/baselines.py" in names
    assert not [n for n in names if n.startswith("benchmarks/") or "grpc_study" in n], top
    assert (ROOT / "benchmarks" / "grpc_study.py").is_file()


def _python_files(*dirs: str):
    for d in dirs:
        yield from sorted((ROOT / d).rglob("*.py"))


def _module_name(path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_package_code_never_imports_benchmarks():
    offenders = []
    for path in _python_files("p2ptrain", "launcher"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            offenders += [f"{path.relative_to(ROOT)}:{node.lineno}" for n in names
                          if n == "benchmarks" or n.startswith("benchmarks.")]
    assert offenders == []


def test_no_private_names_imported_across_modules():
    """`from other.module import _helper` in bench, launcher or benchmarks code: name the helper."""
    offenders = []
    for path in _python_files("p2ptrain/bench", "launcher", "benchmarks"):
        here = _module_name(path)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom) or node.level or node.module == here:
                continue
            if (node.module or "").split(".")[0] not in ("p2ptrain", "launcher", "benchmarks"):
                continue  # third-party modules are their own business
            offenders += [f"{path.relative_to(ROOT)}:{node.lineno}: from {node.module} import {a.name}"
                          for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    assert offenders == []


@pytest.mark.timeout(60)
def test_grpc_study_imports_and_parses_configurations():
    from benchmarks import grpc_study

    cfg = grpc_study.parse_config("client=sync server=aio chunk=1M conns=2 mallopt=1")
    assert (cfg.client, cfg.server, cfg.chunk, cfg.conns, cfg.mallopt) == ("sync", "aio", 2**20, 2, True)
    assert grpc_study.spec_of(cfg).startswith("sync->aio")
    assert set(grpc_study.SUITES) >= {"quick", "malloc"}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("entry", [["-m", "benchmarks.grpc_study"], ["benchmarks/grpc_study.py"]],
                         ids=["module", "script"])
def test_grpc_study_help_runs_from_a_checkout(entry):
    proc = subprocess.run([sys.executable, *entry, "--help"], cwd=ROOT, env=node_env(), capture_output=True,
                          text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "usage: python -m benchmarks.grpc_study" in proc.stdout and "--baselines" in proc.stdout


@pytest.mark.timeout(90)
def test_grpc_study_script_measures_from_another_directory(tmp_path):
    """Run by path from elsewhere: the spawned gRPC server and client still find their functions."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "grpc_study.py"), "--size-mib", "0.25",
                           "--reps", "1", "--runs", "1", "--config", "chunk=64K name=tiny", "--quiet"],
                          cwd=tmp_path, env=dict(node_env(), PYTHONPATH=""), capture_output=True, text=True,
                          timeout=80)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = next(line for line in proc.stdout.splitlines() if line.startswith("tiny"))
    assert "FAILED" not in row and float(row.split()[1]) > 0, proc.stdout
