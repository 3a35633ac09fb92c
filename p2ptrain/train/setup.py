"""The built-in training setup of a node: its data shard, loaders and model, from the settings.
The same for every role, so peers, parameter-server workers and the proxy train on identical data
and models."""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from p2ptrain.train.batches import ShuffledBatches
from p2ptrain.train.data import build_dataset, node_shard
from p2ptrain.train.device import pick_device
from p2ptrain.train.member_shards import MemberShards
from p2ptrain.train.models import build_model
from p2ptrain.train.muon import MuonWithAdamW


def training_setup(config, members: Callable[[], Sequence[int]] | None = None):
    """(train loader of this rank's shard, test loader, model on its device, device): the same for
    every role, so peers, parameter-server workers and the proxy train on identical data/models.
    With `members` (who trains together now) and IID shards, the shard follows the membership
    (member_shards.py); fault-free that is the rank's own shard, batch for batch."""
    splits = build_dataset(config.dataset, config.data_dir, seed=config.seed,
                           num_train=config.num_train, num_test=config.num_test)
    device = pick_device(config.device)
    generator = torch.Generator().manual_seed(config.seed * 1_000_003 + config.rank)

    def loader_of(shard) -> ShuffledBatches:  # (DataLoader(shuffle=True)'s batches, by indexing)
        return ShuffledBatches(shard, config.batch_size, generator=generator, drop_last=len(shard) >= config.batch_size,
                               pin_memory=device.type == "cuda")

    part = config.rank % config.world_size  # a node that joined an elastic run later: the shard of a starting
    if config.dirichlet_alpha is not None:  # rank, in its own order (the loader's seed is its own rank's)
        from p2ptrain.train.partition import dirichlet_shard

        # (a non-IID partition stays by rank: re-cutting it among the members would change every
        # node's class mix, the very thing such a run studies)
        loader = loader_of(dirichlet_shard(splits.train, part, config.world_size, config.dirichlet_alpha,
                                           seed=config.seed))
    elif members is not None:
        loader = MemberShards(splits.train, config.rank, config.world_size, members=members, loader=loader_of,
                              seed=config.seed)
    else:
        loader = loader_of(node_shard(splits.train, part, config.world_size, seed=config.seed))
    test_loader = torch.utils.data.DataLoader(splits.test, batch_size=512)
    torch.manual_seed(config.seed)  # identical initial model on every node (and θ_0 on the server)
    model = build_model(config.model, splits.input_shape, splits.num_classes, hidden=config.hidden).to(device)
    return loader, test_loader, model, device


def _sgd(config, model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=config.learning_rate, momentum=config.momentum,
                           weight_decay=config.weight_decay)


def _adamw(config, model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay)


def _muon(config, model: torch.nn.Module) -> torch.optim.Optimizer:
    return MuonWithAdamW(model, lr=config.learning_rate, weight_decay=config.weight_decay)


# One builder per p2ptrain.choices.OPTIMIZER_NAMES (tests/test_settings.py keeps the two in step).
OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {"sgd": _sgd, "adamw": _adamw, "muon": _muon}


def build_optimizer(config, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The local optimizer of the built-in training, from the settings (sgd: with momentum; muon:
    Muon for the hidden matrices, AdamW for the rest)."""
    return OPTIMIZERS[config.resolved_optimizer](config, model)


def initial_model(config) -> torch.nn.Module:
    """θ_0: the model `model`, `hidden`, `dataset` and `seed` define (every node builds the same one;
    the parameter server serves it to its workers). Builds the dataset only to learn its shapes."""
    splits = build_dataset(config.dataset, config.data_dir, seed=config.seed, num_train=config.num_train,
                           num_test=config.num_test)
    torch.manual_seed(config.seed)
    return build_model(config.model, splits.input_shape, splits.num_classes, hidden=config.hidden)


__all__ = ["OPTIMIZERS", "build_optimizer", "initial_model", "training_setup"]
