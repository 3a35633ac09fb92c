"""The checked-in p2ptrain/_proto modules must be exactly what scripts/gen_proto.py generates
from proto/p2ptrain/v1/*.proto: the .proto file is the single source of the wire contract."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parent.parent
CHECKED_IN = ROOT / "p2ptrain" / "_proto"
FIX = "run `python scripts/gen_proto.py` and commit the regenerated p2ptrain/_proto/"


def _load_gen_proto():
    spec = importlib.util.spec_from_file_location("gen_proto_under_test", ROOT / "scripts" / "gen_proto.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> Path:
    pytest.importorskip("grpc_tools", reason="grpcio-tools (dev dependency) generates the proto modules")
    out = tmp_path_factory.mktemp("generated_proto")
    written = _load_gen_proto().generate(out)
    assert written, "gen_proto.generate() wrote no files"
    assert all(Path(p).parent == out for p in written)
    return out


def _python_files(folder: Path) -> set[str]:
    return {p.name for p in folder.glob("*.py")}


def test_generated_file_set_matches_checked_in(generated: Path):
    fresh, committed = _python_files(generated), _python_files(CHECKED_IN)
    assert fresh == {"__init__.py", "p2ptrain_pb2.py", "p2ptrain_pb2_grpc.py"}
    assert fresh == committed, (
        f"p2ptrain/_proto/ is out of date: missing {sorted(fresh - committed)}, "
        f"stale {sorted(committed - fresh)}; {FIX}")


@pytest.mark.parametrize("name", ["__init__.py", "p2ptrain_pb2.py", "p2ptrain_pb2_grpc.py"])
def test_generated_file_is_byte_identical(generated: Path, name: str):
    fresh = (generated / name).read_bytes()
    committed_path = CHECKED_IN / name
    assert committed_path.exists(), f"p2ptrain/_proto/{name} is missing; {FIX}"
    committed = committed_path.read_bytes()
    assert fresh == committed, (
        f"p2ptrain/_proto/{name} differs from what proto/p2ptrain/v1/*.proto generates "
        f"({len(committed)} bytes checked in, {len(fresh)} generated); {FIX}")


def test_generated_modules_use_package_imports(generated: Path):
    grpc_module = (generated / "p2ptrain_pb2_grpc.py").read_text()
    assert "from p2ptrain._proto import p2ptrain_pb2 as" in grpc_module
    assert "\nimport p2ptrain_pb2" not in grpc_module
