"""benchmarks/compiled.py: its block computes the same function with exattn and with SDPA, and its
rows and table (the timing needs a GPU)."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import compiled  # noqa: E402


def test_the_block_is_the_same_function_with_exattn_and_with_sdpa():
    torch.manual_seed(0)
    ours = compiled.AttentionBlock("exattn", 50, hidden=96, head_dim=24, device="cpu", dtype=torch.float64)
    anchor = compiled.AttentionBlock("sdpa-cudnn", 50, hidden=96, head_dim=24, device="cpu", dtype=torch.float64)
    anchor.load_state_dict(ours.state_dict())
    x = torch.randn(3, 50, 96, dtype=torch.float64)
    torch.testing.assert_close(ours(x), anchor(x), rtol=1e-10, atol=1e-10)


def test_rotary_rotates_pairs_by_their_angle():
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    angle = torch.rand(5, 4, dtype=torch.float64)
    cos, sin = torch.cat((angle.cos(), angle.cos()), -1), torch.cat((angle.sin(), angle.sin()), -1)
    rotated = compiled.rotary(x, cos, sin)
    as_complex = torch.complex(x[..., :4], x[..., 4:]) * torch.polar(torch.ones_like(angle), angle)
    torch.testing.assert_close(rotated, torch.cat((as_complex.real, as_complex.imag), -1))


def test_rows_are_medians_against_the_same_modules_eager_row():
    samples = {
        ("exattn", "block", "eager"): [2.0, 3.0, 4.0],
        ("exattn", "block", "inductor"): [1.0, 5.0, 1.5],
        ("exattn", "attention", "reduce-overhead"): [1.0, 1.0, 1.0],
        ("sdpa-cudnn", "block", "eager"): "failed: RuntimeError: no",
        ("sdpa-cudnn", "block", "inductor"): [1.0, 1.0, 1.0],
    }
    rows = {(r["impl"], r["module"], r["mode"]): r for r in compiled.rows_of(samples, 1024)}
    assert rows["exattn", "block", "inductor"]["ms"] == 1.5 and rows["exattn", "block", "inductor"]["x_eager"] == 2.0
    assert rows["exattn", "block", "eager"]["x_eager"] == 1.0
    assert rows["exattn", "attention", "reduce-overhead"]["note"] == "eager: no eager row"
    assert rows["sdpa-cudnn", "block", "inductor"]["note"] == "eager: failed: RuntimeError: no"
    table = compiled.table(list(rows.values()))
    assert "| block | 1024 | exattn | 3.000 | 1.500 (2.00) | – |" in table
    assert "| block | 1024 | sdpa-cudnn | – | – | – |" in table
