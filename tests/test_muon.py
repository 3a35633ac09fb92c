"""Muon as the inner optimizer (issue 26, MuLoCo): Muon for the hidden matrices, AdamW for the rest,
as one torch optimizer that schedulers, checkpoints and the rings' state averaging treat as one."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from p2ptrain import cli
from p2ptrain.settings import NodeConfig
from p2ptrain.train.muon import MuonWithAdamW, muon_matrices
from p2ptrain.train.optimizer_state import OptimizerStateVector
from p2ptrain.train.setup import build_optimizer
from tests.test_diloco import launch


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 32), nn.LayerNorm(32), nn.ReLU(),
                         nn.Linear(32, 3))


def steps(model: nn.Module, opt: torch.optim.Optimizer, n: int, seed: int = 1) -> float:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(128, 10, generator=g), torch.randint(0, 3, (128,), generator=g)
    for _ in range(n):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.item()


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.position = nn.Parameter(torch.zeros(4, 8))
        self.block = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16)


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    assert muon_matrices(mlp()) == ["0.weight", "2.weight"]  # not the head (5), the norm or the biases
    assert muon_matrices(LM(), exclude=["position"]) == ["block.weight"]  # not the embedding nor the head
    opt = MuonWithAdamW(mlp(), lr=0.01)
    assert [g["use_muon"] for g in opt.param_groups] == [True, False, False]
    assert [len(g["params"]) for g in opt.param_groups] == [2, 1, 5]  # head weight; biases and norm
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.1, 0.0]
    with pytest.raises(ValueError, match="no hidden matrices"):
        MuonWithAdamW(nn.Linear(4, 2))


def test_muon_trains_and_its_matrix_steps_are_orthogonalized():
    model = mlp()
    opt = MuonWithAdamW(model, lr=0.02, weight_decay=0.0)
    first = steps(model, opt, 1)
    assert steps(model, opt, 60) < 0.6 * first
    # one Muon step from zero momentum moves a square matrix by lr * scale * (an orthogonal matrix)
    model = mlp()
    opt = MuonWithAdamW(model, lr=0.01, weight_decay=0.0)
    before = model[2].weight.detach().clone()
    steps(model, opt, 1)
    update = (model[2].weight.detach() - before) / (0.01 * 0.2 * 32 ** 0.5)
    singular = torch.linalg.svdvals(update)  # (descending)
    # Newton-Schulz (5 quintic steps) maps every singular value that is not tiny into ~[0.7, 1.2]
    assert singular.max() < 1.3 and singular[:16].min() > 0.6


def test_a_scheduler_and_a_checkpoint_act_on_both_halves():
    model = mlp()
    opt = MuonWithAdamW(model, lr=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
    steps(model, opt, 3)
    schedule.step()
    schedule.step()
    assert opt.muon.param_groups[0]["lr"] == opt.adamw.param_groups[1]["lr"] == pytest.approx(0.0025)
    resumed_model = copy.deepcopy(model)
    resumed = MuonWithAdamW(resumed_model, lr=0.01)
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert resumed.muon.param_groups[0]["lr"] == pytest.approx(0.0025)
    steps(model, opt, 2, seed=5)
    steps(resumed_model, resumed, 2, seed=5)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed_model.parameters()))


def test_the_rings_state_vector_holds_muons_momentum_and_adams_moments():
    model = mlp()
    opt = MuonWithAdamW(model, lr=0.01)
    state = OptimizerStateVector.of(opt)
    numel = sum(p.numel() for p in model.parameters())
    muon = sum(p.numel() for p in opt.muon.param_groups[0]["params"])
    adam = numel - muon
    assert state.numel == muon + 2 * adam + sum(len(g["params"]) for g in opt.adamw.param_groups)  # + steps
    assert torch.count_nonzero(state.vector()) == 0  # materialized as the first step would
    steps(model, opt, 3)
    other_model = copy.deepcopy(model)
    other = MuonWithAdamW(other_model, lr=0.01)
    OptimizerStateVector.of(other).load(state.vector())
    steps(model, opt, 2, seed=7)
    steps(other_model, other, 2, seed=7)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other_model.parameters()))


def test_inner_optimizer_muon_is_a_setting_with_adamws_learning_rate():
    args = cli.build_parser().parse_args(["node", "--algorithm", "diloco", "--inner-optimizer", "muon"])
    assert args.optimizer == "muon"
    config = NodeConfig.from_sources(env={"P2PTRAIN_OPTIMIZER": "muon"}, flags={"algorithm": "diloco"}).validate()
    assert config.resolved_optimizer == "muon" and config.learning_rate == 0.003
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = build_optimizer(config, model)
    assert isinstance(opt, MuonWithAdamW) and opt.param_groups[0]["lr"] == 0.003


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_launch_diloco_with_muon_inside(tmp_path):
    """3 processes, DiLoCo H = 10 with Muon as the inner optimizer: same bits on every node, learned."""
    summaries = launch(tmp_path, "muon", 3, "--algorithm", "diloco", "--inner-steps", "10", "--inner-optimizer",
                       "muon", "--steps", "60", "--num-train", "3000", "--num-test", "500")
    finals = [torch.load(tmp_path / "muon" / f"node{r}.snapshots.pt")["params"][-1] for r in range(3)]
    assert all(torch.equal(f, finals[0]) for f in finals)
    assert min(s["test_accuracy"] for s in summaries) > 0.5
