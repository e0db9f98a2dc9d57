"""The decode split kernel compiled for sm_90a on any machine (no GPU): registers, spills and the
main loop's SASS instructions per key block, for contiguous and paged caches.

    python benchmarks/decode_sass.py                       # the plan's launches at a few shapes
    python benchmarks/decode_sass.py --baseline OLD.py     # and those of another decode_kernel.py
    git show REV:src/exattn/backends/triton/decode_kernel.py > /tmp/old.py   # e.g. a committed one

Arguments are recorded from `decode_forward` on CPU tensors and compiled with the JIT's
specialization (tests/test_triton_compile.py); SASS from the Triton wheel's cuobjdump. The main
loop is the longest backward branch's body.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from test_triton_compile import RecordedLaunch, compile_for_sm90  # noqa: E402

from exattn.backends.triton import decode_kernel  # noqa: E402
from exattn.decode import plan_launch  # noqa: E402

HEADS_Q, HEADS_K, HEAD_DIM = 32, 8, 128
SHAPES = ((1, 4096), (8, 4096), (64, 4096), (8, 1024))  # 3 stages; 3 stages merged in split; 2 stages x 2
LAYOUTS = (None, 16, 32, 256)  # contiguous, page sizes


def load_kernel_module(path: str):
    """A decode_kernel.py from a file, as a sibling of the package's own (its relative imports resolve)."""
    name = "exattn.backends.triton.decode_kernel_baseline"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def recorded_launch(module, batch: int, context: int, page_size: int | None):
    """decode_split_kernel's arguments for one decode step with the plan's configuration and splits."""
    config, splits = plan_launch(batch, HEADS_K, HEADS_Q // HEADS_K, HEAD_DIM, HEAD_DIM, context, 132)
    q = torch.randn(batch, HEADS_Q, 1, HEAD_DIM, dtype=torch.bfloat16)
    lens = torch.full((batch,), context, dtype=torch.int32)
    if page_size is None:
        k, table = torch.randn(batch, HEADS_K, context, HEAD_DIM, dtype=torch.bfloat16), None
    else:
        pages = batch * context // page_size
        k = torch.randn(pages, HEADS_K, page_size, HEAD_DIM, dtype=torch.bfloat16)
        table = torch.randperm(pages, dtype=torch.int32).view(batch, -1)
    real = module.decode_split_kernel, module.decode_combine_kernel
    recorder = module.decode_split_kernel = RecordedLaunch()
    module.decode_combine_kernel = RecordedLaunch()  # not compiled here
    try:
        module.decode_forward(q, k, torch.randn_like(k), lens, table, HEAD_DIM ** -0.5, splits,
                              module.DecodeConfig(*config))
    finally:
        module.decode_split_kernel, module.decode_combine_kernel = real
    return real[0], recorder.calls[0], config, splits


def sass_report(compiled) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        tool = triton.knobs.nvidia.cuobjdump.path
        usage = subprocess.run([tool, "--dump-resource-usage", cubin.name], capture_output=True, text=True).stdout
        listing = subprocess.run([tool, "-sass", cubin.name], capture_output=True, text=True).stdout
    code = [(int(address, 16), text.split(";")[0].strip())
            for address, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(.*)", listing)]
    loops = [(int(target, 16), address) for address, text in code
             for target in re.findall(r"BRA\b.*?0x([0-9a-f]+)", text) if int(target, 16) < address]
    start, end = max(loops, key=lambda span: span[1] - span[0], default=(0, -1))
    body = [text for address, text in code if start <= address <= end]
    opcodes = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0] for text in body)
    resources = {key: int(value) for key, value in re.findall(r"(REG|STACK|LOCAL):(\d+)", usage)}
    return dict(**resources, instructions=len(code), loop=len(body), loop_opcodes=dict(opcodes.most_common(12)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="another decode_kernel.py to compile beside the package's")
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args()
    modules = {"exattn": decode_kernel}
    if args.baseline:
        modules["baseline"] = load_kernel_module(args.baseline)
    rows = []
    for batch, context in SHAPES:
        for page_size in LAYOUTS:
            for label, module in modules.items():
                kernel, (launch_args, launch_kwargs), config, splits = recorded_launch(module, batch, context, page_size)
                report = sass_report(compile_for_sm90(kernel, launch_args, launch_kwargs))
                rows.append(dict(kernel=label, batch=batch, context=context, page_size=page_size,
                                 config=config._asdict(), splits=splits, **report))
                print(f"{label:<8} B={batch:<3} ctx={context:<6} page={page_size or '-':<4} stages={config.num_stages} "
                      f"splits={splits:<3} REG {report.get('REG')} STACK {report.get('STACK')} "
                      f"loop {report['loop']} of {report['instructions']}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
