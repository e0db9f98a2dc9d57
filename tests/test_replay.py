"""Recording and replaying a pass's kernel launches (`exattn.backends.triton.replay`), with a stand-in
kernel on the CPU: replayed calls must give what the pass gives, on new tensors, and a pass that does
anything a replay would skip must keep running as it is. (On the GPU, tests/test_replay_gpu.py checks
the real passes bitwise against runs without replay.)"""

from __future__ import annotations

import gc
import inspect
import weakref
from collections import OrderedDict
from types import SimpleNamespace

import pytest
import torch

from exattn.backends.triton import replay


class Compiled:
    """A compiled kernel's stand-in: `run` adds X[offset:] + Y into OUT, and counts its calls."""

    function = packed_metadata = None
    metadata = SimpleNamespace(global_scratch_size=0)

    def __init__(self):
        self.runs = 0

    def launch_metadata(self, *args):
        return None

    def run(self, gx, gy, gz, stream, function, packed, metadata, enter, leave, *args):
        self.runs += 1
        add(*args)


def add(X, Y, OUT, n, SCALE=1.0):
    """The kernel's effect: OUT[:n] = (X[:n] + Y[:n]) * SCALE (all of X + Y for n < 0); X may be a descriptor."""
    X = X if isinstance(X, torch.Tensor) else X.base
    torch.add(X, Y, out=OUT) if n < 0 else OUT[:n].copy_((X[:n] + Y[:n]) * SCALE)


class Kernel:
    """A `@triton.jit` kernel's stand-in: `kernel[grid](...)` runs `add` and returns its compiled kernel."""

    arg_names = ["X", "Y", "OUT", "n", "SCALE"]
    params = [SimpleNamespace(default=inspect.Parameter.empty)] * 4 + [SimpleNamespace(default=1.0)]

    def __init__(self):
        self.compiled = Compiled()
        self.jit_calls = 0

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.jit_calls += 1
            add(*args, **{k: v for k, v in kwargs.items() if k in self.arg_names})
            return self.compiled

        return call


@pytest.fixture(autouse=True)
def fresh_plans():
    replay.clear()
    yield
    replay.clear()


def make_pass(kernel, body=None):
    @replay.replayable()
    def add_pass(x, y, scale=1.0):
        out = torch.empty_like(x)
        if body is not None:
            body(out)
        replay.run_kernel(kernel, (1,), x, y, out, x.numel(), SCALE=scale, num_warps=4)
        return out

    return add_pass


def inputs(n=10):
    return torch.randn(n), torch.randn(n)


def test_second_call_replays_on_new_tensors():
    kernel = Kernel()
    add_pass = make_pass(kernel)
    x, y = inputs()
    assert torch.equal(add_pass(x, y), x + y)
    x2, y2 = inputs()
    out = add_pass(x2, y2)
    assert torch.equal(out, x2 + y2)
    assert (kernel.jit_calls, kernel.compiled.runs) == (1, 1)
    assert len(replay.PLANS) == 1


def test_keyword_arguments_and_defaults_reach_the_replay():
    kernel = Kernel()
    add_pass = make_pass(kernel)
    x, y = inputs()
    add_pass(x, y, scale=2.0)
    x2, y2 = inputs()
    assert torch.equal(add_pass(x2, y2, scale=2.0), (x2 + y2) * 2.0)
    assert torch.equal(add_pass(x2, y2, scale=3.0), (x2 + y2) * 3.0)  # another value: another plan
    assert len(replay.PLANS) == 2


def test_a_new_shape_or_alignment_records_a_new_plan():
    kernel = Kernel()
    add_pass = make_pass(kernel)
    add_pass(*inputs(10))
    add_pass(*inputs(12))
    base_x, base_y = torch.randn(11), torch.randn(11)
    add_pass(base_x[1:], base_y[1:])  # 4-byte offset: not 16-byte aligned
    assert kernel.jit_calls == 3 and len(replay.PLANS) == 3


