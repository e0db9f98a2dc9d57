"""benchmarks/masks.py's pair counts and rule keywords (the timing itself needs a GPU)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import masks  # noqa: E402


def brute_force_pairs(rule: str, n: int) -> int:
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    allowed = j <= i
    if rule == "prefix":
        allowed = allowed | (j < masks.PREFIX)
    if rule == "sinks":
        allowed = allowed & (i - j < masks.WINDOW)
    if rule == "segment_ids":
        doc = masks.keywords(rule, n, 2, "cpu")["segment_ids"][0]
        allowed = allowed & (doc[:, None] == doc[None, :])
    return int(allowed.sum())


@pytest.mark.parametrize("rule", masks.RULES)
def test_allowed_pairs_count_the_rule(rule):
    assert masks.allowed_pairs(rule, 6000) == brute_force_pairs(rule, 6000)


def test_keywords_are_what_exattn_takes():
    import exattn

    q = torch.randn(1, 2, 300, 16)
    for rule in masks.RULES:
        kw = masks.keywords(rule, 300, 2, "cpu")
        assert exattn.attention(q, q, q, causal=True, **kw).shape == q.shape
    assert masks.alibi_slopes(8)[0] == 0.5
