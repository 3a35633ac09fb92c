"""Push-sum over real gRPC between real processes equals the exact matrix recursion.

With learning rate 0 SGP is pure push-sum: X^{k+1} = P^(k) X^k, w^{k+1} = P^(k) w^k (τ = 0), and
with overlap τ = 1 the off-diagonal (sent) part arrives one step late:
X^{k+1} = diag(P^(k)) X^k + offdiag(P^(k-1)) X^(k-1).
"""
from __future__ import annotations

import json

import pytest
import torch

from launcher.ports import free_ports
from p2ptrain.topology import build_topology
from tests.conftest import ROOT, run_processes
from tests.procs.sgp_averaging_node import initial_vector

DIM, STEPS = 32, 40


def reference(topology, n: int, steps: int, overlap: int):
    """Exact recursion in float64: per-step (w, z) of every node, plus the final state after the
    in-flight shares are received, plus Σw including in-flight mass."""
    x = torch.stack([initial_vector(r, DIM) for r in range(n)])
    w = torch.ones(n, dtype=torch.float64)
    history = []  # (offdiag P, X, w) of sent shares not yet received
    ws, zs, total_mass = [], [], []
    for k in range(steps):
        P = torch.tensor(topology.mixing_matrix(k), dtype=torch.float64)
        diag = torch.diag(torch.diag(P))
        off = P - diag
        history.append((off, x.clone(), w.clone()))
        x, w = diag @ x, diag @ w
        if k >= overlap:
            off_d, x_d, w_d = history.pop(0)
            x, w = x + off_d @ x_d, w + off_d @ w_d
        in_flight = sum(float((o @ wd).sum()) for o, _, wd in history)
        ws.append(w.clone())
        zs.append(x / w[:, None])
        total_mass.append(float(w.sum()) + in_flight)
    for off_d, x_d, w_d in history:
        x, w = x + off_d @ x_d, w + off_d @ w_d
    return torch.stack(ws), torch.stack(zs), w, x / w[:, None], total_mass


EXPERIMENTS = [("exponential", 0), ("exponential", 1), ("random", 0), ("random", 1)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("n", [5, 8])
def test_push_sum_matches_exact_recursion(n, tmp_path, python):
    experiments = []
    for topo, tau in EXPERIMENTS:
        experiments.append({"name": f"{topo}_tau{tau}", "world_size": n, "ports": free_ports(n),
                            "topology": topo, "overlap": tau, "steps": STEPS, "dim": DIM, "seed": 7})
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"experiments": experiments}))
    script = str(ROOT / "tests" / "procs" / "sgp_averaging_node.py")
    run_processes([[python, script, str(r), str(spec), str(tmp_path)] for r in range(n)], 200, tmp_path)

    mean = torch.stack([initial_vector(r, DIM) for r in range(n)]).mean(0)
    for exp in experiments:
        topology = build_topology(exp["topology"], n, seed=exp["seed"])
        ref_w, ref_z, ref_final_w, ref_final_z, mass = reference(topology, n, STEPS, exp["overlap"])
        traces = [torch.load(tmp_path / f"trace_{exp['name']}_{r}.pt") for r in range(n)]
        got_w = torch.tensor([t["w"] for t in traces], dtype=torch.float64).T  # [steps, n]
        got_z = torch.stack([t["z"] for t in traces], dim=1)  # [steps, n, dim]
        label = exp["name"]
        torch.testing.assert_close(got_w, ref_w, rtol=0, atol=1e-9, msg=f"{label}: ps-weights")
        torch.testing.assert_close(got_z, ref_z, rtol=0, atol=1e-6, msg=f"{label}: de-biased z")
        # Σ w = n at every step (plus the mass still on the wire when τ > 0) and exactly at the end.
        assert mass == pytest.approx([float(n)] * STEPS, abs=1e-9), label
        if exp["overlap"] == 0:
            assert got_w.sum(1).tolist() == pytest.approx([float(n)] * STEPS, abs=1e-9), label
        final_w = torch.tensor([t["final_w"] for t in traces], dtype=torch.float64)
        assert float(final_w.sum()) == pytest.approx(n, abs=1e-9), label
        torch.testing.assert_close(final_w, ref_final_w, rtol=0, atol=1e-9)
        final_z = torch.stack([t["final_z"] for t in traces])
        torch.testing.assert_close(final_z, ref_final_z, rtol=0, atol=1e-6)
        # ... and it converges to the mean of the initial vectors.
        assert float((final_z - mean).abs().max()) < 1e-3, f"{label}: not at the mean"
        if exp["topology"] == "random":
            # irregular in-degrees: weights really leave 1 (so de-biasing matters)
            assert float((got_w - 1).abs().max()) > 0.1, f"{label}: ps-weights never moved"