def test_in_place_ops_on_buffers_are_replayed_in_order():
    kernel = Kernel()

    @replay.replayable()
    def filled_then_added(x, y):
        out = torch.empty(x.numel() + 3)
        out[x.numel():].fill_(7.0)  # rows the kernel does not write
        replay.run_kernel(kernel, (1,), x, y, out, x.numel())
        out[: x.numel()].mul_(2.0)
        return out

    for _ in range(3):
        x, y = inputs()
        assert torch.equal(filled_then_added(x, y), torch.cat([(x + y) * 2.0, torch.full((3,), 7.0)]))
    assert kernel.jit_calls == 1 and kernel.compiled.runs == 2


def test_a_pass_that_makes_new_tensors_is_never_replayed():
    kernel = Kernel()

    @replay.replayable()
    def scaled(x, y):
        out = torch.empty_like(x)
        replay.run_kernel(kernel, (1,), x, y, out, x.numel())
        return out * 2.0

    for _ in range(3):
        x, y = inputs()
        assert torch.equal(scaled(x, y), (x + y) * 2.0)
    assert kernel.jit_calls == 3 and kernel.compiled.runs == 0
    assert "mul" in next(iter(replay.REFUSED.values()))


def test_a_pass_that_reads_a_value_is_never_replayed():
    kernel = Kernel()

    @replay.replayable()
    def data_dependent(x, y):
        n = int(x.abs().argmax())  # a length read from the data
        out = torch.zeros_like(x)
        replay.run_kernel(kernel, (1,), x, y, out, n)
        return out

    for _ in range(2):
        x, y = inputs()
        n = int(x.abs().argmax())
        expected = torch.zeros_like(x)
        expected[:n] = x[:n] + y[:n]
        assert torch.equal(data_dependent(x, y), expected)
    assert kernel.compiled.runs == 0 and len(replay.PLANS) == 0


def test_views_of_inputs_and_zeroed_buffers_are_rebuilt():
    kernel = Kernel()

    @replay.replayable()
    def shifted(x, y):
        out = torch.zeros(x.numel() + 2)
        replay.run_kernel(kernel, (1,), x[2:], y[:-2], out[1:], x.numel() - 2)
        return out

    for _ in range(2):
        x, y = inputs(12)
        expected = torch.zeros(14)
        expected[1:11] = x[2:] + y[:-2]
        assert torch.equal(shifted(x, y), expected)
    assert kernel.compiled.runs == 1


def test_descriptor_arguments_get_the_new_base():
    kernel = Kernel()

    class Descriptor:
        def __init__(self, base, block):
            self.base, self.block = base, block

    @replay.replayable()
    def through_descriptor(x, y):
        out = torch.empty_like(x)
        replay.run_kernel(kernel, (1,), Descriptor(x, 4), y, out, -1)
        return out

    for _ in range(2):
        x, y = inputs()
        assert torch.equal(through_descriptor(x, y), x + y)
    assert kernel.compiled.runs == 1


def test_plans_do_not_keep_the_recorded_tensors_alive():
    kernel = Kernel()
    add_pass = make_pass(kernel)
    x, y = inputs()
    out = add_pass(x, y)
    refs = [weakref.ref(t) for t in (x, y, out)]
    del x, y, out
    gc.collect()
    assert all(r() is None for r in refs)


def test_a_pass_called_inside_a_recording_is_part_of_it():
    kernel = Kernel()
    inner = make_pass(kernel)

    @replay.replayable()
    def outer(x, y):
        return inner(x, y)

    for _ in range(2):
        x, y = inputs()
        assert torch.equal(outer(x, y), x + y)
    assert kernel.compiled.runs == 1 and len(replay.PLANS) == 1


def test_a_view_that_cannot_be_traced_to_one_input_is_never_replayed():
    kernel = Kernel()

    @replay.replayable()
    def from_packed(xy):
        x, y = xy[0], xy[1]  # two views of one input
        out = torch.empty_like(x)
        replay.run_kernel(kernel, (1,), x, y, out, x.numel())
        return out

    for _ in range(2):
        xy = torch.randn(2, 10)
        assert torch.equal(from_packed(xy), xy[0] + xy[1])
    assert kernel.compiled.runs == 1  # xy[0] and xy[1] trace to the one input: replayed

    @replay.replayable()
    def in_two_inputs(x, y):
        out = torch.empty_like(x)
        replay.run_kernel(kernel, (1,), x[1:], y[1:], out[1:], x.numel() - 1)
        return out

    runs = kernel.compiled.runs
    for _ in range(2):
        xy = torch.randn(20)
        x, y = xy[:10], xy[10:]  # x[1:] shares its storage with both inputs
        assert torch.equal(in_two_inputs(x, y)[1:], x[1:] + y[1:])
    assert kernel.compiled.runs == runs and "view" in next(iter(replay.REFUSED.values()))


