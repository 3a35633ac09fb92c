import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parent.parent


def node_env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def read_launch_header(proc: subprocess.Popen, nodes: int) -> str:
    """The launcher's stderr up to its "launching N nodes" line (fails if it ends before)."""
    header = ""
    while f"launching {nodes} nodes" not in header:
        line = proc.stderr.readline()
        assert line, f"launcher ended early: {header}"
        header += line
    return header


def run_processes(argvs: list[list[str]], timeout: float, log_dir: Path) -> None:
    """Run real processes in parallel; fail with their log tails if any fails or times out."""
    procs = []
    try:
        for i, argv in enumerate(argvs):
            log = open(log_dir / f"proc{i}.log", "w")
            procs.append((subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=node_env()), log))
        for proc, _ in procs:
            proc.wait(timeout=timeout)
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    failed = [(i, p.returncode) for i, (p, _) in enumerate(procs) if p.returncode != 0]
    if failed:
        tails = "\n".join(f"--- proc {i} (exit {code}) ---\n" + (log_dir / f"proc{i}.log").read_text()[-3000:]
                          for i, code in failed)
        pytest.fail(f"processes failed: {failed}\n{tails}")


@pytest.fixture
def python() -> str:
    return sys.executable


@pytest.fixture
def receiver():
    """Node 1 of a 3-node world (nodes 0 and 2 are not started), accepting NUMEL float32
    (tests/test_transport.py's constants), for tests that speak raw PushTensor streams to it."""
    from tests.test_transport import KIND, NUMEL, nodes

    with nodes(3, [1]) as t:
        t[1].expect(KIND, torch.float32, NUMEL)
        yield t[1]


@pytest.fixture
def raw(receiver):
    """Synchronous stream_unary PushTensor call against the receiver, sending raw chunk bytes."""
    import grpc

    from p2ptrain._proto import p2ptrain_pb2 as pb
    from p2ptrain.transport.server import PUSH_METHOD

    with grpc.insecure_channel(receiver.peers[1]) as channel:
        yield channel.stream_unary(PUSH_METHOD, request_serializer=lambda b: b,
                                   response_deserializer=pb.Ack.FromString)
