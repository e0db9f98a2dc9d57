"""The experiment package: config, oracle, traffic model, measurements, memory calculator, plan."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from exattn.experiment import config as cfg
from exattn.experiment import measure, memory_calc, plan, sweep, traffic
from exattn.experiment.isolate import peak_memory
from exattn.experiment.oracle import oracle
from exattn.experiment.workload import RunSpec, make_inputs, run_once
from exattn.reference import attention_ref


def spec(**overrides) -> RunSpec:
    fields = dict(phase="prefill", impl="tiled", dtype="fp32", seq_len=40, causal=True, dropout_p=0.0,
                  block_m=16, block_n=32, batch=1, heads=2, heads_k=1, head_dim=24, seed=3, device="cpu")
    return RunSpec(**(fields | overrides))


# ---------------------------------------------------------------- config

def test_config_flags_override_toml_and_quick(tmp_path):
    path = tmp_path / "study.toml"
    path.write_text('[experiment]\nseq-lens = [64, 96]\ntiles = ["16x32", [32, 16]]\nrepeats = 5\nquick = true\n')
    config = cfg.build_config({"config": str(path), "repeats": "2", "dtypes": "bf16,float16"})
    assert config.seq_lens == (64, 96)
    assert config.tiles == ((16, 32), (32, 16))
    assert config.repeats == 2
    assert config.dtypes == ("bf16", "fp16")
    assert config.quick and config.dropout_seq_lens == cfg.QUICK["dropout_seq_lens"]


@pytest.mark.parametrize("flags, words", [
    ({"tiles": "16x"}, "--tiles"), ({"tiles": "0x16"}, "--tiles"), ({"seq_lens": "12,-3"}, "--seq-lens"),
    ({"dtypes": "fp8"}, "--dtypes"), ({"dropout": "1.0"}, "--dropout"), ({"causal": "maybe"}, "--causal"),
    ({"phases": "train"}, "--phases"), ({"repeats": "0"}, "--repeats"), ({"device": "tpu"}, "--device"),
    ({"heads": "3", "kv_heads": "2"}, "--kv-heads"), ({"backends": "flash"}, "--backends"),
])
def test_config_rejects_bad_values_naming_the_flag(flags, words):
    with pytest.raises(cfg.ConfigError, match=words):
        cfg.build_config(flags)


def test_config_rejects_unknown_toml_key_and_bad_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("seq_lenz = [1]\n")
    with pytest.raises(cfg.ConfigError, match="unknown setting 'seq-lenz'"):
        cfg.build_config({"config": str(path)})
    path.write_text("seq_lens = [1\n")
    with pytest.raises(cfg.ConfigError, match="not valid TOML"):
        cfg.build_config({"config": str(path)})
    with pytest.raises(cfg.ConfigError, match="does not exist"):
        cfg.build_config({"config": str(tmp_path / "missing.toml")})


def test_plan_runs_grid_shape():
    config = cfg.build_config({"seq_lens": "32,64", "tiles": "16x16,32x16", "dtypes": "fp32",
                               "dropout": "0,0.2", "dropout_seq_lens": "32"})
    groups = sweep.plan_runs(config)
    prefill = [g for g in groups if g[0].phase == "prefill"]
    decode = [g for g in groups if g[0].phase == "decode"]
    assert len(prefill) == 2 * 2 + 2 * 1  # causal x lengths without dropout, causal x dropout lengths
    assert len(decode) == 2
    assert all(g[0].impl == "naive" and len(g) == 3 for g in prefill)
    assert all([r.tile for r in g] == ["-", "1x16"] for g in decode)  # one run per distinct block_n
    assert {r.dropout_p for g in prefill for r in g} == {0.0, 0.2}


# ---------------------------------------------------------------- oracle and errors

def test_chunked_oracle_equals_attention_ref(monkeypatch):
    run = spec(dropout_p=0.25, seq_len=37)
    inputs = make_inputs(run)
    monkeypatch.setattr("exattn.experiment.oracle.CHUNK_ELEMENTS", 2 * 37 * 5)  # chunks of 5 rows
    chunked = oracle(run, inputs)
    from exattn import dropout_mask

    q, k, v = (x.detach().double().requires_grad_() for x in inputs[:3])
    keep = dropout_mask(run.seed, (1, 2, 37, 37), 0.25)
    ref = attention_ref(q, k, v, causal=True, dropout_mask=keep, dropout_p=0.25)
    ref.backward(inputs.dout.double())
    torch.testing.assert_close(chunked.out, ref.detach(), rtol=0, atol=1e-13)
    for ours, theirs in zip(chunked.grads, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-13)


def test_error_stats_and_ratios():
    run = spec(dtype="bf16")
    inputs = make_inputs(run)
    ref = oracle(run, inputs)
    stats = measure.error_stats(*run_once(run, inputs), ref)
    naive = measure.error_stats(*run_once(dataclasses.replace(run, impl="naive"), inputs), ref)
    assert 0 < stats["out_err_max_abs"] < 0.1 and 0 < stats["grad_err_max_abs"] < 0.1
    assert stats["grad_err_max_abs"] == max(stats[f"{n}_err_max_abs"] for n in ("dq", "dk", "dv"))
    ratios = measure.ratios_to_naive(stats, naive)
    assert ratios["out_err_ratio_naive"] == pytest.approx(stats["out_err_max_abs"] / naive["out_err_max_abs"])
    assert ratios["out_err_ratio_naive"] <= 2 and ratios["grad_err_ratio_naive"] <= 2
    nan = measure.max_abs_error(torch.tensor([float("nan"), 1.0]), torch.zeros(2))
    assert math.isnan(nan)


def test_decode_run_is_forward_only_and_matches_oracle():
    run = spec(phase="decode", seq_len=70, block_m=1, block_n=16, causal=True)
    inputs = make_inputs(run)
    assert inputs.q.shape[2] == 1 and inputs.dout is None
    out, grads = run_once(run, inputs)
    assert grads is None
    stats = measure.error_stats(out, grads, oracle(run, inputs))
    assert stats["out_err_rel"] < 1e-5 and stats["grad_err_rel"] is None


def test_failed_run_becomes_a_row_not_a_crash(monkeypatch):
    config = cfg.build_config({"seq_lens": "32", "tiles": "16x16", "dtypes": "fp32", "phases": "prefill",
                               "causal": "off", "dropout": "0", "memory": "off", "repeats": "1"})
    real = sweep.run_once

    def flaky(run, inputs):
        if run.impl == "tiled":
            raise RuntimeError("simulated kernel failure")
        return real(run, inputs)

    monkeypatch.setattr(sweep, "run_once", flaky)
    rows = sweep.run_sweep(config, progress=False).rows
    assert [r["status"] for r in rows] == ["ok", "failed"]
    assert "simulated kernel failure" in rows[1]["note"]
    assert rows[1]["traffic_model_bytes"] > 0


def test_measured_dram_bytes_reach_rows_csv_and_report(monkeypatch, tmp_path):
    """With dram on, every completed run gets measure_dram's fields (here faked: no GPU) and the report shows them."""
    from exattn.experiment.report import write_report

    config = cfg.build_config({"seq_lens": "32,64", "tiles": "16x16", "dtypes": "fp32", "phases": "prefill",
                               "causal": "off", "dropout": "0", "memory": "off", "repeats": "1"})
    config = dataclasses.replace(config, dram=True)  # build_config refuses dram on the CPU
    measured = []

    def fake(run, timeout):
        measured.append(run)
        if run.impl == "naive" and run.seq_len == 32:
            return {"dram_error": "simulated: ncu refused"}
        return {"dram_read_bytes": 3000, "dram_write_bytes": 1000, "dram_bytes": 4000, "dram_kernels": 2,
                "dram_method": "fake"}

    monkeypatch.setattr(sweep, "measure_dram", fake)
    results = sweep.run_sweep(config, progress=False)
    assert len(measured) == 4 and all(r["status"] == "ok" for r in results.rows)
    assert results.rows[0]["dram_error"] == "simulated: ncu refused" and "dram_bytes" not in results.rows[0]
    assert all(r["dram_bytes"] == 4000 for r in results.rows[1:])
    write_report(results._replace(meta=results.meta | {"config": results.meta["config"] | {"plots": False}}),
                 tmp_path)
    header = (tmp_path / "results.csv").read_text().splitlines()[0].split(",")
    assert header.index("dram_bytes") == header.index("traffic_model_fwd_bytes") + 1
    report = (tmp_path / "report.md").read_text()
    assert "| DRAM MiB (measured) | measured / model |" in report
    assert "DRAM not measured: simulated: ncu refused" in report
    assert "Measured DRAM traffic (Nsight Compute; N = 64" in report
    assert "Measured DRAM bytes (Nsight Compute) cover every kernel" in report