def test_a_buffer_read_as_another_dtype_is_replayed_at_its_offset():
    kernel = Kernel()

    @replay.replayable()
    def into_float64_bytes(x, y):
        out = torch.empty(x.numel() + 2, dtype=torch.float64)
        rows = out.view(torch.float32)[2:2 + x.numel()]  # float32 elements from byte 8 of a float64 buffer
        replay.run_kernel(kernel, (1,), x, y, rows, x.numel())
        return rows

    for _ in range(3):
        x, y = inputs()
        result = into_float64_bytes(x, y)
        assert result.dtype == torch.float32 and torch.equal(result, x + y)
    assert (kernel.jit_calls, kernel.compiled.runs) == (1, 2) and not replay.REFUSED


def test_stream_counters_are_kept_and_replayed_without_a_buffer_of_their_own(monkeypatch):
    kernel, read_from, adding = Kernel(), [], add

    def noting_add(X, Y, OUT, n, SCALE=1.0):
        read_from.append(X.data_ptr())
        adding(X, Y, OUT, n, SCALE)

    monkeypatch.setitem(globals(), "add", noting_add)
    monkeypatch.setattr(replay, "COUNTERS_KEPT", OrderedDict())

    @replay.replayable()
    def counted(x, y):
        out = torch.empty_like(y)
        replay.run_kernel(kernel, (1,), replay.stream_counters(y.numel(), y.device), y, out, -1)
        return out

    for _ in range(3):
        x, y = inputs()
        assert torch.equal(counted(x, y), y)
    (plan,) = replay.PLANS.values()
    assert [buffer.made for buffer in plan.buffers] == [replay.EMPTY, replay.COUNTERS]
    kept = replay.stream_counters(4, torch.device("cpu"))
    assert read_from == [kept.data_ptr()] * 3 and (kernel.jit_calls, kernel.compiled.runs) == (1, 2)
    more = replay.stream_counters(25, torch.device("cpu"))
    assert more.numel() == 25 and not more.any()


def test_indexing_that_copies_is_never_replayed():
    kernel = Kernel()

    @replay.replayable()
    def gathered(x, y, order):
        out = torch.empty_like(x)
        replay.run_kernel(kernel, (1,), x[order], y, out, x.numel())
        return out

    for _ in range(2):
        x, y = inputs()
        order = torch.randperm(10)
        assert torch.equal(gathered(x, y, order), x[order] + y)
    assert kernel.compiled.runs == 0


def test_launch_hooks_reach_replayed_launches_only_when_set(monkeypatch):
    from triton import knobs

    seen = []

    class Hooked(Compiled):
        def run(self, gx, gy, gz, stream, function, packed, metadata, enter, leave, *args):
            seen.append((enter, leave))
            super().run(gx, gy, gz, stream, function, packed, metadata, enter, leave, *args)

    kernel = Kernel()
    kernel.compiled = Hooked()
    add_pass = make_pass(kernel)
    add_pass(*inputs())
    add_pass(*inputs())  # replayed with Triton's default, empty hook chains
    hook = knobs.HookChain()
    hook.add(lambda *args: None)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", hook)
    add_pass(*inputs())
    assert seen[0] == (None, None) and seen[1][0] is hook


class TensorMap:
    """`make_tensordesc_arg`'s encoded descriptor, standing in for the CUDA tensor map of `base`."""

    def __init__(self, base):
        self.base = base


class Launcher:
    """Triton 3.6's CUDA launcher, standing in: `launch` is Triton's own descriptor wrapper around `raw`."""

    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid = launch_pdl = False

    def __init__(self, raw, signature, metas):
        from triton.backends.nvidia import driver

        self.launch = driver.wrap_handle_tensordesc(raw, signature, metas)

    def __call__(self, gx, gy, gz, stream, function, *args):
        self.launch(gx, gy, gz, stream, function, self.launch_cooperative_grid, self.launch_pdl, None, None, *args)


