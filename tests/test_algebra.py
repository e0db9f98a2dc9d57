import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from exattn import BlockSummary, finalize, merge, merge_states, summarize
from exattn.algebra import absorb_, empty_summary, merge_stacked, summarize_into_

F64 = torch.float64


def scalar_block(scores, values) -> BlockSummary:
    return summarize(torch.tensor(scores, dtype=F64), torch.tensor(values, dtype=F64)[:, None])


def test_founding_example_merges_to_two_and_a_half():
    a = scalar_block([0.0, 0.0], [0.0, 2.0])
    b = scalar_block([math.log(2)], [4.0])
    assert (a.m.item(), a.l.item(), a.u.item()) == (0.0, 2.0, 2.0)
    assert (b.l.item(), b.u.item()) == (1.0, 4.0)
    out, _ = finalize(merge(a, b))
    assert out.item() == 2.5


def test_founding_example_with_ln4_merges_to_three_not_the_average():
    a = scalar_block([0.0, 0.0], [0.0, 2.0])
    b = scalar_block([math.log(4)], [4.0])
    out, _ = finalize(merge(a, b))
    local_average = (finalize(a)[0] + finalize(b)[0]) / 2
    assert math.isclose(out.item(), 3.0, rel_tol=1e-15)
    assert local_average.item() == 2.5


def random_summary(seed: int, rows: int = 5, n: int = 7, dv: int = 3, masked: float = 0.3):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(rows, n, generator=g, dtype=F64) * 4
    scores[torch.rand(rows, n, generator=g) < masked] = float("-inf")
    scores[0] = float("-inf")  # one fully masked row in every block
    return summarize(scores, torch.randn(n, dv, generator=g, dtype=F64))


def assert_same_state(x: BlockSummary, y: BlockSummary):
    out_x, lse_x = finalize(x)
    out_y, lse_y = finalize(y)
    torch.testing.assert_close(out_x, out_y, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse_x, lse_y, rtol=1e-12, atol=1e-12)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31), st.integers(0, 2**31), st.integers(0, 2**31))
def test_merge_is_commutative_and_associative(sa, sb, sc):
    a, b, c = random_summary(sa), random_summary(sb), random_summary(sc)
    assert_same_state(merge(a, b), merge(b, a))
    assert_same_state(merge(merge(a, b), c), merge(a, merge(b, c)))


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31))
def test_merging_a_state_with_itself_adds_ln2_to_lse(seed):
    s = random_summary(seed)
    out, lse = finalize(s)
    out2, lse2 = finalize(merge(s, s))
    torch.testing.assert_close(out2, out, rtol=1e-12, atol=1e-12)
    finite = torch.isfinite(lse)
    torch.testing.assert_close(lse2[finite], lse[finite] + math.log(2), rtol=1e-12, atol=1e-12)
    assert torch.equal(torch.isinf(lse2), ~finite)
    merged_out, merged_lse = merge_states(out, lse, out, lse)
    torch.testing.assert_close(merged_out, out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(merged_lse[finite], lse[finite] + math.log(2), rtol=1e-12, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 40).flatmap(
        lambda n: st.tuples(
            st.just(n),
            st.lists(st.integers(1, n), max_size=6),
            st.permutations(range(8)),
            st.integers(0, 2**31),
        )
    )
)
def test_any_partition_merged_in_any_order_equals_full_attention(case):
    n, cuts, order, seed = case
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(4, n, generator=g, dtype=F64) * 3
    scores[torch.rand(4, n, generator=g) < 0.4] = float("-inf")
    values = torch.randn(n, 5, generator=g, dtype=F64)
    bounds = sorted({0, n, *cuts})
    blocks = [summarize(scores[:, a:b], values[a:b]) for a, b in zip(bounds, bounds[1:])]
    blocks = [blocks[i] for i in order if i < len(blocks)] + blocks[8:]
    state = blocks[0]
    for block in blocks[1:]:
        state = merge(state, block)
    out, lse = finalize(state)
    has_key = torch.isfinite(scores).any(-1)
    weights = torch.softmax(scores.masked_fill(~has_key[:, None], 0), -1) * has_key[:, None]
    torch.testing.assert_close(out, weights @ values, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), rtol=1e-12, atol=1e-12)


