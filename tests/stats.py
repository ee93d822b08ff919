"""Goodness-of-fit helpers for the distribution tests."""

from __future__ import annotations

import torch


def chi_square_p_value(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson goodness-of-fit p-value of counts [V] against probabilities [V] (all positive)."""
    n = observed.sum()
    expected = expected_probs.double() * n
    statistic = ((observed.double() - expected) ** 2 / expected).sum()
    # The chi-square survival function is the regularized upper incomplete gamma function.
    df = torch.tensor((len(expected_probs) - 1) / 2, dtype=torch.float64)
    return torch.special.gammaincc(df, statistic / 2).item()
