"""`exattn.decode(validate=True)` on the Triton path: lengths and page ids checked in the kernels,
reported through `exattn.errors` without a device sync (interpreter on CPU, compiled on CUDA).

A bad length or page id is clamped (nothing outside the caches is read) and recorded; the
ValueError names the sequence, the value and the bound, at `exattn.check_errors()` or at the
next validated call.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton loads

import exattn
from exattn import errors
from exattn.backends.triton import decode_kernel
from test_decode import DEVICE, assert_matches_attention, make_case, paged
from test_triton_compile import RecordedLaunch


@pytest.fixture(autouse=True)
def clear_records():
    def clear():
        for state in errors._RECORDS.values():
            state.record.zero_()
            state.rung.value = 0

    clear()
    yield
    clear()


def finish():
    """Wait for the device (a no-op in the interpreter), as time would before a later call."""
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def contiguous_case(lengths):
    """Nq = 3 over a 32-key contiguous cache; `lengths` may be invalid (the cache is made with valid ones)."""
    q, k, v, _ = make_case(3, 4, 2, 3, 32, 8, torch.float32, seed=1, lengths=[32, 20, 7])
    return q, k, v, torch.tensor(lengths, dtype=torch.int32, device=DEVICE)


def paged_case():
    """Nq = 2 over 8-key pages; spare table slots hold -7 (never checked: no key uses them)."""
    q, k, v, lens = make_case(3, 4, 2, 2, 40, 8, torch.float32, seed=2, lengths=[40, 17, 2])
    k_pages, v_pages, table = paged(k, v, lens, 8)
    return q, k, v, lens, k_pages, v_pages, table


def decode(q, k, v, lens, table=None, **kwargs):
    return exattn.decode(q, k, v, cache_seqlens=lens, block_table=table, backend="triton", return_lse=True, **kwargs)


@pytest.mark.parametrize("lengths, pattern", [
    ([32, 40, 7], r"cache_seqlens\[1\] = 40 is beyond the cache: k_cache holds 32 keys per sequence"),
    ([32, 20, 2], r"cache_seqlens\[2\] = 2 is below Nq = 3: the new tokens are the last Nq keys"),
    ([-5, 20, 7], r"cache_seqlens\[0\] = -5 is below Nq = 3"),
], ids=("beyond", "below-nq", "negative"))
@pytest.mark.parametrize("num_splits", (1, 3))
def test_a_bad_length_is_raised_by_check_errors(lengths, pattern, num_splits):
    q, k, v, lens = contiguous_case(lengths)
    out, lse = decode(q, k, v, lens, num_splits=num_splits)
    good = [b for b, n in enumerate(lengths) if 3 <= n <= 32]
    assert_matches_attention("valid sequences", out[good], lse[good], q[good], k[good], v[good], lens[good])
    with pytest.raises(ValueError, match=pattern):
        exattn.check_errors()
    exattn.check_errors()  # read and reset: nothing left


@pytest.mark.parametrize("slot_and_value", [((1, 0), "past"), ((0, 3), -3), ((0, 0), "past")],
                         ids=("past-the-pool", "negative", "first-slot"))
@pytest.mark.parametrize("num_splits", (1, 4))
def test_a_bad_page_id_is_raised_by_check_errors(slot_and_value, num_splits):
    (b, slot), value = slot_and_value
    q, k, v, lens, k_pages, v_pages, table = paged_case()
    value = k_pages.shape[0] + 5 if value == "past" else value
    table[b, slot] = value
    out, lse = decode(q, k_pages, v_pages, lens, table, num_splits=num_splits)
    good = [2]
    assert_matches_attention("valid sequence", out[good], lse[good], q[good], k[good], v[good], lens[good])
    pattern = (rf"block_table\[{b}, {slot}\] = {value} is not a page of k_cache "
               rf"\(expected 0 <= page < num_pages = {k_pages.shape[0]}\)")
    with pytest.raises(ValueError, match=pattern):
        exattn.check_errors()


@pytest.mark.parametrize("num_splits", (1, 4))
def test_a_bad_page_in_a_later_split_is_found(num_splits):
    """300 keys of 8-key pages in splits of 128 keys: slot 36 (keys 288-295) lies in the third split."""
    q, k, v, lens = make_case(2, 4, 2, 1, 300, 8, torch.float32, seed=3, lengths=[300, 9])
    k_pages, v_pages, table = paged(k, v, lens, 8)
    table[0, 36] = 10**6
    decode(q, k_pages, v_pages, lens, table, num_splits=num_splits)
    with pytest.raises(ValueError, match=r"block_table\[0, 36\] = 1000000 is not a page"):
        exattn.check_errors()


def test_a_length_beyond_the_pages_names_them():
    q, _, _, lens, k_pages, v_pages, table = paged_case()
    decode(q, k_pages, v_pages, lens, table[:, :3].contiguous())  # 3 pages of 8 keys: sequence 0 has 40
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\] = 40 is beyond the cache: the pages block_table "
                                         r"names hold 3 x 8 = 24 keys"):
        exattn.check_errors(DEVICE)


def test_a_bad_page_outside_the_window_is_found_too():
    """The window leaves slot 0 of sequence 0 unread, but every used page is checked."""
    q, _, _, lens, k_pages, v_pages, table = paged_case()
    table[0, 0] = -1
    decode(q, k_pages, v_pages, lens, table, window=(4, 0), num_splits=2)
    with pytest.raises(ValueError, match=r"block_table\[0, 0\] = -1"):
        exattn.check_errors()


def test_of_several_bad_sequences_one_is_named():
    q, k, v, lens = contiguous_case([99, 1, 50])
    decode(q, k, v, lens, num_splits=2)
    with pytest.raises(ValueError, match=r"cache_seqlens\[(0\] = 99|1\] = 1|2\] = 50) is"):
        exattn.check_errors()


def test_the_next_validated_call_raises_what_an_earlier_one_recorded():
    q, k, v, lens = contiguous_case([32, 20, 7])
    bad = torch.tensor([32, 33, 7], dtype=torch.int32, device=DEVICE)
    decode(q, k, v, bad)
    finish()
    assert errors._RECORDS[q.device].rung.value == 1, "the doorbell in host memory is set"
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 33 is beyond the cache: .*found on .* by the "
                                         r"decode kernels of a call with validate=True"):
        decode(q, k, v, lens)
    out, lse = decode(q, k, v, lens)  # raised once, then reset
    assert_matches_attention("after the error", out, lse, q, k, v, lens)
    decode(q, k, v, bad, validate=False)
    finish()
    decode(q, k, v, lens)  # an unvalidated call records nothing


@pytest.mark.parametrize("num_splits", (1, 3, 64))
def test_valid_inputs_never_raise(num_splits):
    """Lengths exactly Nq and exactly the capacity; pages with spare slots of -7 past every length."""
    q, k, v, lens = contiguous_case([32, 3, 31])
    decode(q, k, v, lens, num_splits=num_splits)
    decode(q, k, v, lens, num_splits=num_splits, window=(0, 0), sinks=torch.zeros(4, device=DEVICE))
    q, k, v, lens, k_pages, v_pages, table = paged_case()
    wide = torch.cat([table, torch.full_like(table[:, :2], -7)], dim=1).contiguous()
    for window in (None, (3, 0)):
        decode(q, k_pages, v_pages, lens, wide, num_splits=num_splits, window=window)
    finish()
    for state in errors._RECORDS.values():
        assert state.rung.value == 0
    exattn.check_errors()


def test_unvalidated_inputs_are_clamped_and_not_recorded():
    """validate=False: a length past the cache reads as the capacity, a page id past the pool as
    its last page, a negative one as page 0; nothing is recorded."""
    q, k, v, lens = contiguous_case([32, 20, 7])
    out = decode(q, k, v, torch.tensor([40, 20, 7], dtype=torch.int32, device=DEVICE), validate=False)[0]
    assert torch.equal(out, decode(q, k, v, lens, validate=False)[0])
    q, k, v, lens, k_pages, v_pages, table = paged_case()
    last = k_pages.shape[0] - 1
    for bad_value, clamped_to in ((last + 9, last), (-4, 0)):
        bad, moved = table.clone(), table.clone()
        bad[1, 0], moved[1, 0] = bad_value, clamped_to
        out = decode(q, k_pages, v_pages, lens, bad, validate=False, num_splits=2)[0]
        same = decode(q, k_pages, v_pages, lens, moved, validate=False, num_splits=2)[0]
        torch.testing.assert_close(out, same, rtol=0, atol=0, equal_nan=True)  # a spare page holds NaN
    exattn.check_errors()


SYNCING_METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "nonzero")


def count_host_reads(monkeypatch) -> list:
    """Every call of a Tensor method that reads device values on the host, recorded by name."""
    reads = []
    for name in SYNCING_METHODS:
        real = getattr(torch.Tensor, name)

        def counted(self, *args, _real=real, _name=name, **kwargs):
            reads.append(_name)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return reads


@pytest.mark.parametrize("layout", ("contiguous", "paged"))
def test_the_validated_triton_path_reads_no_device_value_on_the_host(layout, monkeypatch):
    """With the kernel launches stubbed out, a validated call makes no host read of a tensor's
    values (each would be a device sync on CUDA); the tiled path, which checks on the host, does,
    so the count can see them."""
    q, k, v, lens, k_pages, v_pages, table = paged_case()
    caches = (k, v, None) if layout == "contiguous" else (k_pages, v_pages, table)
    decode(q, *caches[:2], lens, caches[2], num_splits=3)  # the record and the plan exist
    for name in ("decode_split_kernel", "decode_combine_kernel"):
        monkeypatch.setattr(decode_kernel, name, RecordedLaunch())
    reads = count_host_reads(monkeypatch)
    for num_splits in (1, 3):
        decode(q, *caches[:2], lens, caches[2], num_splits=num_splits, window=(5, 0),
               sinks=torch.zeros(4, device=DEVICE))
        decode(q, *caches[:2], lens, caches[2], num_splits=num_splits)
    assert reads == []
    exattn.decode(q, *caches[:2], cache_seqlens=lens, block_table=caches[2], backend="tiled")
    assert reads, "the tiled path reads lengths on the host, and the count did not see it"


def test_raise_recorded_reads_only_the_doorbell_until_it_is_set(monkeypatch):
    device = torch.device(DEVICE) if DEVICE == "cpu" else torch.device("cuda", torch.cuda.current_device())
    state = errors.device_record(device)
    read = []
    monkeypatch.setattr(errors, "read_and_raise", lambda *args: read.append(args))
    errors.raise_recorded(device)
    assert read == []
    state.rung.value = 1
    errors.raise_recorded(device)
    assert len(read) == 1 and read[0][1] is state


def test_check_errors_takes_a_device_and_is_quiet_without_records():
    exattn.check_errors()
    exattn.check_errors(DEVICE)
    exattn.check_errors(torch.device(DEVICE))


def test_the_record_is_made_on_a_thread_of_its_own(monkeypatch):
    """A thread that warms up a CUDA graph allocates into the graph's pool; the record must not land there."""
    import threading

    made_on = []
    real = errors.allocate_record
    monkeypatch.setattr(errors, "allocate_record", lambda device: made_on.append(threading.get_ident()) or real(device))
    device = torch.device("cpu")
    kept = errors._RECORDS.pop(device, None)
    try:
        state = errors.device_record(device)
        assert made_on and made_on[0] != threading.get_ident()
        assert state.record.shape == (errors.RECORD_SIZE,) and not state.record.any()
    finally:
        errors._RECORDS.pop(device, None)
        if kept is not None:
            errors._RECORDS[device] = kept