def test_naive_is_capped_with_a_reason():
    config = cfg.build_config({"seq_lens": "48", "tiles": "16x16", "dtypes": "fp32", "phases": "prefill",
                               "causal": "on", "dropout": "0", "memory": "off", "repeats": "1",
                               "naive_max_len": "32"})
    rows = sweep.run_sweep(config, progress=False).rows
    assert rows[0]["status"] == "skipped" and "--naive-max-len 32" in rows[0]["note"]
    assert rows[1]["status"] == "ok" and rows[1]["out_err_ratio_naive"] is None


def test_peak_memory_is_measured_in_a_child_and_grows_with_the_matrix():
    small = peak_memory(spec(impl="naive", seq_len=256, heads_k=2, block_m=None, block_n=None))
    large = peak_memory(spec(impl="naive", seq_len=1024, heads_k=2, block_m=None, block_n=None))
    assert "fresh process" in large["method"]
    assert large["peak_bytes"] > 4 * small["peak_bytes"] > 0


# ---------------------------------------------------------------- traffic model

def test_traffic_model_counts():
    s = traffic.Shape(batch=1, heads=1, len_q=256, len_k=256, head_dim=64, value_dim=64, elem=2)
    # forward: Q once, K/V once per query tile (256 / 64 = 4 tiles), O + lse once
    expected = 256 * 64 * 2 + 4 * 256 * 128 * 2 + 256 * (64 * 2 + 4)
    assert traffic.tiled_forward_bytes(s, 64) == expected
    assert traffic.tiled_forward_bytes(s, 128) < traffic.tiled_forward_bytes(s, 64)
    assert traffic.tiled_backward_bytes(s, 128) < traffic.tiled_backward_bytes(s, 64)
    causal = dataclasses.replace(s, causal=True)
    assert traffic.tiled_forward_bytes(causal, 64) < traffic.tiled_forward_bytes(s, 64)
    naive = traffic.naive_bytes(s, backward=True)
    assert naive == traffic.io_bytes(s, True) + 11 * 256 * 256 * 2
    assert traffic.on_chip_footprint(128, 128, 64, 64, 2) > traffic.on_chip_footprint(64, 64, 64, 64, 2)


