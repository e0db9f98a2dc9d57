"""`exattn memory`: the sizes of the dense weight matrix and of the output, calculated exactly.

For one head of 16,384 queries and keys the matrix has 268,435,456 entries,
512 MiB at 2 bytes; an output of 64 value coordinates per query has
1,048,576 entries, 2 MiB. These are tensor sizes, not measured peaks.
"""

from __future__ import annotations

from dataclasses import dataclass

ELEMENT_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4, "fp64": 8}
ALIASES = {"float16": "fp16", "half": "fp16", "bfloat16": "bf16", "float32": "fp32",
           "float": "fp32", "float64": "fp64", "double": "fp64"}
UNITS = ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB")
DISCLAIMER = ("These are calculated tensor sizes, not measured peak memory: inputs, gradients, "
              "scratch space and accumulation precision add further costs "
              "(`exattn experiment` measures peaks).")


@dataclass(frozen=True)
class TensorSizes:
    """Entries and bytes of the (B, H, Nq, Nk) weight matrix and the (B, H, Nq, Dv) output."""

    batch: int
    heads: int
    len_q: int
    len_k: int
    value_dim: int
    dtype: str

    @property
    def element_bytes(self) -> int:
        return ELEMENT_BYTES[self.dtype]

    @property
    def weight_entries(self) -> int:
        return self.batch * self.heads * self.len_q * self.len_k

    @property
    def output_entries(self) -> int:
        return self.batch * self.heads * self.len_q * self.value_dim

    @property
    def weight_bytes(self) -> int:
        return self.weight_entries * self.element_bytes

    @property
    def output_bytes(self) -> int:
        return self.output_entries * self.element_bytes


def dtype_key(dtype: str) -> str:
    key = ALIASES.get(dtype.strip().lower(), dtype.strip().lower())
    if key not in ELEMENT_BYTES:
        raise ValueError(f"--dtype must be one of fp16, bf16, fp32, fp64, got {dtype!r}")
    return key


def tensor_sizes(seq_len: int, head_dim: int, dtype: str, batch: int = 1, heads: int = 1,
                 seq_len_k: int | None = None, value_dim: int | None = None) -> TensorSizes:
    """Sizes for Nq = seq_len queries, Nk = seq_len_k (default seq_len) keys, Dv = value_dim (default head_dim)."""
    for name, value in (("--seq-len", seq_len), ("--head-dim", head_dim), ("--batch", batch),
                        ("--heads", heads), ("--seq-len-k", seq_len_k), ("--value-dim", value_dim)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return TensorSizes(batch, heads, seq_len, seq_len_k or seq_len, value_dim or head_dim, dtype_key(dtype))


def human(size: int) -> str:
    """Binary units, exact when exact: 536870912 -> '512 MiB'."""
    value, unit = float(size), 0
    while value >= 1024 and unit < len(UNITS) - 1:
        value, unit = value / 1024, unit + 1
    text = f"{value:,.2f}".rstrip("0").rstrip(".")
    return f"{text} {UNITS[unit]}"


def describe(s: TensorSizes) -> str:
    """The calculator's printed answer."""
    each = f"{s.element_bytes} bytes each ({s.dtype})"
    return "\n".join([
        f"Dense attention weight matrix: B*H*Nq*Nk = {s.batch}*{s.heads}*{s.len_q}*{s.len_k} = "
        f"{s.weight_entries:,} entries; at {each}: {s.weight_bytes:,} bytes = {human(s.weight_bytes)}",
        f"Attention output: B*H*Nq*Dv = {s.batch}*{s.heads}*{s.len_q}*{s.value_dim} = "
        f"{s.output_entries:,} entries; at {each}: {s.output_bytes:,} bytes = {human(s.output_bytes)}",
        f"The weight matrix is {s.weight_entries / s.output_entries:,.4g}x the size of the output.",
        DISCLAIMER,
    ])
