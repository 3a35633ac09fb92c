"""Fast smoke tests for the gloo / raw-TCP transport baselines."""

import math

import pytest

from p2ptrain.bench.baselines import TransferResult, bench_gloo, bench_tcp, free_port

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
