"""exattn: exact softmax attention without storing the N x N matrix of weights."""

from .algebra import BlockSummary, finalize, merge, merge_states, summarize
from .attention import attention, explain_backend
from .backends import BackendChoice
from .decode import decode
from .dropout import dropout_mask
from .errors import check_errors
from .sdpa import sdpa
from .varlen import attention_varlen, explain_varlen_backend
from .warmup import warmup
from . import reference

__version__ = "0.1.0"

__all__ = [
    "BackendChoice",
    "BlockSummary",
    "attention",
    "attention_varlen",
    "check_errors",
    "decode",
    "dropout_mask",
    "explain_backend",
    "explain_varlen_backend",
    "finalize",
    "merge",
    "merge_states",
    "reference",
    "sdpa",
    "summarize",
    "warmup",
]
