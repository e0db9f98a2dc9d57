"""Input errors the decode kernels find on the device, raised on the host without a device sync.

With `validate=True` the decode kernels check every sequence's length
(`Nq <= cache_seqlens[b] <= capacity`), its start (`0 <= cache_leftpad[b] <=
cache_seqlens[b]`) and every page id they would read (`0 <= block_table[b, p] <
num_pages`). Whatever they find, they clamp (so nothing outside the caches is
read) and record: the first violation on a device claims a
persistent int32 record there (an atomic compare-and-swap of its flag), fills it in,
and sets a doorbell, one int32 in host memory that the device writes directly (pinned
and mapped into the GPU's address space). Reading the doorbell is a host memory read:

- every validated `exattn.decode` call first reads it; once it is set, that call syncs,
  reads and resets the record, and raises the ValueError;
- `check_errors()` syncs, reads and resets the record, and raises at once.

So an error surfaces at the first validated call that starts after the offending kernel
has finished, or at `check_errors()`, whichever comes first; a call while a CUDA graph
is being captured leaves it for the next.
"""

from __future__ import annotations

import ctypes
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import torch

# The record's int32 fields.
FLAG, KIND, INDEX, SLOT, VALUE, BOUND, PAGE_SIZE = range(7)
RECORD_SIZE = 8
# KIND values.
LENGTH_BELOW_NQ, LENGTH_BEYOND_CACHE, PAGE_OUT_OF_RANGE, LEFTPAD_OUT_OF_RANGE = 1, 2, 3, 4


class DeviceRecord(NamedTuple):
    """record: int32 (RECORD_SIZE,) on the device; doorbell: int32 (1,) in host memory the kernels
    write (pinned for CUDA devices); rung: a ctypes view of the doorbell (reading it costs no call
    into torch)."""

    record: torch.Tensor
    doorbell: torch.Tensor
    rung: ctypes.c_int32


_RECORDS: dict[torch.device, DeviceRecord] = {}


def device_record(device: torch.device) -> DeviceRecord:
    """The record and doorbell of `device`, made on first use and kept for the process (a captured
    CUDA graph keeps their addresses). Make it outside graph capture: the first decode call does."""
    state = _RECORDS.get(device)
    if state is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"the first validated exattn.decode call on {device} is being captured in a CUDA "
                               "graph: make one validated call before capturing (it allocates the record that "
                               "the captured kernels write)")
        record, doorbell = on_own_thread(lambda: allocate_record(device))
        state = _RECORDS[device] = DeviceRecord(record, doorbell, ctypes.c_int32.from_address(doorbell.data_ptr()))
    return state


def allocate_record(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    record = torch.zeros(RECORD_SIZE, dtype=torch.int32, device=device)
    doorbell = torch.zeros(1, dtype=torch.int32, pin_memory=device.type == "cuda")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return record, doorbell


def on_own_thread(make):
    """`make()` run on a thread of its own. A thread that warms up a CUDA graph (torch.compile's
    mode="reduce-overhead") allocates into the graph's memory pool, which must hold nothing but the
    graph's outputs when the warm-up ends; a record made there would stay alive inside that pool."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(make).result()


def raise_recorded(device: torch.device) -> None:
    """Raise what the kernels recorded on `device` if its doorbell is set; costs one host read when it is not."""
    state = _RECORDS.get(device)
    if state is None or not state.rung.value:
        return
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return
    read_and_raise(device, state)


def check_errors(device: torch.device | str | int | None = None) -> None:
    """Wait for the device, then raise a ValueError naming the first invalid sequence that the
    decode kernels recorded since the last check (on `device`, default every device decode ran on),
    and reset the record. Does nothing when there is none.

    `exattn.decode(..., validate=True)` on the Triton backend checks lengths and page ids in its
    kernels without a device sync; its calls raise these errors themselves, a call or two later
    (see `exattn.errors`). Call this where an error must surface at a known point (after a step,
    at the end of a test), or after replaying CUDA graphs.
    """
    if device is None:
        devices = list(_RECORDS)
    else:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        devices = [device]
    for each in devices:
        if each in _RECORDS:
            read_and_raise(each, _RECORDS[each])


def read_and_raise(device: torch.device, state: DeviceRecord) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    values = state.record.tolist()
    state.record.zero_()
    state.rung.value = 0
    if values[FLAG]:
        raise ValueError(f"{describe(values)} (found on {device} by the decode kernels of a call with "
                         "validate=True, which clamped it to the cache; that sequence's output is not meaningful)")


def describe(values: list[int]) -> str:
    kind, b, value, bound = values[KIND], values[INDEX], values[VALUE], values[BOUND]
    if kind == LENGTH_BELOW_NQ:
        return length_below_queries(b, value, bound)
    if kind == LENGTH_BEYOND_CACHE:
        return length_beyond_cache(b, value, bound, values[PAGE_SIZE])
    if kind == LEFTPAD_OUT_OF_RANGE:
        return leftpad_out_of_range(b, value, bound)
    return page_out_of_range(b, values[SLOT], value, bound)


def length_below_queries(b: int, length: int, len_q: int) -> str:
    return (f"cache_seqlens[{b}] = {length} is below Nq = {len_q}: the new tokens are the last Nq keys "
            "of each sequence, so every length must be >= Nq")


def length_beyond_cache(b: int, length: int, capacity: int, page_size: int) -> str:
    """page_size: of a paged cache, 0 for a contiguous one."""
    holds = (f"the pages block_table names hold {capacity // page_size} x {page_size} = {capacity} keys"
             if page_size else f"k_cache holds {capacity} keys per sequence")
    return f"cache_seqlens[{b}] = {length} is beyond the cache: {holds}"


def page_out_of_range(b: int, slot: int, page: int, num_pages: int) -> str:
    return (f"block_table[{b}, {slot}] = {page} is not a page of k_cache "
            f"(expected 0 <= page < num_pages = {num_pages})")


def leftpad_out_of_range(b: int, leftpad: int, length: int) -> str:
    return (f"cache_leftpad[{b}] = {leftpad} is outside [0, cache_seqlens[{b}] = {length}]: a sequence's keys "
            "start at its left padding and end at its length")
