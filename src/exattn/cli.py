"""The `exattn` command: `experiment` (the study), `memory` (tensor sizes), `plan` (tile choice),
`warmup` (compile the GPU kernels ahead of time).

Bad arguments print a message naming the flag, the value and what is
expected, and exit with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from .experiment.config import (
    ConfigError, ExperimentConfig, build_config, dtype_name, parse_list, positive_int, tile,
)

EXPERIMENT_HELP = {
    "out": "folder for results.json, results.csv, report.md and the plots (default experiment-out)",
    "config": "TOML file with any of these settings (flag names, dashes or underscores)",
    "device": "cpu (default) or cuda[:i]",
    "seq_lens": "comma-separated sequence lengths N (default 256,512,1024,2048; cuda 1024..8192)",
    "tiles": "comma-separated block_m x block_n tiles (default 64x64,128x64,64x256,128x128)",
    "dtypes": "comma-separated among fp32, fp16, bf16 (default fp32,fp16,bf16)",
    "phases": "prefill (all queries, fwd+bwd) and/or decode (one query, fwd) (default both)",
    "causal": "comma-separated on/off (default off,on)",
    "dropout": "comma-separated dropout probabilities; nonzero ones form the matched-mask pass (default 0,0.1)",
    "dropout_seq_lens": "sequence lengths of the dropout pass (default 256; CPU Philox is slow)",
    "backends": "implementations compared with the naive baseline: tiled, triton (default tiled; cuda triton,tiled)",
    "batch": "batch size B (default 1)",
    "heads": "query heads Hq (default 2)",
    "kv_heads": "key/value heads Hk, dividing Hq (default Hq)",
    "head_dim": "head dimension D = Dv (default 64)",
    "repeats": "timed repeats; the median is reported (default 3)",
    "warmup": "untimed warm-up runs, the error run included (default 1)",
    "naive_max_len": "largest N for the naive baseline, which materializes N x N (default 4096)",
    "memory": "measure peak memory, each run in a fresh process (default on)",
    "memory_timeout": "seconds allowed for one memory or DRAM measurement (default 300)",
    "dram": "cuda only: measure each run's DRAM bytes read+written with Nsight Compute (ncu) hardware "
            "counters, next to the modeled traffic (default off; one ncu process per run)",
    "on_chip_bytes": "fast-memory size for the traffic model (default: CUDA shared memory / CPU L2)",
    "seed": "seed of the inputs and of the dropout masks (default 0)",
    "threads": "torch CPU threads (default: torch's)",
    "plots": "write the PNG plots (default on)",
    "quick": "a smaller sweep: N 128,256,512, tiles 16x16,32x64,64x64, 2 repeats",
}
SWITCHES = ("memory", "dram", "plots")


def add_experiment(sub) -> None:
    p = sub.add_parser("experiment", help="run the tile x length x precision study",
                       description="Sweep sequence lengths, tiles, dtypes, causal and phases; measure "
                       "errors vs a float64 oracle, peak memory, modeled traffic and time; write a report.")
    for f in dataclasses.fields(ExperimentConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "quick":
            p.add_argument(flag, action="store_const", const=True, default=None, help=EXPERIMENT_HELP[f.name])
        elif f.name in SWITCHES:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=EXPERIMENT_HELP[f.name])
        else:
            p.add_argument(flag, dest=f.name, default=None, metavar=f.name.upper(), help=EXPERIMENT_HELP[f.name])
    p.set_defaults(handler=run_experiment, command_parser=p)


def number(kind, minimum, words: str):
    """An argparse type: a `kind` that is >= minimum (> 0 when minimum is 0 and kind is float)."""
    def check(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or value < minimum or (kind is float and value <= 0):
            raise argparse.ArgumentTypeError(f"must be {words}, got {text!r}")
        return value
    return check


def positive(kind):
    return number(kind, 1 if kind is int else 0, f"a positive {kind.__name__}")


NON_NEGATIVE = number(int, 0, "an int >= 0")


def add_memory(sub) -> None:
    p = sub.add_parser("memory", help="sizes of the dense weight matrix and of the output",
                       description="Calculated tensor sizes (not measured peaks) of the (B, H, Nq, Nk) "
                       "attention weight matrix and the (B, H, Nq, Dv) output.")
    p.add_argument("--seq-len", type=positive(int), required=True, help="queries Nq")
    p.add_argument("--head-dim", type=positive(int), required=True, help="value coordinates Dv (= head dim)")
    p.add_argument("--dtype", default="fp16", help="fp16 (default), bf16, fp32 or fp64")
    p.add_argument("--batch", type=positive(int), default=1)
    p.add_argument("--heads", type=positive(int), default=1)
    p.add_argument("--seq-len-k", type=positive(int), default=None, help="keys Nk (default Nq)")
    p.add_argument("--value-dim", type=positive(int), default=None, help="Dv if not the head dim")
    p.set_defaults(handler=run_memory, command_parser=p)


def config_arg(parse):
    """An argparse type from a parser of text that raises ConfigError (reported as argparse's own error)."""
    def check(text: str):
        try:
            return parse(text)
        except ConfigError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    return check


tiles_arg = config_arg(lambda text: parse_list("--tiles", text, tile))


dtype_arg = config_arg(lambda text: dtype_name("--dtype", text))


def add_plan(sub) -> None:
    p = sub.add_parser("plan", help="pick tiles minimizing modeled traffic under an error bound",
                       description="Choose block_m x block_n minimizing MODELED memory traffic while the "
                       "output and gradient errors stay within --max-error, on your shapes: MEASURED on random "
                       "inputs (--bound empirical, the default) or PROVEN for every input whose scores you "
                       "bound (--bound proven, docs/error-bound.md).")
    p.add_argument("--seq-len", type=positive(int), required=True, help="sequence length N (Nq = Nk)")
    p.add_argument("--head-dim", type=positive(int), required=True, help="head dimension D")
    p.add_argument("--dtype", type=dtype_arg, default="bf16", help="fp32, fp16 or bf16 (default bf16)")
    p.add_argument("--max-error", type=positive(float), required=True,
                   help="largest error accepted for the output and each gradient: empirical, max-abs / "
                   "max|oracle|; proven, |out - o| / max|v|, the lse's absolute error and each gradient's "
                   "error over its normalizer (docs/error-bound.md)")
    p.add_argument("--bound", choices=("empirical", "proven"), default="empirical",
                   help="empirical (default): measure the worst error over --trials random inputs; covers "
                   "every backend and all of dq, dk, dv with realistic errors, but is no guarantee. proven: an "
                   "a-priori worst-case bound for the tiled backend, valid for EVERY input within "
                   "--score-bound; runs nothing, but is typically 10-300x above measured errors, so it "
                   "accepts fewer tiles. Empirical is the default because it needs no bound on the inputs "
                   "and judges the backend you will run.")
    p.add_argument("--score-bound", type=positive(float), default=None,
                   help="proven mode (required): S >= scale * sum_d |q_id| |k_jd| for every query/key pair; "
                   "scale * max|q_i|_2 * max|k_j|_2 will do (e.g. with QK-norm)")
    p.add_argument("--score-range", type=positive(float), default=None,
                   help="proven mode: R >= max_j s_ij - min_j s_ij in any row (default 2 S)")
    p.add_argument("--max-naive-ratio", type=positive(float), default=None,
                   help="also require error <= this multiple of the naive same-dtype error")
    p.add_argument("--batch", type=positive(int), default=1)
    p.add_argument("--heads", type=positive(int), default=1)
    p.add_argument("--kv-heads", type=positive(int), default=None)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--tiles", type=tiles_arg, default=None, help="candidates (default: 16..256 squared grid)")
    p.add_argument("--trials", type=positive(int), default=2, help="random inputs per candidate (worst counts)")
    p.add_argument("--runners-up", type=NON_NEGATIVE, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--backend", choices=("tiled", "triton"), default=None, help="default tiled (cuda: triton)")
    p.add_argument("--on-chip-bytes", type=positive(int), default=None)
    p.add_argument("--seed", type=NON_NEGATIVE, default=0)
    p.add_argument("--out", default=None, help="also write the plan as JSON to this file")
    p.set_defaults(handler=run_plan, command_parser=p)


def list_arg(flag: str, item):
    """An argparse type: a comma-separated list, each element through `item(flag, text)`."""
    return config_arg(lambda text: parse_list(flag, text, item))


CAUSAL_CHOICES = {"both": (False, True), "yes": (True,), "no": (False,)}


def add_warmup(sub) -> None:
    p = sub.add_parser("warmup", help="compile the GPU kernels ahead of time into Triton's cache",
                       description="Run exattn.attention (forward and backward) and exattn.decode once for "
                       "every dtype x head dim x length x causal, so that Triton compiles the kernels into its "
                       "on-disk cache (TRITON_CACHE_DIR, default ~/.triton/cache) and later processes start "
                       "without compiling. Triton specializes on head counts and lengths: give your model's.")
    p.add_argument("--head-dims", type=list_arg("--head-dims", positive_int), default=(64, 128),
                   help="comma-separated head dimensions D (default 64,128)")
    p.add_argument("--dtypes", type=list_arg("--dtypes", dtype_name), default=("bf16",),
                   help="comma-separated among bf16, fp16, fp32 (default bf16)")
    p.add_argument("--lengths", type=list_arg("--lengths", positive_int), default=(1024, 2048, 4096),
                   help="comma-separated sequence lengths N; decode: keys in the cache (default 1024,2048,4096)")
    p.add_argument("--heads", type=positive(int), default=16, help="query heads Hq (default 16)")
    p.add_argument("--kv-heads", type=positive(int), default=None, help="key/value heads Hk, dividing Hq (default Hq)")
    p.add_argument("--batch", type=positive(int), default=1, help="batch size B (default 1)")
    p.add_argument("--causal", choices=tuple(CAUSAL_CHOICES), default="both",
                   help="prefill causal, non-causal or both (default both)")
    p.add_argument("--backward", action=argparse.BooleanOptionalAction, default=True,
                   help="also compile the backward (default on)")
    p.add_argument("--decode", action=argparse.BooleanOptionalAction, default=True,
                   help="also compile exattn.decode of one token over a cache of each length (default on)")
    p.add_argument("--device", default="cuda", help="cuda (default) or cuda:INDEX")
    p.set_defaults(handler=run_warmup, command_parser=p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="exattn", description="Exact attention without the N x N matrix: the study tools.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_experiment(sub)
    add_memory(sub)
    add_plan(sub)
    add_warmup(sub)
    return parser


def check_device(parser, device: str) -> None:
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            parser.error(f"--device {device}: no CUDA device is available (torch.cuda.is_available() is False)")
    elif device != "cpu":
        parser.error(f"--device must be cpu or cuda[:index], got {device!r}")


def check_warmup_device(parser, device: str) -> None:
    import torch

    why = "warmup compiles the GPU kernels"
    if not device.startswith("cuda"):
        parser.error(f"--device must be cuda or cuda:INDEX ({why}), got {device!r}")
    if not torch.cuda.is_available():
        parser.error(f"--device {device}: no CUDA device is available (torch.cuda.is_available() is False); "
                     f"{why} and needs one")


def check_ncu(parser) -> None:
    from .experiment.dram import find_ncu, not_found

    if find_ncu() is None:
        parser.error(f"--dram: {not_found()}; set EXATTN_NCU=/path/to/ncu or leave --dram off")


def run_experiment(args, argv: list[str]) -> int:
    parser = args.command_parser
    flags = {f.name: getattr(args, f.name) for f in dataclasses.fields(ExperimentConfig)}
    try:
        config = build_config(flags)
    except ConfigError as err:
        parser.error(str(err))
    check_device(parser, config.device)
    if config.dram:
        check_ncu(parser)
    from pathlib import Path

    try:
        Path(config.out).mkdir(parents=True, exist_ok=True)
    except OSError as err:
        parser.error(f"--out {config.out!r} cannot be created: {err}")
    from .experiment.report import write_report
    from .experiment.sweep import run_sweep

    start = time.perf_counter()
    results = run_sweep(config, progress=True, argv=argv)
    results.meta["wall_seconds"] = time.perf_counter() - start
    paths = write_report(results, config.out)
    statuses = [r["status"] for r in results.rows]
    print(f"{len(statuses)} runs: {statuses.count('ok')} ok, {statuses.count('failed')} failed, "
          f"{statuses.count('skipped')} skipped; {time.perf_counter() - start:.1f} s")
    for path in paths:
        print(f"wrote {path}")
    return 0


def run_memory(args, argv) -> int:
    from .experiment.memory_calc import describe, tensor_sizes

    try:
        sizes = tensor_sizes(args.seq_len, args.head_dim, args.dtype, args.batch, args.heads,
                             args.seq_len_k, args.value_dim)
    except ValueError as err:
        args.command_parser.error(str(err))
    print(describe(sizes))
    return 0


def run_plan(args, argv) -> int:
    import json

    from .experiment.plan import PlanRequest, describe, plan_tiles

    parser = args.command_parser
    check_device(parser, args.device)
    if args.kv_heads and args.heads % args.kv_heads:
        parser.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    if args.bound == "proven" and args.score_bound is None:
        parser.error("--bound proven needs --score-bound S (S >= scale * sum_d |q_id| |k_jd| for all pairs)")
    if args.bound == "proven" and args.backend == "triton":
        parser.error("--bound proven covers the tiled backend only (docs/error-bound.md); "
                     "use --bound empirical for --backend triton")
    cuda_default = args.device.startswith("cuda") and args.bound == "empirical"
    backend = args.backend or ("triton" if cuda_default else "tiled")
    fields = {k: v for k, v in vars(args).items() if k in {f.name for f in dataclasses.fields(PlanRequest)}}
    fields.update(backend=backend)
    if fields.get("tiles") is None:
        fields.pop("tiles", None)
    result = plan_tiles(PlanRequest(**fields), progress=lambda t: print(f"measuring {t} ...", file=sys.stderr))
    print(describe(result))
    if args.out:
        from .experiment.report import strict

        with open(args.out, "w") as f:
            json.dump(strict(result.as_dict()), f, indent=1)
        print(f"wrote {args.out}")
    return 0 if result.choice is not None else 1


def describe_warmup_row(row: dict) -> str:
    causal = {True: "causal", False: "non-causal", None: ""}[row["causal"]]
    return (f"{row['kind']:<7} {row['dtype']} d={row['head_dim']:<3} N={row['length']:<6} {causal:<10} "
            f"heads {row['heads']}/{row['kv_heads']}  {row['seconds']:.2f} s")


def run_warmup(args, argv) -> int:
    import os

    import torch

    from .warmup import run_jobs, warmup_plan

    parser = args.command_parser
    check_warmup_device(parser, args.device)
    torch_dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    dtypes = tuple(torch_dtypes[name] for name in args.dtypes)
    try:
        plan = warmup_plan(head_dims=args.head_dims, dtypes=dtypes, lengths=args.lengths, heads=args.heads,
                           kv_heads=args.kv_heads, batch=args.batch, causal=CAUSAL_CHOICES[args.causal],
                           backward=args.backward, decode=args.decode, device=args.device)
    except (TypeError, ValueError, ImportError) as err:
        parser.error(str(err))
    start = time.perf_counter()
    rows = run_jobs(plan, progress=lambda row: print(describe_warmup_row(row), flush=True))
    cache = os.environ.get("TRITON_CACHE_DIR", "~/.triton/cache")
    print(f"total: {len(rows)} jobs in {time.perf_counter() - start:.1f} s; Triton's cache: {cache}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `exattn` console script; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    return args.handler(args, argv)


if __name__ == "__main__":
    sys.exit(main())
