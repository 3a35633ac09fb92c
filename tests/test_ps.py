"""The parameter server over real gRPC on 127.0.0.1: concurrent commits are applied exactly once and
never torn, staleness is exact, bad or broken commits never touch θ, and a real ps + 3 workers run."""
from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
import threading
import time

import grpc
import pytest
import torch

from launcher.ports import free_ports
from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.metrics import PsMetrics
from p2ptrain.ps import ParameterServer, PsClient, PsError
from p2ptrain.ps.server import COMMIT_METHOD, grpc_options
from p2ptrain.transport.framing import encode_data, encode_header, iter_data_chunks, serialize_identity, tensor_bytes
from p2ptrain.transport.server import PUSH_METHOD
from tests.conftest import node_env, run_processes
from tests.test_transport import KIND, NUMEL, header, nodes, pending

torch.set_num_threads(1)

pytestmark = pytest.mark.timeout(90)

CHUNK = 16 * 1024  # small chunks: every θ / update below spans many of them


def wait_until(condition, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def raw_commit_stub(address: str):
    channel = grpc.insecure_channel(address, options=grpc_options())
    return channel, channel.stream_unary(COMMIT_METHOD, request_serializer=serialize_identity,
                                         response_deserializer=pb.CommitReply.FromString)


def commit_header(worker: int, size: int, base: int, message_id: int, **overrides) -> pb.TensorHeader:
    fields = dict(sender=worker, step=base, kind=pb.MESSAGE_KIND_PS_COMMIT, dtype=pb.DTYPE_FLOAT32, numel=size,
                  shape=[size], payload_bytes=size * 4, message_id=message_id)
    fields.update(overrides)
    return pb.TensorHeader(**fields)


@pytest.fixture
def server():
    theta0 = torch.arange(20_000, dtype=torch.float32) % 7 - 3
    metrics = PsMetrics()
    with ParameterServer(theta0, 4, listen="127.0.0.1:0", chunk_bytes=CHUNK, metrics=metrics, keep_log=True,
                         shutdown_grace=0.2) as ps:
        ps.theta0 = theta0
        ps.address = f"127.0.0.1:{ps.port}"
        yield ps


# -- 32 concurrent workers -------------------------------------------------------------------------
def test_concurrent_commits_are_applied_exactly_once_with_exact_staleness():
    workers, rounds, numel = 32, 6, 24_000
    gen = torch.Generator().manual_seed(0)
    theta0 = torch.randint(-50, 50, (numel,), generator=gen).float()
    # integer-valued updates: float32 sums of them are exact in any order, so "θ_final − θ_0 equals the
    # sum of all updates" can be checked bit for bit
    updates = {(w, k): torch.randint(-8, 9, (numel,), generator=gen).float()
               for w in range(workers) for k in range(rounds)}
    metrics = PsMetrics()
    results: dict[int, list[tuple[int, torch.Tensor, pb.CommitReply]]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(workers)

    with ParameterServer(theta0, workers, listen="127.0.0.1:0", chunk_bytes=CHUNK, metrics=metrics,
                         keep_log=True, shutdown_grace=0.2) as server:
        address = f"127.0.0.1:{server.port}"

        def worker(w: int) -> None:
            rng = random.Random(w)
            try:
                with PsClient(address, w, chunk_bytes=CHUNK, timeout=30) as client:
                    start.wait(30)
                    mine = results[w] = []
                    for k in range(rounds):
                        theta, version = client.pull()
                        time.sleep(rng.random() * 0.005)  # let others commit in between
                        reply = client.commit(updates[(w, k)], version)
                        mine.append((version, theta, reply))
                    client.done(rounds)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(w,)) for w in range(workers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not errors, errors
        assert server.wait(idle_timeout=5)  # every worker said Done
        final_version, theta_final = server.theta()
        log = server.commit_log()
        stats = server.stats()

    total = workers * rounds
    assert final_version == total
    # no lost and no double-applied commit: θ_final − θ_0 is exactly the sum of all updates
    assert torch.equal(theta_final - theta0, sum(updates.values()))
    # each commit was applied at its own version: apply positions are exactly 0 .. total-1
    applied = {}
    for w, records in results.items():
        for k, (base, _, reply) in enumerate(records):
            assert reply.ack.status == pb.Ack.STATUS_ACCEPTED, reply
            applied[reply.version - 1] = (w, k, base, reply)
    assert sorted(applied) == list(range(total))
    assert sorted((r.applied_at, r.worker) for r in log) == sorted((i, w) for i, (w, *_) in applied.items())
    # staleness = the number of commits the server applied between the worker's pull and its commit,
    # counted from the apply positions of everybody's replies
    histogram: dict[int, int] = {}
    for position, (w, k, base, reply) in applied.items():
        between = sum(1 for other in applied if base <= other < position)
        assert reply.staleness == between, (w, k, base, position)
        histogram[between] = histogram.get(between, 0) + 1
    assert stats["staleness_histogram"] == {str(tau): n for tau, n in sorted(histogram.items())}
    assert max(histogram) > 0  # the workers really did interleave
    # every pulled θ is a consistent snapshot: θ_0 plus exactly the commits applied before its version
    prefix = [theta0.clone()]
    for position in range(total):
        w, k, _, _ = applied[position]
        prefix.append(prefix[-1] + updates[(w, k)])
    for records in results.values():
        for base, theta, _ in records:
            assert torch.equal(theta, prefix[base])
    # metrics: per-worker commit counters and the staleness histogram
    assert metrics.registry.get_sample_value("p2ptrain_commits_total", {"worker": "5"}) == rounds
    assert metrics.registry.get_sample_value("p2ptrain_commit_staleness_count", {"worker": "5"}) == rounds
    assert metrics.registry.get_sample_value("p2ptrain_commit_bytes_total", {"worker": "5"}) == rounds * numel * 4
    assert metrics.registry.get_sample_value("p2ptrain_pull_bytes_total", {"worker": "5"}) == rounds * numel * 4
    assert metrics.registry.get_sample_value("p2ptrain_ps_version") == total
    assert metrics.registry.get_sample_value("p2ptrain_ps_workers_done") == workers


# -- broken and bad commits ------------------------------------------------------------------------
def broken_streams(server) -> int:
    """Commits the server dropped because their stream broke off: a cancelled call shows up on the
    server either as a cancellation (aborted_stream) or as an early end of the stream (truncated)."""
    rejected = server.stats()["rejected"]
    return rejected.get("aborted_stream", 0) + rejected.get("truncated", 0)


def _expect_untouched(server, version: int, theta: torch.Tensor) -> None:
    now_version, now = server.theta()
    assert now_version == version
    assert torch.equal(now, theta)


def _next_good_commit_applies(server, worker: int = 0) -> None:
    with PsClient(server.address, worker, chunk_bytes=CHUNK, timeout=10) as client:
        theta, version = client.pull()
        reply = client.commit(torch.ones_like(theta), version)
        assert reply.ack.status == pb.Ack.STATUS_ACCEPTED and reply.version == version + 1
        after, _ = client.pull()
        assert torch.equal(after, theta + 1)


def test_a_worker_that_disconnects_mid_stream_leaves_theta_untouched(server):
    version, theta = server.theta()
    numel = theta.numel()
    chunks = list(iter_data_chunks(tensor_bytes(torch.ones(numel)), CHUNK))

    # (1) the client's request iterator fails after the header and one data chunk: gRPC cancels the call
    def failing():
        yield encode_header(commit_header(0, numel, version, 1))
        yield chunks[0]
        # crash only once the server holds the half-received commit (else, on a loaded machine, the
        # cancel can overtake the header and there is nothing on the server to abort)
        wait_until(lambda: len(server.call(server.state.receiving)) == 1, what="the half-sent commit")
        raise ConnectionError("worker crashed")

    channel, commit = raw_commit_stub(server.address)
    with pytest.raises(grpc.RpcError):
        commit(failing(), timeout=10)
    channel.close()
    wait_until(lambda: broken_streams(server) == 1, what="the aborted commit")
    _expect_untouched(server, version, theta)

    # (2) the connection goes away while the stream hangs half-sent
    release = threading.Event()

    def hanging():
        yield encode_header(commit_header(1, numel, version, 2))
        yield chunks[0]
        release.wait(10)

    channel, commit = raw_commit_stub(server.address)
    future = commit.future(hanging(), timeout=10)
    wait_until(lambda: len(server.call(server.state.receiving)) == 1, what="the half-sent commit")
    channel.close()
    release.set()
    with pytest.raises((grpc.RpcError, grpc.FutureCancelledError)):
        future.result(10)
    wait_until(lambda: broken_streams(server) == 2, what="the second aborted commit")
    _expect_untouched(server, version, theta)

    # (3) the stream ends (half-close) before all announced bytes arrived: rejected as truncated
    channel, commit = raw_commit_stub(server.address)
    reply = commit(iter([encode_header(commit_header(2, numel, version, 3)), *chunks[:-1]]), timeout=10)
    channel.close()
    assert (reply.ack.status, reply.ack.reason) == (pb.Ack.STATUS_REJECTED, "truncated")
    _expect_untouched(server, version, theta)
    _next_good_commit_applies(server)
    assert len(server.call(server.state.receiving)) == 0


def test_a_killed_worker_process_mid_commit_leaves_theta_untouched(server, tmp_path):
    version, theta = server.theta()
    numel = theta.numel()
    first = [encode_header(commit_header(3, numel, version, 7)),
             next(iter_data_chunks(tensor_bytes(torch.ones(numel)), CHUNK))]
    (tmp_path / "chunks.bin").write_bytes(b"".join(len(c).to_bytes(4, "big") + c for c in first))
    script = textwrap.dedent(f"""
        import sys, time, grpc
        raw = open({str(tmp_path / "chunks.bin")!r}, "rb").read()
        chunks, pos = [], 0
        while pos < len(raw):
            n = int.from_bytes(raw[pos:pos + 4], "big"); chunks.append(raw[pos + 4:pos + 4 + n]); pos += 4 + n
        def stream():
            yield from chunks
            print("sent", flush=True)
            time.sleep(60)
        call = grpc.insecure_channel({server.address!r}).stream_unary({COMMIT_METHOD!r},
            request_serializer=lambda b: b, response_deserializer=lambda b: b)
        call(stream(), timeout=60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=node_env())
    try:
        assert proc.stdout.readline().strip() == "sent"
        wait_until(lambda: len(server.call(server.state.receiving)) == 1, what="the half-sent commit")
        proc.kill()
    finally:
        proc.kill()
        proc.wait(10)
    wait_until(lambda: broken_streams(server) == 1, what="the killed worker's commit")
    _expect_untouched(server, version, theta)
    _next_good_commit_applies(server, worker=3)


@pytest.mark.parametrize("overrides, payload, reason", [
    ({"sender": 4}, None, "unknown_worker"),  # the server expects workers 0..3
    ({"sender": 1000}, None, "unknown_worker"),
    ({"numel": 19_999, "shape": [19_999], "payload_bytes": 19_999 * 4}, None, "bad_size"),
    ({"payload_bytes": 20_000 * 2}, None, "bad_size"),
    ({"dtype": pb.DTYPE_FLOAT16, "payload_bytes": 20_000 * 2}, torch.ones(20_000, dtype=torch.float16), "bad_dtype"),
    ({"dtype": pb.DTYPE_FLOAT64, "payload_bytes": 20_000 * 8}, torch.ones(20_000, dtype=torch.float64), "bad_dtype"),
    ({"kind": pb.MESSAGE_KIND_PUSH_SUM}, None, "unexpected_kind"),
    ({"step": 5}, None, "future_version"),  # θ is at version 0
    ({"codec": pb.CODEC_INT8_QUANTIZE}, None, "bad_codec"),
    ({"commit_scaling": 9}, None, "bad_scaling"),
    ({}, torch.full((20_000,), float("nan")), "non_finite"),
    ({}, torch.ones(20_001), "payload_overflow"),
])
def test_bad_commits_are_rejected_with_a_reason_and_the_server_keeps_serving(server, overrides, payload, reason):
    version, theta = server.theta()
    header = commit_header(0, 20_000, version, 11, **overrides)
    payload = torch.ones(20_000) if payload is None else payload
    channel, commit = raw_commit_stub(server.address)
    reply = commit(iter([encode_header(header), *iter_data_chunks(tensor_bytes(payload), CHUNK)]), timeout=10)
    channel.close()
    assert reply.ack.status == pb.Ack.STATUS_REJECTED
    assert reply.ack.reason == reason and reply.ack.detail
    assert server.stats()["rejected"] == {reason: 1}
    assert server.metrics.registry.get_sample_value("p2ptrain_rejected_commits_total", {"reason": reason}) == 1
    _expect_untouched(server, version, theta)
    _next_good_commit_applies(server)


@pytest.mark.parametrize("stream, reason", [
    ([], "empty_stream"),
    ([encode_data(b"\0" * 16)], "missing_header"),
    ([b"\x0a\xff\xff"], "malformed_chunk"),
])
def test_malformed_commit_streams_are_rejected(server, stream, reason):
    channel, commit = raw_commit_stub(server.address)
    reply = commit(iter(stream), timeout=10)
    channel.close()
    assert (reply.ack.status, reply.ack.reason) == (pb.Ack.STATUS_REJECTED, reason)
    _next_good_commit_applies(server)


def test_a_retried_commit_is_acknowledged_once_and_applied_once(server):
    version, theta = server.theta()
    numel = theta.numel()
    stream = [encode_header(commit_header(2, numel, version, 42)),
              *iter_data_chunks(tensor_bytes(torch.full((numel,), 2.0)), CHUNK)]
    channel, commit = raw_commit_stub(server.address)
    first = commit(iter(stream), timeout=10)
    again = commit(iter(stream), timeout=10)
    channel.close()
    assert first.ack.status == pb.Ack.STATUS_ACCEPTED
    assert again.ack.status == pb.Ack.STATUS_DUPLICATE
    assert (again.version, again.staleness) == (first.version, first.staleness)
    now_version, now = server.theta()
    assert now_version == version + 1 and torch.equal(now, theta + 2)


def test_pull_and_done_refuse_unknown_workers_and_other_models(server):
    with PsClient(server.address, 9, timeout=10) as client:
        with pytest.raises(PsError, match="unknown_worker") as info:
            client.pull()
        assert info.value.reason == "INVALID_ARGUMENT"
        with pytest.raises(PsError, match="unknown_worker"):
            client.done(1)
    with PsClient(server.address, 0, timeout=10) as client:
        with pytest.raises(PsError, match="different models"):
            client.pull(torch.empty(10))
    _next_good_commit_applies(server)


def test_a_fingerprint_mismatch_is_refused():
    with ParameterServer(torch.zeros(4), 1, listen="127.0.0.1:0", fingerprint="server", shutdown_grace=0.2) as ps:
        with PsClient(f"127.0.0.1:{ps.port}", 0, fingerprint="worker", timeout=10) as client:
            with pytest.raises(PsError, match="fingerprint") as info:
                client.pull()
            assert info.value.reason == "FAILED_PRECONDITION"


def test_wait_returns_false_when_workers_go_quiet():
    with ParameterServer(torch.zeros(4), 2, listen="127.0.0.1:0", shutdown_grace=0.2) as ps:
        with PsClient(f"127.0.0.1:{ps.port}", 0, timeout=10) as client:
            client.pull()  # (a Done counts only from a worker that pulled)
            client.done(0)
        started = time.monotonic()
        assert ps.wait(idle_timeout=0.3, poll=0.05) is False
        assert time.monotonic() - started < 5
        assert ps.stats()["workers_done"] == 1


# -- a real run: ps + 3 worker processes -----------------------------------------------------------
def test_ps_and_three_worker_processes_train_and_write_their_files(tmp_path, python):
    port, = free_ports(1)
    out = tmp_path / "run"
    common = ["--model", "mlp", "--hidden", "32", "--dataset", "synthetic", "--num-train", "1200", "--num-test",
              "300", "--world-size", "3", "--seed", "1", "--out", str(out), "--log-every", "5", "--threads", "1",
              "--chunk-mb", "0.05", "--peer-timeout", "60"]
    ps = [python, "-m", "p2ptrain", "ps", "--listen", f"127.0.0.1:{port}", *common]
    workers = [[python, "-m", "p2ptrain", "node", "--role", "worker", "--ps", f"127.0.0.1:{port}", "--rank", str(r),
                "--steps", "40", "--batch-size", "32", "--lr", "0.05", "--ps-policy", "gem", *common]
               for r in range(3)]
    run_processes([ps, *workers], timeout=80, log_dir=tmp_path)

    summary = json.loads((out / "ps.json").read_text())
    assert summary["complete"] is True
    assert summary["commits"] == summary["version"] == 120
    assert summary["workers_done"] == 3 and summary["commits_per_worker"] == [40, 40, 40]
    assert sum(summary["staleness_histogram"].values()) == 120
    # s never holds the worker's own last commit, so only each worker's first commit can have τ = 0
    histogram = {int(k): v for k, v in summary["staleness_histogram"].items()}
    assert histogram.get(0, 0) <= 3 and summary["mean_staleness"] >= 117 / 120
    assert summary["test_accuracy"] > 0.2  # chance is 0.1
    assert torch.load(out / "ps.snapshots.pt")["steps"][0] == 0
    first_losses, last_losses = [], []
    for rank in range(3):
        records = [json.loads(line) for line in (out / f"node{rank}.progress.jsonl").read_text().splitlines()]
        steps = [r for r in records if "step" in r]
        assert [r["step"] for r in steps] == list(range(5, 41, 5))
        for record in steps:
            assert {"rank", "step", "time", "loss", "bytes_sent", "bytes_received", "staleness",
                    "pi_median"} <= set(record)
            assert record["staleness"] >= (1 if record["step"] > 5 else 4 / 5)  # first commit may be τ = 0
        assert records[-1] == {"rank": rank, "event": "done"}
        first_losses.append(steps[0]["loss"])
        last_losses.append(steps[-1]["loss"])
        node = json.loads((out / f"node{rank}.json").read_text())
        assert node["role"] == "worker" and node["policy"] == "gem" and node["commits"] == 40
        assert node["bytes_sent"] == 40 * summary["numel"] * 4
        assert (out / f"node{rank}.snapshots.pt").exists()
    assert sum(last_losses) < 0.8 * sum(first_losses), (first_losses, last_losses)


# -- one header validator, overflow, Done (issue 10) -----------------------------------------------
HEADER_DEFECTS = {  # name: overrides of a valid header of n float32 elements
    "negative_shape": lambda n: {"shape": [-1, -n]},  # product n, but no tensor has that shape
    "shape_not_numel": lambda n: {"shape": [n + 1]},
    "negative_weight": lambda n: {"ps_weight": -1.0},
    "huge_weight": lambda n: {"ps_weight": 1.7e308},
    "nan_relay_count": lambda n: {"relay_count": float("nan")},
    "wrong_dtype": lambda n: {"dtype": pb.DTYPE_FLOAT64, "payload_bytes": 8 * n},
    "wrong_numel": lambda n: {"numel": n - 1, "shape": [n - 1], "payload_bytes": 4 * (n - 1)},
    "payload_bytes": lambda n: {"payload_bytes": 4 * n + 4},
    "unknown_codec": lambda n: {"codec": 7},
    "params_without_codec": lambda n: {"codec_params": [1.0]},
}


@pytest.mark.parametrize("defect", sorted(HEADER_DEFECTS))
def test_node_and_parameter_server_refuse_a_header_defect_alike(server, defect):
    """Nodes and the parameter server share one header validator: the same reason code each."""
    overrides = HEADER_DEFECTS[defect]
    with nodes(3, [1]) as t, grpc.insecure_channel(t[1].peers[1]) as node_channel:
        t[1].expect(KIND, torch.float32, NUMEL)
        push = node_channel.stream_unary(PUSH_METHOD, request_serializer=serialize_identity,
                                         response_deserializer=pb.Ack.FromString)
        node_ack = push(iter([encode_header(header(**overrides(NUMEL))),
                              *iter_data_chunks(tensor_bytes(torch.ones(NUMEL)), CHUNK)]), timeout=10)
        assert pending(t[1]) == 0
    version, theta = server.theta()
    channel, commit = raw_commit_stub(server.address)
    reply = commit(iter([encode_header(commit_header(0, 20_000, version, 5, **overrides(20_000))),
                         *iter_data_chunks(tensor_bytes(torch.ones(20_000)), CHUNK)]), timeout=10)
    channel.close()
    assert node_ack.status == reply.ack.status == pb.Ack.STATUS_REJECTED
    assert node_ack.reason == reply.ack.reason, (node_ack, reply)
    assert reply.ack.reason in ("bad_shape", "bad_weight", "bad_dtype", "bad_size", "bad_codec", "bad_codec_params")
    if defect == "negative_shape":
        assert reply.ack.reason == "bad_shape"
    _expect_untouched(server, version, theta)


def test_commits_that_would_overflow_theta_are_refused_whole(server):
    version, theta = server.theta()
    numel = theta.numel()
    huge = torch.full((numel,), 3e38)  # finite; twice that is not (float32 max ~3.4e38)
    with PsClient(server.address, 0, chunk_bytes=CHUNK, timeout=10) as client:
        first = client.commit(huge, version)
        assert first.ack.status == pb.Ack.STATUS_ACCEPTED, first
        after_first_version, after_first = server.theta()
        assert after_first_version == version + 1 and bool(torch.isfinite(after_first).all())
        second = client.commit(huge, after_first_version)
        assert (second.ack.status, second.ack.reason) == (pb.Ack.STATUS_REJECTED, "non_finite_result"), second
        staleness = client.commit(huge, version, scaling=pb.COMMIT_SCALING_STALENESS)  # τ = 1: 3e38 + 1.5e38
        assert staleness.ack.reason == "non_finite_result"
        _expect_untouched(server, after_first_version, after_first)
        assert server.stats()["rejected"] == {"non_finite_result": 2}
        assert server.stats()["commits"] == 1
        undo = client.commit(-huge, after_first_version)  # θ is still usable
        assert undo.ack.status == pb.Ack.STATUS_ACCEPTED
    final_version, final = server.theta()
    assert final_version == version + 2 and torch.allclose(final, theta, atol=1e32)
    assert [r.applied_at for r in server.commit_log()] == [version, version + 1]


def test_done_from_a_worker_that_never_pulled_is_refused(server):
    with PsClient(server.address, 2, timeout=10) as stranger:
        with pytest.raises(PsError, match="without ever pulling") as info:
            stranger.done(10)
        assert info.value.reason == "FAILED_PRECONDITION"
    stats = server.stats()
    assert stats["workers_done"] == 0 and stats["rejected"] == {"done_before_pull": 1}
    assert not server.all_done.is_set()
    # every worker id saying Done without pulling does not end the run either
    for worker in range(4):
        with PsClient(server.address, worker, timeout=10) as client, pytest.raises(PsError):
            client.done(1)
    assert not server.wait(idle_timeout=0.5, poll=0.05)
    # a worker that pulled may say Done
    with PsClient(server.address, 2, timeout=10) as worker:
        worker.pull()
        assert worker.done(10).workers_done == 1
    _next_good_commit_applies(server)


def test_done_ends_the_run_once_every_worker_that_pulled_said_it():
    with ParameterServer(torch.zeros(4), 2, listen="127.0.0.1:0", shutdown_grace=0.2) as ps:
        clients = [PsClient(f"127.0.0.1:{ps.port}", w, timeout=10) for w in range(2)]
        try:
            for client in clients:
                client.pull()
            clients[0].done(1)
            assert not ps.all_done.is_set()
            assert clients[1].done(1).workers_done == 2
            assert ps.wait(idle_timeout=5)
        finally:
            for client in clients:
                client.close()


# -- stream hygiene (issue 10) ---------------------------------------------------------------------
def test_two_streams_of_one_commit_apply_it_once(server):
    """A retry overlapping the first attempt: the first complete copy is applied, the other is
    answered DUPLICATE with its record, never refused while the first is merely in flight."""
    version, theta = server.theta()
    numel = theta.numel()
    chunks = list(iter_data_chunks(tensor_bytes(torch.full((numel,), 2.0)), CHUNK))
    release = threading.Event()

    def held():
        yield encode_header(commit_header(1, numel, version, 77))
        yield chunks[0]
        release.wait(10)
        yield from chunks[1:]

    channel, commit = raw_commit_stub(server.address)
    first = commit.future(held(), timeout=10)
    try:
        wait_until(lambda: len(server.call(server.state.receiving)) == 1, what="the first copy")
        retry = commit(iter([encode_header(commit_header(1, numel, version, 77)), *chunks]), timeout=10)
        assert retry.ack.status == pb.Ack.STATUS_ACCEPTED, retry
    finally:
        release.set()
    late = first.result(10)
    channel.close()
    assert late.ack.status == pb.Ack.STATUS_DUPLICATE and (late.version, late.staleness) == (retry.version, 0)
    _expect_untouched(server, version + 1, theta + 2)


def test_an_idle_commit_stream_is_cut():
    with ParameterServer(torch.zeros(4), 1, listen="127.0.0.1:0", shutdown_grace=0.2,
                         stream_idle_timeout=0.5) as ps:
        release = threading.Event()

        def header_only():
            yield encode_header(commit_header(0, 4, 0, 1))
            release.wait(10)

        channel, commit = raw_commit_stub(f"127.0.0.1:{ps.port}")
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            commit(header_only(), timeout=10)
        release.set()
        channel.close()
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "idle_stream" in info.value.details()
        assert 0.5 <= time.monotonic() - started < 4
        assert ps.stats()["rejected"] == {"idle_stream": 1} and not ps.call(ps.state.receiving)
