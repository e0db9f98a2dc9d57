import pytest
import torch

import exattn
from exattn.dropout import uniform
from test_tiled import SHAPES, check_backend, make_inputs


def test_uniform_matches_triton_rand_bit_for_bit():
    import triton  # part of the test extra: a missing triton must fail, not skip
    import triton.language as tl

    @triton.jit
    def rand_kernel(out, seed, base, N: tl.constexpr):
        offsets = base + tl.arange(0, N).to(tl.int64)
        tl.store(out + tl.arange(0, N), tl.rand(seed, offsets))

    for seed in (0, 3, 2**40 + 17, 2**63 - 5):
        for base in (0, 2**32 - 40, 2**33 + 5):
            got = torch.empty(64)
            rand_kernel[(1,)](got, seed, base, N=64)
            expected = uniform(seed, base + torch.arange(64, dtype=torch.int64))
            assert torch.equal(got, expected), (seed, base)


def test_mask_is_a_function_of_position_and_seed():
    shape = (2, 3, 17, 29)
    mask = exattn.dropout_mask(11, shape, 0.25)
    assert mask.shape == shape and mask.dtype == torch.bool
    assert torch.equal(mask, exattn.dropout_mask(11, shape, 0.25))
    assert not torch.equal(mask, exattn.dropout_mask(12, shape, 0.25))
    # the counter ((b*Hq + h)*Nq + i)*Nk + j: a tile cut from a larger problem is not a slice
    counter = ((1 * 3 + 2) * 17 + 5) * 29 + 7
    assert mask[1, 2, 5, 7] == (uniform(11, torch.tensor([counter]))[0] >= 0.25)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_fraction_is_close_to_one_minus_p(p):
    mask = exattn.dropout_mask(5, (2, 4, 128, 128), p)
    n = mask.numel()
    tolerance = 5 * (p * (1 - p) / n) ** 0.5
    assert abs(mask.float().mean().item() - (1 - p)) < tolerance


def test_zero_dropout_keeps_everything():
    assert exattn.dropout_mask(5, (1, 2, 8, 8), 0.0).all()


@pytest.mark.parametrize("tiles", [(16, 16), (7, 13), (64, 8)])
def test_tiled_dropout_equals_oracle_with_the_same_mask(tiles):
    check_backend("tiled", SHAPES["gqa-dv"], torch.float32, "causal", tiles=tiles, dropout_p=0.3)


def test_dropout_in_half_precision_and_with_masks():
    check_backend("tiled", SHAPES["nq-gt-nk"], torch.float16, "bias", tiles=(16, 16), dropout_p=0.2)


def test_another_seed_gives_another_output_and_no_seed_draws_one():
    q, k, v = make_inputs(SHAPES["gqa-dv"], torch.float32)
    a = exattn.attention(q, k, v, dropout_p=0.5, seed=1)
    assert torch.equal(a, exattn.attention(q, k, v, dropout_p=0.5, seed=1))
    assert not torch.equal(a, exattn.attention(q, k, v, dropout_p=0.5, seed=2))
    torch.manual_seed(0)
    x = exattn.attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(0)
    assert torch.equal(x, exattn.attention(q, k, v, dropout_p=0.5))