# ---------------------------------------------------------------- memory calculator

def test_memory_calculator_founding_document_example():
    sizes = memory_calc.tensor_sizes(seq_len=16_384, head_dim=64, dtype="fp16")
    assert sizes.weight_entries == 268_435_456
    assert sizes.weight_bytes == 512 * 2**20
    assert sizes.output_entries == 1_048_576
    assert sizes.output_bytes == 2 * 2**20
    text = memory_calc.describe(sizes)
    assert "268,435,456 entries" in text and "512 MiB" in text
    assert "1,048,576 entries" in text and "2 MiB" in text
    assert "not measured peak memory" in text


def test_memory_calculator_general_shapes_and_errors():
    sizes = memory_calc.tensor_sizes(seq_len=3, head_dim=5, dtype="fp32", batch=2, heads=7, seq_len_k=11, value_dim=13)
    assert sizes.weight_entries == 2 * 7 * 3 * 11 and sizes.weight_bytes == 4 * 2 * 7 * 3 * 11
    assert sizes.output_entries == 2 * 7 * 3 * 13
    assert memory_calc.human(1536) == "1.5 KiB" and memory_calc.human(3 * 2**30) == "3 GiB"
    with pytest.raises(ValueError, match="--dtype"):
        memory_calc.tensor_sizes(seq_len=4, head_dim=4, dtype="int8")
    with pytest.raises(ValueError, match="--seq-len"):
        memory_calc.tensor_sizes(seq_len=0, head_dim=4, dtype="fp16")


# ---------------------------------------------------------------- plan

def request(**overrides) -> plan.PlanRequest:
    fields = dict(seq_len=48, head_dim=24, dtype="bf16", max_error=1.0, heads=2, causal=True,
                  tiles=((16, 16), (16, 48), (48, 16), (48, 48)), trials=1)
    return plan.PlanRequest(**(fields | overrides))


def test_plan_picks_lowest_traffic_within_the_bound():
    result = plan.plan_tiles(request())
    ranked = [c for c in result.candidates]
    assert result.choice is ranked[0]  # a loose bound: the lowest modeled traffic wins
    assert [c.traffic_model_bytes for c in ranked] == sorted(c.traffic_model_bytes for c in ranked)
    assert result.choice.out_err_rel <= 1.0 and result.choice.grad_err_rel <= 1.0
    assert len(result.runners_up) == 3


def test_plan_respects_a_tight_bound_and_the_on_chip_limit():
    fp32 = plan.plan_tiles(request(dtype="fp32", max_error=1e-3, on_chip_bytes=40_000))
    for cand in fp32.candidates:
        fits = cand.on_chip_bytes <= 40_000
        assert fits or cand.verdict.startswith("rejected: needs")
    assert any(c.verdict.startswith("rejected: needs") for c in fp32.candidates)
    assert fp32.choice is not None and fp32.choice.on_chip_bytes <= 40_000
    assert fp32.choice.out_err_rel <= 1e-3 and fp32.choice.grad_err_rel <= 1e-3
    impossible = plan.plan_tiles(request(max_error=1e-9))  # bf16 cannot reach 1e-9
    assert impossible.choice is None and not impossible.runners_up
    measured = [c for c in impossible.candidates if c.out_err_rel is not None]
    assert measured and all(c.verdict.startswith("rejected") for c in measured)
    assert "NO candidate met the bound" in plan.describe(impossible)


