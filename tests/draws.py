"""Whether two sets of draws come from one distribution (speculative decoding's tests, on
the CPU and the GPU)."""

from __future__ import annotations

from collections import Counter

import torch


def two_sample_p_value(a: list[int], b: list[int], least: int = 10) -> float:
    """Chi-square test that two equally many draws come from one distribution (categories
    seen fewer than `least` times together pooled into one): its p-value."""
    ca, cb = Counter(a), Counter(b)
    bins: list[tuple[int, int]] = []
    rare = [0, 0]
    for t in ca.keys() | cb.keys():
        if ca[t] + cb[t] < least:
            rare[0] += ca[t]
            rare[1] += cb[t]
        else:
            bins.append((ca[t], cb[t]))
    if sum(rare):
        bins.append(tuple(rare))
    stat = sum((x - y) ** 2 / (x + y) for x, y in bins)
    return float(1 - torch.distributions.Chi2(len(bins) - 1).cdf(torch.tensor(stat))) if len(bins) > 1 else 1.0
