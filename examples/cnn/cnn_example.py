"""The small CNN of the seed document (Conv2d -> max-pool -> ReLU -> Linear, log_softmax) and a
generated, learnable 1x28x28 ten-class dataset, for `orchestrate launch cnn.yaml`.

Each class is a fixed random pattern (seeded); a sample is its class's pattern plus Gaussian
noise, so a model can learn the classes and nothing has to be downloaded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset


class CNN(nn.Module):
    def __init__(self, channels: int = 32, num_classes: int = 10) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, channels, kernel_size=3)  # 28x28 -> 26x26
        self.fc = nn.Linear(channels * 13 * 13, num_classes)  # after a 2x2 max-pool: 13x13

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.conv(x), 2))
        return F.log_softmax(self.fc(x.flatten(1)), dim=-1)


class PatternDataset(Dataset):
    """(image 1x28x28, label) pairs: the label's pattern plus noise of standard deviation `noise`."""

    def __init__(self, size: int = 2000, noise: float = 1.0, seed: int = 0, num_classes: int = 10) -> None:
        g = torch.Generator().manual_seed(seed)
        patterns = torch.randn(num_classes, 1, 28, 28, generator=g)
        self.labels = torch.randint(0, num_classes, (size,), generator=g)
        self.images = 0.5 * patterns[self.labels] + noise * torch.randn(size, 1, 28, 28, generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[i], self.labels[i]


def patterns(size: int = 2000, noise: float = 1.0, seed: int = 0) -> Dataset:
    """The dataset factory named by data.module."""
    return PatternDataset(size, noise, seed)
