"""Small classification models used by the training loops.

Both models return LOG-PROBABILITIES (``log_softmax`` over classes), so the
training code pairs them with ``F.nll_loss`` and can read probabilities with
``.exp()``; doing the softmax inside the model keeps the GEM paper's CNN
(which ends in a logarithmic softmax) and the MLP interchangeable.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from p2ptrain.choices import MODEL_NAMES

__all__ = ["MODEL_NAMES", "MLP", "SmallCNN", "build_model"]


def _check_shape(input_shape: tuple[int, ...], num_classes: int) -> tuple[int, ...]:
    shape = tuple(int(d) for d in input_shape)
    if not shape or any(d < 1 for d in shape):
        raise ValueError(
            f"input_shape must be a non-empty tuple of positive sizes, got {input_shape}"
        )
    if num_classes < 2:
        raise ValueError(f"num_classes must be >= 2, got {num_classes}")
    return shape


class MLP(nn.Module):
    """Two-hidden-layer perceptron: flatten -> hidden -> ReLU -> hidden -> ReLU -> classes.

    Cheap enough that communication, not compute, dominates a decentralized
    step, which is what the algorithms under test are about.
    ``forward`` returns log-probabilities (use ``F.nll_loss``).
    """

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, hidden: int = 128) -> None:
        super().__init__()
        shape = _check_shape(input_shape, num_classes)
        if hidden < 1:
            raise ValueError(f"hidden must be >= 1, got {hidden}")
        self.input_shape = shape
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(math.prod(shape), hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.net(x), dim=1)


class SmallCNN(nn.Module):
    """The CNN of the Gradient Energy Matching paper (App. A), for comparable results.

    conv(C->10, k5) -> maxpool2 -> ReLU -> conv(10->20, k5) -> Dropout2d ->
    maxpool2 -> ReLU -> flatten -> 120 -> ReLU -> 84 -> ReLU -> classes ->
    log_softmax. ``forward`` returns log-probabilities (use ``F.nll_loss``).
    The flattened size (320 for 28x28) is found by a dry run of the
    convolutional stages, so other image sizes work too.
    """

    # Smallest side that survives conv5 -> pool2 -> conv5 -> pool2.
    MIN_SIDE = 16

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        shape = _check_shape(input_shape, num_classes)
        if len(shape) != 3:
            raise ValueError(
                f"SmallCNN needs an image input shape (channels, height, width), got {input_shape}"
            )
        channels, height, width = shape
        if min(height, width) < self.MIN_SIDE:
            raise ValueError(
                f"SmallCNN needs images of at least {self.MIN_SIDE}x{self.MIN_SIDE}, "
                f"got {height}x{width}"
            )
        self.input_shape = shape
        self.conv1 = nn.Conv2d(channels, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        # Dry run without dropout: dropout does not change shapes, and skipping
        # it keeps model construction from consuming torch's global RNG.
        with torch.no_grad():
            features = self._features(torch.zeros(1, *shape), dropout=False)
        self.flat_features = features.shape[1]
        self.fc1 = nn.Linear(self.flat_features, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)

    def _features(self, x: torch.Tensor, dropout: bool = True) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = self.conv2(x)
        if dropout:
            x = self.conv2_drop(x)
        x = F.relu(F.max_pool2d(x, 2))
        return torch.flatten(x, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._features(x)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return F.log_softmax(self.fc3(x), dim=1)


def build_model(
    name: str, input_shape: tuple[int, ...], num_classes: int, hidden: int = 128
) -> nn.Module:
    """Model by its command-line name (``"mlp"`` or ``"cnn"``; ``hidden`` only affects the MLP).

    Parameters are initialised from torch's global RNG, so seed it first
    when every node must start from the same weights.
    """
    key = name.strip().lower()
    if key == "mlp":
        return MLP(input_shape, num_classes, hidden)
    if key == "cnn":
        return SmallCNN(input_shape, num_classes)
    raise ValueError(f"unknown model {name!r}; valid names: {', '.join(MODEL_NAMES)}")