def test_empty_block_is_the_identity_and_finalizes_to_zero():
    s = random_summary(3)
    empty = empty_summary(s.m.shape, s.u.shape[-1], F64, "cpu")
    assert_same_state(merge(s, empty), s)
    assert_same_state(merge(empty, s), s)
    out, lse = finalize(merge(empty, empty))
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isneginf(lse).all()
    no_keys = summarize(torch.empty(3, 0, dtype=F64), torch.empty(0, 2, dtype=F64))
    assert torch.isneginf(no_keys.m).all() and (no_keys.l == 0).all() and (no_keys.u == 0).all()


def test_fully_masked_blocks_never_produce_nan():
    masked = summarize(torch.full((3, 4), float("-inf")), torch.randn(4, 2))
    assert torch.isneginf(masked.m).all() and (masked.l == 0).all() and (masked.u == 0).all()
    out, lse = finalize(merge(masked, masked))
    assert not torch.isnan(out).any() and torch.isneginf(lse).all()
    out, lse = merge_states(out, lse, out, lse)
    assert not torch.isnan(out).any() and torch.isneginf(lse).all()


def test_nan_scores_propagate():
    scores = torch.tensor([[0.0, float("nan")]])
    out, _ = finalize(summarize(scores, torch.ones(2, 1)))
    assert torch.isnan(out).all()


def test_merge_states_matches_summary_merge_and_keeps_dtype():
    a, b = random_summary(1), random_summary(2)
    expected_out, expected_lse = finalize(merge(a, b))
    out_a, lse_a = finalize(a)
    out_b, lse_b = finalize(b)
    out, lse = merge_states(out_a.half(), lse_a.float(), out_b.half(), lse_b.float())
    assert out.dtype == torch.float16 and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected_out, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(lse.double(), expected_lse, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("seed", range(3))
def test_merge_stacked_equals_merging_one_state_after_another(seed):
    """States stacked along a dim, some empty (lse -inf) and one row empty in all, merge in one reduction to
    what `merge_states` gives one pair at a time; out keeps its dtype."""
    g = torch.Generator().manual_seed(seed)
    out = torch.randn(2, 5, 3, 4, generator=g).half()
    lse = torch.randn(2, 5, 3, generator=g) * 4
    lse[0, 1:3] = -math.inf
    lse[1, :, 2] = -math.inf
    merged, merged_lse = merge_stacked(out, lse, 1)
    expected, expected_lse = out[:, 0], lse[:, 0]
    for s in range(1, 5):
        expected, expected_lse = merge_states(expected, expected_lse, out[:, s], lse[:, s])
    assert merged.dtype == torch.float16 and merged_lse.dtype == torch.float32
    torch.testing.assert_close(merged, expected, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(merged_lse, expected_lse, rtol=1e-6, atol=1e-6)
    assert torch.equal(merged[1, 2], torch.zeros(4, dtype=torch.float16)) and merged_lse[1, 2] == -math.inf
    with pytest.raises(ValueError, match="dim"):
        merge_stacked(out, lse, -1)


def test_summarize_accepts_per_row_values():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(3, 6, generator=g, dtype=F64)
    values = torch.randn(3, 6, 2, generator=g, dtype=F64)
    out, _ = finalize(summarize(scores, values))
    expected = (torch.softmax(scores, -1)[..., None] * values).sum(-2)
    torch.testing.assert_close(out, expected)


def clone_state(s: BlockSummary) -> BlockSummary:
    return BlockSummary(*(t.clone() for t in s))


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31), st.booleans())
def test_absorb_equals_merge_of_summary(seed, with_weights):
    g = torch.Generator().manual_seed(seed)
    state = random_summary(seed)
    state = BlockSummary(state.m[None], state.l[None], state.u[None])  # (1, rows), (1, rows, dv)
    scores = torch.randn(1, 5, 4, generator=g, dtype=F64) * 30
    scores[torch.rand(1, 5, 4, generator=g) < 0.4] = float("-inf")
    scores[0, 1] = float("-inf")  # a row that is empty in the block (and row 0 in the state)
    values = torch.randn(1, 4, 3, generator=g, dtype=F64)
    weights = torch.rand(1, 5, 4, generator=g, dtype=F64) if with_weights else None
    expected = merge(state, summarize(scores, values, weights))
    absorbed = absorb_(clone_state(state), scores.clone(), values, weights)
    assert_same_state(absorbed, expected)
    assert not any(t.isnan().any() for t in absorbed)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31), st.booleans(), st.sampled_from([torch.float32, F64]))
