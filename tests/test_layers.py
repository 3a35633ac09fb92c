"""The project's layering, read from its own source (the arrows of the architecture page): who may
import whom, who may see gRPC types, and that tests use public names only. Each rule fails with
the file and line that breaks it."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import ROOT

PACKAGE = ROOT / "p2ptrain"
# The gRPC path: the client channels, the servers (node, forwarding, health, parameter server),
# credentials, stream reading and the in-process stand-in for a call. Everything else sees the
# transport's own SendFailure.
GRPC_PATH = {"p2ptrain/transport/paths/grpc_path.py", "p2ptrain/transport/server.py",
             "p2ptrain/transport/forwarding.py", "p2ptrain/transport/health.py", "p2ptrain/transport/security.py",
             "p2ptrain/transport/streams.py", "p2ptrain/transport/paths/reverse.py", "p2ptrain/ps/server.py",
             "p2ptrain/ps/client.py", "p2ptrain/transport/grpc_wakeups.py", "p2ptrain/transport/paths/local_calls.py"}


def sources(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py") if "_proto" not in p.parts)


def imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) of every import in `path` (relative imports resolved)."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            module = node.module
            if node.level:
                package = path.relative_to(ROOT).with_suffix("").parts[:-node.level]
                module = ".".join((*package, module))
            found.append((node.lineno, module, [alias.name for alias in node.names]))
    return found


def where(path: Path, line: int) -> str:
    return f"{path.relative_to(ROOT)}:{line}"


def test_only_the_grpc_path_imports_grpc():
    offenders = [where(path, line) for path in sources("p2ptrain", "launcher")
                 for line, module, _ in imports(path)
                 if module.split(".")[0] in ("grpc", "grpc_health", "grpc_reflection")
                 and str(path.relative_to(ROOT)) not in GRPC_PATH]
    assert offenders == []


@pytest.mark.parametrize("folder, forbidden", [
    ("launcher", "p2ptrain.bench"),            # the launcher runs clusters; benchmarks use it, not the reverse
    ("p2ptrain/train", "p2ptrain.api"),         # nothing below the API imports it
    ("p2ptrain/transport", "p2ptrain.train"),  # the transport never knows about training
    ("p2ptrain/transport", "p2ptrain.algorithms"),
    ("p2ptrain/algorithms", "p2ptrain.transport"),  # algorithms see the Comm protocol only
    ("p2ptrain/algorithms", "p2ptrain.communicator"),
    ("p2ptrain/ps", "p2ptrain.node"),           # the parameter server is a role beside the node
    ("p2ptrain/metrics.py", "p2ptrain."),       # metrics are observed by everyone and call nobody
])
def test_arrows_point_one_way(folder, forbidden):
    paths = [ROOT / folder] if folder.endswith(".py") else sources(folder)
    offenders = [where(path, line) for path in paths for line, module, _ in imports(path)
                 if (module + ".").startswith(forbidden if forbidden.endswith(".") else forbidden + ".")
                 and not (folder == "p2ptrain/algorithms" and _lazy_torch_side(path, line))]
    assert offenders == []


def _lazy_torch_side(path: Path, line: int) -> bool:
    """An algorithm may import the transport's validation helpers lazily, inside a function (they
    need torch, which algorithms keep out of their module import)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.lineno < line <= node.end_lineno:
            return True
    return False


def test_no_module_imports_another_modules_private_names():
    offenders = [f"{where(path, line)} {module}.{name}" for path in sources("p2ptrain", "launcher", "benchmarks")
                 for line, module, names in imports(path) for name in names
                 if name.startswith("_") and not name.startswith("__") and module.startswith(("p2ptrain", "launcher"))]
    assert offenders == []


def test_algorithms_start_no_threads_of_their_own():
    """Overlap belongs to the engine: an algorithm asks the Comm for background work."""
    offenders = [where(path, line) for path in sources("p2ptrain/algorithms") for line, module, names in imports(path)
                 if module == "threading" or (module == "concurrent.futures" and "ThreadPoolExecutor" in names)]
    offenders += [where(path, node.lineno) for path in sources("p2ptrain/algorithms")
                  for node in ast.walk(ast.parse(path.read_text()))
                  if isinstance(node, ast.Attribute) and node.attr in ("ThreadPoolExecutor", "Thread")]
    assert offenders == []


def test_tests_use_public_names_only():
    """No test reaches into a private attribute of a project object (`obj._name`): what a test needs
    is an interface, and it is named."""
    offenders = []
    for path in sources("tests"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                offenders.append(f"{where(path, node.lineno)} .{node.attr}")
    assert offenders == []