def tensor_at(address: int, n: int) -> torch.Tensor:
    """The n float32s at a host address, as a launcher dereferences a pointer argument given as an int."""
    import ctypes

    import numpy as np

    return torch.from_numpy(np.ctypeslib.as_array(ctypes.cast(address, ctypes.POINTER(ctypes.c_float)), (n,)))


def test_direct_launches_pass_the_launcher_what_triton_would_and_encode_a_base_once(monkeypatch):
    """A replay calls the launcher under Triton's descriptor wrapper itself, with the arguments the
    wrapper would have made (pointer arguments as their addresses), and encodes a descriptor again only
    for a base address it has not seen."""
    from triton.backends.nvidia import driver

    encoded = []

    def make_tensordesc_arg(descriptor, meta):
        encoded.append(descriptor.base.data_ptr())
        return [TensorMap(descriptor.base), *descriptor.shape, *descriptor.strides]

    monkeypatch.setattr(driver, "make_tensordesc_arg", make_tensordesc_arg)
    received = []

    def raw(*args):
        received.append(args)
        tensor_map, _, _, y, out, n, scale = args[len(replay.BASE_ARGS_FORMAT):]
        y, out = (tensor_at(p, n) if isinstance(p, int) else p for p in (y, out))
        out[:n].copy_((tensor_map.base[:n] + y[:n]) * scale)

    signature = {"X": "tensordesc<fp32[4]>", "Y": "*fp32", "OUT": "*fp32", "n": "i32", "SCALE": "constexpr"}
    kernel = Kernel()
    kernel.compiled.run = Launcher(raw, signature, [{"block_size": [4]}])

    class Descriptor:
        def __init__(self, base):
            self.base, self.shape, self.strides, self.padding = base, [base.numel()], [1], "zero"

    @replay.replayable()
    def through_descriptor(x, y):
        out = torch.empty(x.numel() + 1)[1:]  # a view of a buffer: its address is the buffer's + 4 bytes
        replay.run_kernel(kernel, (1,), Descriptor(x), y, out, x.numel(), SCALE=2.0)
        return out

    x, y = inputs()
    through_descriptor(x, y)  # recorded: the stand-in JIT ran the kernel, no launcher call
    (plan,) = replay.PLANS.values()
    assert [type(step) for step in plan.steps] == [replay.DirectLaunch]
    for x, y in (inputs(), inputs()):
        assert torch.equal(through_descriptor(x, y), (x + y) * 2.0)
    again = through_descriptor(x, y)
    assert torch.equal(again, (x + y) * 2.0)
    assert len(encoded) == len(set(encoded)), "a base address seen before is not encoded again"

    direct = received[-1]
    kernel.compiled.run(1, 1, 1, 0, None, None, None, None, None, Descriptor(x), y, again, x.numel(), 2.0)
    wrapped = received[-1]
    assert len(direct) == len(wrapped)
    for got, want in zip(direct, wrapped):
        if isinstance(want, TensorMap):
            assert got.base is x and want.base is x
        elif isinstance(want, torch.Tensor):
            assert got == want.data_ptr()  # a pointer argument goes as its address
        else:
            assert got == want


def test_a_kept_plan_is_the_recorded_one_and_current_until_a_clear_or_a_new_extra_key():
    kernel = Kernel()
    knob = {"value": 1}

    @replay.replayable(lambda: knob["value"], lambda x, y, scale=1.0: scale > 0)
    def add_pass(x, y, scale=1.0):
        out = torch.empty_like(x)
        replay.run_kernel(kernel, (1,), x, y, out, x.numel(), SCALE=scale)
        return out

    x, y = inputs()
    assert add_pass.plan_for(x, y) is None  # nothing recorded yet
    add_pass(x, y)
    kept = add_pass.plan_for(*inputs())
    assert kept.plan is next(iter(replay.PLANS.values())) and kept.current()
    assert add_pass.plan_for(x, y, scale=-1.0) is None  # a call the pass would not replay
    x2, y2 = inputs()
    assert torch.equal(kept.plan.run([x2, y2]), x2 + y2) and kernel.jit_calls == 1
    knob["value"] = 2
    assert not kept.current()
    knob["value"] = 1
    assert kept.current()
    replay.clear()
    assert not kept.current()
