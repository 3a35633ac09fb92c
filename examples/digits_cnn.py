"""A BatchNorm CNN on real handwritten digits, trained decentralized with p2ptrain.

The data are scikit-learn's bundled digits (1,797 real 8x8 scans by 43 people, UCI ML repository):
they ship inside the scikit-learn package, so nothing is downloaded (`pip install p2ptrain[examples]`).
Each node trains on its own shard of 80% of the scans; every node reports its test accuracy on the
other 20%. The model has BatchNorm layers, whose running statistics p2ptrain keeps consistent with
the weights (averaged with them, or made identical by all-reduce).

    p2ptrain launch --nodes 4 --algorithm sgp --overlap 1 --steps 300 -- python examples/digits_cnn.py
    p2ptrain launch --nodes 4 --algorithm allreduce --steps 300 -- python examples/digits_cnn.py

Settings come from the launcher (--steps, --batch-size, --lr, --seed); the three p2ptrain lines are marked.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import p2ptrain


def digits(seed: int) -> tuple[torch.utils.data.TensorDataset, torch.utils.data.TensorDataset]:
    """(train, test): the same 80/20 split on every node (seeded), pixels scaled to [0, 1]."""
    from sklearn.datasets import load_digits

    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(labels))
    train, test = order[:cut], order[cut:]
    return (torch.utils.data.TensorDataset(images[train], labels[train]),
            torch.utils.data.TensorDataset(images[test], labels[test]))


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 4 * 4, 10))


def main() -> None:
    torch.set_num_threads(1)
    with p2ptrain.init() as node:                                                              # p2ptrain 1/3
        settings = node.config
        train, test = digits(settings.seed)
        shard = torch.utils.data.Subset(train, range(node.rank, len(train), node.world_size))
        loader = torch.utils.data.DataLoader(shard, batch_size=settings.batch_size, shuffle=True, drop_last=True,
                                             generator=torch.Generator().manual_seed(settings.seed + node.rank))
        torch.manual_seed(settings.seed)  # the same initial model on every node
        model = cnn()
        inner = torch.optim.SGD(model.parameters(), lr=settings.lr or 0.05, momentum=0.9, weight_decay=1e-4)
        opt = p2ptrain.DecentralizedOptimizer(inner, model=model, node=node)                   # p2ptrain 2/3
        step = opt.local_step  # 0, or where a node restarted by the launcher (--restart) rejoined
        while step < settings.steps:
            for x, y in loader:
                model.train()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                step += 1
                node.report(step, loss=loss.item())                                           # p2ptrain 3/3
                if step == settings.steps:
                    break
        opt.finish()
        test_loss, accuracy = p2ptrain.evaluate(model, torch.utils.data.DataLoader(test, batch_size=256),
                                                loss_fn=F.cross_entropy)  # (evaluate leaves eval mode on)
        node.report(step, test_loss=test_loss, test_accuracy=accuracy)
        print(f"node {node.rank}: test accuracy {accuracy:.4f} on {len(test)} held-out digits")


if __name__ == "__main__":
    main()