def test_summarize_into_is_absorb_into_the_empty_summary_whatever_the_state_held(seed, with_weights, dtype):
    """Bitwise: the tiled forward starts each row's state with it instead of the empty summary and absorb_."""
    g = torch.Generator().manual_seed(seed)
    scores = (torch.randn(2, 5, 4, generator=g, dtype=F64) * 30).to(dtype)
    scores[torch.rand(2, 5, 4, generator=g) < 0.4] = float("-inf")
    scores[0, 1] = float("-inf")  # a row that sees no key of the block
    values = torch.randn(2, 4, 3, generator=g, dtype=dtype)
    weights = torch.rand(2, 5, 4, generator=g, dtype=dtype) if with_weights else None
    expected = absorb_(empty_summary((2, 5), 3, dtype, "cpu"), scores.clone(), values, weights)
    garbage = BlockSummary(torch.full((2, 5), 7.0, dtype=dtype), torch.full((2, 5), float("nan"), dtype=dtype),
                           torch.full((2, 5, 3), float("inf"), dtype=dtype))
    started = summarize_into_(garbage, scores.clone(), values, weights)
    for got, want in zip(started, expected):
        assert torch.equal(got, want)


def test_absorb_of_an_empty_row_keeps_it_empty():
    state = empty_summary((1, 2), 3, F64, "cpu")
    scores = torch.tensor([[[float("-inf")] * 4, [0.5, float("-inf"), 1.0, 2.0]]], dtype=F64)
    absorbed = absorb_(state, scores, torch.randn(1, 4, 3, dtype=F64))
    out, lse = finalize(absorbed)
    assert lse[0, 0] == float("-inf") and (out[0, 0] == 0).all()
    assert torch.isfinite(lse[0, 1]) and not out.isnan().any()


ALGEBRA_BAD = [
    ("scores not a tensor", lambda: summarize([1.0, 2.0], torch.ones(2, 3)), TypeError, "scores must be a torch.Tensor"),
    ("integer values", lambda: summarize(torch.ones(4, 2), torch.ones(2, 3, dtype=torch.int64)), TypeError,
     "values must be float16"),
    ("keys differ", lambda: summarize(torch.ones(4, 5), torch.ones(2, 3)), ValueError,
     "values has 2 keys (dim -2) but scores has 5 (dim -1)"),
    ("values of other rows", lambda: summarize(torch.ones(3, 4, 2), torch.ones(5, 2, 3)), ValueError,
     "values' leading dims (5,) do not broadcast to the scores' batch dims (3,)"),
    ("weights of another shape", lambda: summarize(torch.ones(4, 2), torch.ones(2, 3), torch.ones(3, 2)), ValueError,
     "numerator_weights' dims (3, 2) do not broadcast to those of scores (4, 2)"),
    ("summary not a triple", lambda: merge(torch.ones(2), random_summary(1)), TypeError, "a must be a BlockSummary"),
    ("u of other rows", lambda: finalize(BlockSummary(torch.ones(3), torch.ones(3), torch.ones(4, 2))), ValueError,
     "s: m (3,), l (3,) and u (4, 2) must be"),
    ("sides that do not broadcast", lambda: merge(random_summary(1), BlockSummary(*(torch.ones(2, *d) for d in ((), (), (5,))))),
     ValueError, "do not broadcast together"),
    ("lse of other rows", lambda: merge_states(torch.ones(3, 2), torch.ones(4), torch.ones(3, 2), torch.ones(3)),
     ValueError, "lse_a has shape (4,) but out_a (3, 2) needs (3,)"),
    ("lse on another device", lambda: merge_states(torch.ones(3, 2), torch.ones(3, device="meta"), torch.ones(3, 2),
                                                   torch.ones(3)), ValueError, "lse_a is on meta but out_a is on cpu"),
    ("weights on another device", lambda: summarize(torch.ones(4, 2), torch.ones(2, 3), torch.ones(4, 2, device="meta")),
     ValueError, "numerator_weights is on meta but scores is on cpu"),
]


@pytest.mark.parametrize("case", ALGEBRA_BAD, ids=[c[0] for c in ALGEBRA_BAD])
def test_bad_arguments_of_the_public_algebra_are_refused_by_name(case):
    _, call, error, message = case
    with pytest.raises(error) as info:
        call()
    assert message in str(info.value), str(info.value)