def test_plan_skips_lower_traffic_tiles_that_break_the_bound(monkeypatch):
    """The bound binds: the two lowest-traffic tiles are too inaccurate, so the third is chosen."""
    ranked = plan.candidates(request(), fast_bytes=1 << 30)
    bad = {(c.block_m, c.block_n): err for c, err in zip(ranked, (0.5, 0.05, 0.01, 0.02))}

    def fake_errors(req, impl, block_m, block_n, trials):
        err = 0.001 if impl == "naive" else bad[(block_m, block_n)]
        return {"out_err_rel": err, "grad_err_rel": err, "out_err_max_abs": err, "grad_err_max_abs": err}

    monkeypatch.setattr(plan, "worst_errors", fake_errors)
    result = plan.plan_tiles(request(max_error=0.03, runners_up=1))
    assert (result.choice.block_m, result.choice.block_n) == (ranked[2].block_m, ranked[2].block_n)
    assert [(c.block_m, c.block_n) for c in result.runners_up] == [(ranked[3].block_m, ranked[3].block_n)]
    verdicts = [c.verdict for c in result.candidates]
    assert verdicts[0] == "rejected: output error 5.00e-01 > 0.03; gradient error 5.00e-01 > 0.03"
    assert verdicts[1].startswith("rejected") and verdicts[2] == verdicts[3] == "meets the bound"
    strict = plan.plan_tiles(request(max_error=0.03, max_naive_ratio=15.0))
    assert (strict.choice.block_m, strict.choice.block_n) == (ranked[2].block_m, ranked[2].block_n)
    assert "20.00x naive > 15x" in strict.candidates[3].verdict


def test_memory_measurement_failure_is_reported_not_raised():
    result = peak_memory(spec(impl="flash"))  # no such backend: the child reports the error
    assert "error" in result and "flash" in result["error"]


# ---------------------------------------------------------------- plan --bound proven

def test_proven_plan_picks_the_lowest_traffic_tile_whose_bound_fits():
    from exattn.bounds import tile_bounds

    req = request(dtype="fp32", bound="proven", score_bound=4.0, max_error=1e-4, tiles=((16, 16), (48, 48)))
    result = plan.plan_tiles(req)
    assert result.choice is not None and result.naive == {}
    for cand in result.candidates:
        b = tile_bounds(cand.block_m, cand.block_n, 48, 48, 24, "fp32", 4.0)
        fits = max(b["out"], b["lse"], b["dv"], b["dq"], b["dk"]) <= 1e-4
        assert fits == (cand.verdict == "proven within the bound")
    passing = [c for c in result.candidates if c.verdict == "proven within the bound"]
    assert result.choice is passing[0]  # candidates are ranked by traffic
    assert "proven" in plan.describe(result) and "nothing was run" in plan.describe(result)


def test_proven_plan_rejects_everything_when_the_bound_is_below_the_output_rounding():
    result = plan.plan_tiles(request(dtype="bf16", bound="proven", score_bound=4.0, max_error=1e-3))
    assert result.choice is None  # bf16 output rounding alone is 2^-8
    assert all(c.verdict.startswith("rejected") for c in result.candidates)


def test_proven_plan_needs_a_score_bound_and_the_tiled_backend():
    with pytest.raises(ValueError, match="score_bound"):
        plan.plan_tiles(request(bound="proven"))
    with pytest.raises(ValueError, match="tiled backend only"):
        plan.plan_tiles(request(bound="proven", score_bound=1.0, backend="triton"))


def test_sweep_rows_carry_the_proven_bound_next_to_the_measured_error():
    run = RunSpec(phase="prefill", impl="tiled", dtype="fp32", seq_len=40, causal=False, dropout_p=0.0,
                        block_m=16, block_n=16, batch=1, heads=2, heads_k=2, head_dim=16, seed=0, device="cpu")
    inputs = make_inputs(run)
    ref = oracle(run, inputs)
    row = sweep.execute(run, inputs, ref, None, cfg.ExperimentConfig(memory=False, repeats=1, warmup=1))
    assert row["out_err_over_max_v"] <= row["proven_out_bound"]
    assert row["proven_out_bound"] < 1e-3 and row["proven_grad_bound"] > 0
