"""One seed drives Python, numpy and torch (design.md "Conventions")."""

from __future__ import annotations

import random

import numpy as np


def seed_everything(seed: int) -> None:
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
