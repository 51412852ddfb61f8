"""Modules and dataset factories for the `model.module` / `data.module` tests (importable as
"tests.helpers.custom_modules:Name")."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class ResMLP(nn.Module):
    """Repeated `Block`s between an input and an output projection; returns logits."""

    def __init__(self, inputs: int = 16, width: int = 32, depth: int = 3, classes: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(inputs, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.out = nn.Linear(width, classes)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x = self.inp(features)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


class WithOwnLoss(ResMLP):
    """Returns {"logits", "loss"} when given labels, as Hugging Face models do."""

    def forward(self, features: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        logits = super().forward(features)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits, labels)
        return out


class Rule(Dataset):
    """Dict samples: label = index of the largest of the first `classes` features (learnable)."""

    def __init__(self, size: int = 512, inputs: int = 16, classes: int = 4, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, inputs, generator=g)
        self.y = self.x[:, :classes].argmax(-1)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"features": self.x[i], "labels": self.y[i]}


def rule(size: int = 512, seed: int = 0) -> Dataset:
    return Rule(size=size, seed=seed)


def not_a_dataset() -> list[str]:
    return ["a", "b", "c"]  # has __len__ and __getitem__ but its samples are strings


def an_int() -> int:
    return 3


def broken_factory() -> Dataset:
    raise RuntimeError("no data here")
