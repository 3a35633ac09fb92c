"""The CUDA path, on a machine with a GPU (skipped elsewhere): received tensors land in pinned host
buffers and reach the GPU by non-blocking copies on a side stream, and a cluster training on the
GPU ends where the same cluster on the CPU does (the same math, up to float rounding).

In-process clusters (tests/cluster.py, real gRPC between real Transports) for the staging and the
numerics; one real multi-process `launch --device cuda` against `--device cpu` for the whole node.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import p2ptrain
from p2ptrain.algorithms.allreduce import AllReduceSGD
from p2ptrain.algorithms.sgp import SGP
from p2ptrain.topology import build_topology
from p2ptrain.transport import TransportOptions
from tests.cluster import run_cluster
from tests.test_launch_e2e import launch
from tests.test_optimizer import batch, net

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

N, STEPS = 3, 12


def algorithm_named(name: str, comm):
    if name == "sgp":
        return SGP(comm, build_topology("exponential", N), overlap=1)
    return AllReduceSGD(comm, average="gradients")


def train(device: str, algorithm: str) -> list[dict]:
    """N nodes, each training `net()` on its own shard on `device`; returns every node's final state
    (on the CPU) and what the staging saw: (host buffer pinned, result on the GPU) per message."""
    options = TransportOptions(send_timeout=30.0, link_deadline=5.0, pin_memory=device == "cuda")

    def body(rank, comm):
        seen = []
        stage = comm.staging.to_device

        def observed(message):
            on_device = stage(message)
            # (an empty tensor has no memory to pin: a ring's segment of a tiny bucket can be empty)
            seen.append((message.tensor.numel() == 0 or message.tensor.is_pinned(), on_device.device.type))
            return on_device

        comm.staging.to_device = observed
        model = net().to(device)
        opt = p2ptrain.DecentralizedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                              model=model, algorithm=algorithm_named(algorithm, comm), comm=comm)
        for step in range(STEPS):
            model.train()
            x, y = batch(rank, step)
            F.mse_loss(model(x.to(device)), y.to(device)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        opt.finish()
        state = {key: value.detach().cpu().clone() for key, value in model.state_dict().items()}
        return state, seen, comm.transport.inbox.pool.pin_memory

    return run_cluster(N, body, options=options, device=device)


@pytest.mark.parametrize("algorithm", ["sgp", "allreduce"])
def test_a_gpu_cluster_ends_where_the_cpu_cluster_does_through_pinned_non_blocking_copies(algorithm):
    on_gpu = train("cuda", algorithm)
    on_cpu = train("cpu", algorithm)
    for (gpu_state, seen, pinned_pool), (cpu_state, cpu_seen, cpu_pool) in zip(on_gpu, on_cpu):
        assert pinned_pool and not cpu_pool
        assert seen and all(pinned and where == "cuda" for pinned, where in seen), seen[:4]
        assert len(seen) == len(cpu_seen)  # the same messages, only staged differently
        for key, value in cpu_state.items():
            if value.dtype.is_floating_point:
                torch.testing.assert_close(gpu_state[key], value, rtol=1e-4, atol=1e-5, msg=key)
            else:
                assert torch.equal(gpu_state[key], value), key


def test_staged_copies_release_their_pinned_buffers_once_the_gpu_has_them():
    """The pool gets a buffer back only after the copy that reads it has finished (an event), never
    while the GPU may still be reading it."""
    options = TransportOptions(send_timeout=30.0, link_deadline=5.0, pin_memory=True)

    def body(rank, comm):
        model = net().to("cuda")
        sgp = SGP(comm, build_topology("exponential", N), overlap=0)
        opt = p2ptrain.DecentralizedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model=model,
                                              algorithm=sgp, comm=comm)
        before = copy.deepcopy(model.state_dict())
        for _ in range(4):
            opt.step()
        opt.finish()
        comm.staging.synchronize()
        return before, model.state_dict(), comm.staging.pending == 0

    for before, after, drained in run_cluster(N, body, options=options, device="cuda"):
        assert drained
        for key, value in before.items():  # lr 0 and identical models: mixing changes nothing
            torch.testing.assert_close(after[key], value, rtol=0, atol=1e-6, msg=key)


VARIANTS = [  # every algorithm, and the variants whose code paths differ on a device
    ("allreduce", []),
    ("allreduce", ["--average", "models", "--overlap", "1", "--compression", "int8"]),
    ("sgp", ["--overlap", "1", "--optimizer", "adamw"]),
    ("dpsgd", []),
    ("relaysgd", []),
    ("pipesgd", ["--compression", "int8", "--warmup-steps", "5"]),
    ("diloco", ["--inner-steps", "10"]),
    ("diloco", ["--inner-steps", "10", "--fragments", "2", "--outer-delay", "1", "--compression", "int4"]),
    ("gossip-diloco", ["--inner-steps", "10"]),
    ("gem", ["--ps-policy", "gem"]),
]


SYNCHRONOUS = {"allreduce", "pipesgd", "relaysgd", "diloco"}


def launched(tmp_path, device: str, algorithm: str, extra: list[str]) -> dict:
    return launch(tmp_path / device, "--nodes", "3", "--algorithm", algorithm, *extra, "--steps", "100",
                  "--num-train", "3000", "--device", device, "--log-every", "20", "--no-metrics")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("algorithm,extra", VARIANTS, ids=lambda v: v if isinstance(v, str) else "-".join(v))
def test_launch_on_cuda_trains_like_launch_on_cpu(tmp_path, algorithm, extra):
    """Every algorithm as a user launches it, once on the GPU and once on the CPU: the nodes say
    which device they trained on, and end at the same accuracy (timing decides which late messages
    an asynchronous algorithm folds in, so the two runs agree up to that)."""
    gpu, cpu = launched(tmp_path, "cuda", algorithm, extra), launched(tmp_path, "cpu", algorithm, extra)
    assert [n["device"].split(":")[0] for n in gpu["nodes"]] == ["cuda"] * len(gpu["nodes"])
    assert {n["device"] for n in cpu["nodes"]} == {"cpu"}
    accuracy = lambda report: [n["test_accuracy"] for n in report["nodes"]]  # noqa: E731
    if algorithm == "gem":  # the server's model is the product; asynchronous workers' copies vary 0.47-0.77
        assert gpu["ps"]["test_accuracy"] == pytest.approx(cpu["ps"]["test_accuracy"], abs=0.03)
    elif algorithm in SYNCHRONOUS:  # the same arithmetic in the same order, rounding apart (which 100
        # steps of early training, through int8 rounding, can grow to 0.0125 of accuracy: seen, pipesgd)
        assert accuracy(gpu) == pytest.approx(accuracy(cpu), abs=0.02)
    else:
        mean = lambda report: sum(accuracy(report)) / len(report["nodes"])  # noqa: E731
        assert mean(gpu) == pytest.approx(mean(cpu), abs=0.03), (accuracy(gpu), accuracy(cpu))
