"""A seed-style PyTorch training script (the shape of PyTorch's MNIST example: its own nn.Module, a
DataLoader, Adam, an epoch loop) run under an orchestrate plan:

    orchestrate launch --gpus 2 examples/own_loop/model.yaml -- python examples/own_loop/train.py --epochs 4

Three lines differ from the plain script, each marked `# orchestrate`: the import, `prepare`, and
`orchestrate.backward(loss)` for `loss.backward()`. Resuming (`orchestrate.load` / `save`) is two
more, outside the loop. The data is generated: 16 features, the label is which of 4 fixed random
directions the point leans to most, so a small MLP learns it quickly.

model.yaml plans this very `Net` (`model.module: "train:Net"`, shapes from `model.example_input`);
importing this file for that runs nothing, as the work is under `if __name__ == "__main__"`.
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import orchestrate  # orchestrate


class Net(nn.Module):
    def __init__(self, features: int = 16, hidden: int = 128, classes: int = 4):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                    nn.Linear(hidden, classes))

    def forward(self, x):
        return F.log_softmax(self.layers(x), dim=1)


def generated_data(samples: int, seed: int = 1234) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 16, generator=generator)
    directions = torch.randn(16, 4, generator=generator)
    return TensorDataset(x, (x @ directions).argmax(dim=1))


def train(model, loader, optimizer):
    model.train()
    total, batches = 0.0, 0
    for data, target in loader:
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        orchestrate.backward(loss)  # orchestrate: was loss.backward()
        optimizer.step()
        total, batches = total + loss.item(), batches + 1
    return total / batches


def main():
    parser = argparse.ArgumentParser(description="a seed-style loop under an orchestrate plan")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--samples", type=int, default=512)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    loader = DataLoader(generated_data(args.samples), batch_size=64, shuffle=True)
    model, optimizer, loader = orchestrate.prepare(model, optimizer, loader)  # orchestrate

    state = orchestrate.load()  # the newest checkpoint of this run directory, None on a fresh start
    first = state["epoch"] + 1 if state else 1
    for epoch in range(first, args.epochs + 1):
        loss = train(model, loader, optimizer)
        if torch.distributed.get_rank() == 0:
            print(f"epoch {epoch} loss {loss:.4f}", flush=True)
        orchestrate.save(epoch=epoch, loss=loss)


if __name__ == "__main__":
    main()
