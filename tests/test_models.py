"""Tests for p2ptrain.train.models."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from p2ptrain.train import models

torch.set_num_threads(1)

IMAGE = (1, 28, 28)


@pytest.mark.parametrize("name", models.MODEL_NAMES)
def test_outputs_are_log_probabilities(name):
    torch.manual_seed(0)
    model = models.build_model(name, IMAGE, 10).eval()
    out = model(torch.randn(5, *IMAGE))
    assert out.shape == (5, 10)
    assert (out <= 0).all()
    torch.testing.assert_close(out.exp().sum(dim=1), torch.ones(5))


def test_cnn_matches_gem_paper_layout():
    cnn = models.SmallCNN(IMAGE, 10)
    assert cnn.flat_features == 320  # 20 channels x 4 x 4
    assert cnn.conv1.in_channels == 1 and cnn.conv1.out_channels == 10
    assert cnn.conv1.kernel_size == (5, 5) and cnn.conv1.padding == (0, 0)
    assert cnn.conv2.out_channels == 20
    assert isinstance(cnn.conv2_drop, torch.nn.Dropout2d) and cnn.conv2_drop.p == 0.5
    assert [cnn.fc1.out_features, cnn.fc2.out_features, cnn.fc3.out_features] == [120, 84, 10]


@pytest.mark.parametrize("shape, flat", [((3, 32, 32), 500), ((1, 16, 16), 20), ((2, 20, 24), 120)])
def test_cnn_other_image_sizes(shape, flat):
    cnn = models.SmallCNN(shape, 7).eval()
    assert cnn.flat_features == flat
    assert cnn(torch.randn(2, *shape)).shape == (2, 7)


def test_mlp_layout_and_hidden_size():
    mlp = models.build_model("MLP", (3, 8, 8), 5, hidden=32)
    linears = [m for m in mlp.modules() if isinstance(m, torch.nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(192, 32), (32, 32), (32, 5)]
    assert mlp(torch.randn(4, 3, 8, 8)).shape == (4, 5)
    assert models.build_model("mlp", (784,), 10)(torch.randn(2, 784)).shape == (2, 10)


def test_cnn_dropout_only_in_training_mode():
    torch.manual_seed(0)
    cnn = models.build_model("cnn", IMAGE, 10)
    x = torch.randn(4, *IMAGE)
    cnn.eval()
    assert torch.equal(cnn(x), cnn(x))
    cnn.train()
    assert not torch.equal(cnn(x), cnn(x))


def test_same_seed_same_initial_weights():
    """Nodes seed torch and build their models independently; they must agree."""
    for name in models.MODEL_NAMES:
        torch.manual_seed(7)
        a = models.build_model(name, IMAGE, 10)
        torch.manual_seed(7)
        b = models.build_model(name, IMAGE, 10)
        for pa, pb in zip(a.parameters(), b.parameters()):
            assert torch.equal(pa, pb)


@pytest.mark.parametrize("name", models.MODEL_NAMES)
def test_a_few_sgd_steps_reduce_the_loss(name):
    torch.manual_seed(0)
    model = models.build_model(name, IMAGE, 10)
    # A learnable fixed batch: noisy copies of one random template per class.
    y = torch.arange(64) % 10
    x = torch.randn(10, *IMAGE)[y] + 0.5 * torch.randn(64, *IMAGE)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def eval_loss() -> float:
        model.eval()
        with torch.no_grad():
            return F.nll_loss(model(x), y).item()

    before = eval_loss()
    model.train()
    for _ in range(50):
        loss = F.nll_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = eval_loss()
    assert after < 0.5 * before, (before, after)


def test_bad_names_and_shapes():
    with pytest.raises(ValueError, match="mlp.*cnn"):
        models.build_model("resnet", IMAGE, 10)
    with pytest.raises(ValueError, match="channels, height, width"):
        models.build_model("cnn", (784,), 10)
    with pytest.raises(ValueError, match="at least 16x16"):
        models.build_model("cnn", (1, 12, 12), 10)
    with pytest.raises(ValueError, match="num_classes"):
        models.build_model("mlp", IMAGE, 1)
    with pytest.raises(ValueError, match="input_shape"):
        models.build_model("mlp", (), 10)
    with pytest.raises(ValueError, match="input_shape"):
        models.build_model("mlp", (1, 0, 28), 10)
