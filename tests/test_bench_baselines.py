"""Fast smoke tests for the gloo / raw-TCP transport baselines."""

import math

import pytest

from p2ptrain.bench.baselines import (
    TransferResult,
    bench_gloo,
    bench_tcp,
    check_transfer_args,
    cpu_seconds,
    free_port,
    run_pair,
)

SIZE = 4 * 2**20  # 4 MiB
REPS = 3


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bench, name", [(bench_tcp, "tcp"), (bench_gloo, "gloo")])
def test_baseline_small_payload(bench, name):
    r = bench(SIZE, REPS, timeout=60.0)
    assert isinstance(r, TransferResult)
    assert r.name == name
    assert r.size_bytes == SIZE
    assert r.reps == REPS
    assert r.seconds > 0 and math.isfinite(r.seconds)
    assert r.mb_per_s > 0 and math.isfinite(r.mb_per_s)
    assert r.mb_per_s == pytest.approx(SIZE * REPS / r.seconds / 1e6)


@pytest.mark.parametrize("bench", [bench_tcp, bench_gloo])
@pytest.mark.parametrize("size", [4 * 2**20 + 2, 7, 0, -4])
def test_bad_size_raises(bench, size):
    with pytest.raises(ValueError):
        bench(size, REPS)


@pytest.mark.parametrize("bench", [bench_tcp, bench_gloo])
def test_bad_reps_raises(bench):
    with pytest.raises(ValueError):
        bench(SIZE, 0)


def test_free_port():
    p = free_port()
    assert 0 < p < 65536


def test_mb_per_s():
    assert TransferResult("tcp", 1_000_000, 2, 0.5).mb_per_s == pytest.approx(4.0)


# -- the public harness other measurements reuse -------------------------------------------------

def _announce(conn, value):
    conn.send(("msg", value))  # relayed to the other child
    return "sent"


def _hear(conn):
    if not conn.poll(30):
        raise TimeoutError("nothing relayed")
    return conn.recv() * 2


def _fail(conn):
    raise RuntimeError("boom in the child")


@pytest.mark.timeout(60)
def test_run_pair_relays_and_returns_results_in_order():
    assert run_pair("relay", [_hear, _announce], [(), (21,)], timeout=30.0, relay={1: 0}) == [42, "sent"]


@pytest.mark.timeout(60)
def test_run_pair_reports_a_failed_child():
    with pytest.raises(RuntimeError, match=r"(?s)fail child fail-0 failed \(exit code 1\).*boom in the child"):
        run_pair("fail", [_fail], [()], timeout=30.0)


def test_check_transfer_args():
    check_transfer_args(8, 1, 1.0)
    with pytest.raises(TypeError):
        check_transfer_args(8.0, 1, 1.0)
    with pytest.raises(ValueError, match="timeout"):
        check_transfer_args(8, 1, math.inf)


def test_cpu_seconds_counts_this_process():
    start = cpu_seconds()
    deadline = start + 0.05
    while cpu_seconds() < deadline:  # busy: the clock must advance
        pass
    assert cpu_seconds() >= start + 0.05
