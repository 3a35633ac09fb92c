"""What a node writes into its run folder stays bounded and honest (issue 12): snapshots for the
consensus plot are bounded in number and size whatever the run length and model size, sampled
snapshots still measure the consensus distance, reported scalars land at the step they were
measured, and a reused folder is cleared of an earlier run's files."""
from __future__ import annotations

import json
import math

import pytest
import torch

from launcher import report as run_report
from p2ptrain.train.progress import MAX_SNAPSHOTS, SNAPSHOT_COORDINATES, RunRecorder, SnapshotSampler


def test_a_1500_step_run_keeps_a_bounded_number_of_shared_snapshots(tmp_path):
    """Two nodes, 1,500 steps of a 400k-parameter model (logged every 10 steps: 150 snapshots
    before the bound, 2.4 MB each): at most MAX_SNAPSHOTS + 1 kept, the same steps on both nodes
    (the consensus distance needs them), the final step among them, files under 20 MB."""
    numel, steps = 400_000, 1500
    recorders = [RunRecorder(tmp_path, f"node{rank}", rank=rank, log_every=10) for rank in range(2)]
    for rank, recorder in enumerate(recorders):
        for step in range(1, steps + 1):
            recorder.report(step, loss=1.0 / step)
            recorder.step_done(step, 0.01, torch.full((numel,), float(rank + step)))
        recorder.finish(recorder.summary(), model=torch.full((numel,), float(rank + steps)))
        recorder.close()
    kept = [sorted(r.snapshots.by_step) for r in recorders]
    assert kept[0] == kept[1]
    assert len(kept[0]) <= MAX_SNAPSHOTS + 1 and kept[0][-1] == steps
    assert kept[0][0] <= 64 and kept[0][-2] >= steps - 128  # spread over the whole run
    for rank in range(2):
        size = run_report.snapshot_path(tmp_path, rank).stat().st_size
        assert size < (MAX_SNAPSHOTS + 2) * SNAPSHOT_COORDINATES * 4 + 100_000 < 20e6
        blob = torch.load(run_report.snapshot_path(tmp_path, rank), weights_only=True)
        assert blob["coordinates"] == [SNAPSHOT_COORDINATES, numel]
    result = run_report.build_report(tmp_path, 2, {}, 1.0)
    # Node models differ by 1 in every coordinate: exact distance sqrt(P * 0.25) from either.
    assert result["cluster"]["consensus_distance"] == pytest.approx(math.sqrt(numel * 0.25), rel=1e-3)
    assert any("estimated from 131,072 of 400,000 coordinates" in w for w in result["warnings"])


def test_sampled_snapshots_estimate_distances_and_norms():
    """A random subset of coordinates, scaled by sqrt(P/d), estimates the full consensus distance
    and norm of models with uneven, structured differences within a few percent."""
    generator = torch.Generator().manual_seed(3)
    numel = 1_000_000
    base = torch.randn(numel, generator=generator)
    models = [base + torch.randn(numel, generator=generator) * torch.linspace(0, 2, numel) ** 2 for _ in range(4)]
    exact = run_report.consensus_distance(torch.stack(models))
    sample = SnapshotSampler()
    sampled = run_report.consensus_distance(torch.stack([sample(m) for m in models]))
    assert sampled == pytest.approx(exact, rel=0.03)
    assert float(sample(base).norm()) == pytest.approx(float(base.norm()), rel=0.03)
    small = torch.randn(1000, generator=generator)
    assert torch.equal(SnapshotSampler()(small), small)  # small models are kept whole


def test_reported_scalars_land_once_at_their_step(tmp_path):
    recorder = RunRecorder(tmp_path, "node0", rank=0, log_every=10)
    for step in range(1, 31):
        recorder.report(step, loss=2.0)
        if step == 15:
            recorder.report(step, perplexity=7.5, val_loss=math.log(7.5))
        recorder.step_done(step, 0.01, None)
    recorder.finish(recorder.summary())
    recorder.close()
    records = run_report.load_progress(tmp_path, 0)
    perplexity = [(r["step"], r["perplexity"]) for r in records if "perplexity" in r]
    assert perplexity == [(15, 7.5)]
    assert [r["step"] for r in records if "loss" in r] == [10, 20, 30]
    summary = json.loads(run_report.summary_path(tmp_path, 0).read_text())
    assert summary["perplexity"] == 7.5 and summary["reported"] == ["loss", "perplexity", "val_loss"]
    result = run_report.build_report(tmp_path, 1, {}, 1.0)
    assert result["history"]["reported"]["perplexity"] == {"0": [[15, 7.5]]}
    assert result["cluster"]["mean_perplexity"] == 7.5


def test_a_reused_run_folder_is_cleared_of_the_earlier_runs_files(tmp_path):
    stale = ["node0.json", "node0.progress.jsonl", "node12.snapshots.pt", "ps.json", "report.json", "plot.png",
             "logs/node0.log", "logs/ps.log"]
    kept = ["notes.txt", "node0.json.bak", "checkpoints/node0.json", "logs/mine.log", "prometheus.yml"]
    for name in stale + kept:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("{}")
    removed = run_report.clear_earlier_run(tmp_path)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in removed) == sorted(stale)
    assert all((tmp_path / name).exists() for name in kept)
    assert run_report.clear_earlier_run(tmp_path / "missing") == []
