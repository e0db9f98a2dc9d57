"""Replaying a pass's kernel launches: the host path of a call whose signature was seen before.

The first call of a pass with a new signature (every tensor's shape, strides, dtype, device
and 16-byte alignment; every other argument's value; the backend's settings) runs normally
while a `Recorder` notes each kernel launch (the compiled kernel, its grid, its arguments)
and each buffer the pass allocates. Each tensor argument becomes a `Ref`: an input of the
pass, a buffer, or a view of one of those; a tensor that is neither is a constant the plan
keeps. Later calls with that signature allocate the buffers and launch the compiled kernels
directly (`Plan.run`), skipping exattn's checks and planning and Triton's JIT front end.

The recorder sees every torch call of the pass (a `TorchFunctionMode`). In-place fills, copies,
adds and scales of inputs and buffers (`IN_PLACE`) are replayed in their place among the
launches. A pass that does anything else but read metadata, take views and allocate (arithmetic
that makes a new tensor, reading a value, an in-place op on any other tensor) is not replayed:
it keeps running normally, every call.
"""

from __future__ import annotations

import copy
import functools
import inspect
import threading
from collections import OrderedDict
from typing import Any, Callable, NamedTuple

import torch
from torch.overrides import TorchFunctionMode

from ...checked_calls import tensor_layout
from ...errors import on_own_thread

MAX_PLANS = 256

Tensor = torch.Tensor
ALLOCATE = {torch.empty, torch.empty_like, torch.empty_strided, Tensor.new_empty}
ALLOCATE_ZEROED = {torch.zeros, torch.zeros_like, Tensor.new_zeros}
METADATA = {
    Tensor.stride, Tensor.size, Tensor.dim, Tensor.numel, Tensor.data_ptr, Tensor.element_size,
    Tensor.is_contiguous, Tensor.storage_offset, Tensor.__len__, Tensor.__hash__,
    *(getattr(Tensor, name).__get__ for name in ("shape", "dtype", "device", "is_cuda", "ndim", "requires_grad",
                                                   "layout", "is_sparse", "is_nested", "grad_fn")),
}
VIEWS = {Tensor.view, Tensor.permute, Tensor.transpose, Tensor.unsqueeze, Tensor.squeeze, Tensor.expand,
         Tensor.__getitem__, Tensor.as_strided, Tensor.select, Tensor.narrow, Tensor.unflatten, Tensor.detach}
IN_PLACE = {Tensor.copy_, Tensor.zero_, Tensor.fill_, Tensor.add_, Tensor.mul_}  # on inputs and buffers: replayed
UNLESS_COPYING = {Tensor.to, Tensor.contiguous}  # allowed where they return their tensor itself
# (VIEWS too are allowed only where the result shares its tensor's storage)


class Ref(NamedTuple):
    """A tensor argument rebuilt per call: slot `index` of (inputs, then buffers), through
    `view` = (offset from that tensor's first element, in elements of `dtype`, shape, strides, dtype),
    or as it is (None). The view's dtype may differ from its tensor's: a buffer's bytes read as
    another type."""

    index: int
    view: tuple | None = None


class DescriptorRef(NamedTuple):
    """A TMA descriptor argument: `template` (its base dropped) over the tensor `ref`."""

    ref: Ref
    template: Any


EMPTY, ZEROED, COUNTERS = "empty", "zeroed", "counters"  # how a plan's buffer is made per call


class Buffer(NamedTuple):
    """A buffer the pass made: `made` EMPTY (uninitialized), ZEROED or COUNTERS (`stream_counters`)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    made: str


class Launch(NamedTuple):
    compiled: Any
    grid: tuple[int, int, int]
    args: tuple  # every kernel parameter in order, tensors replaced by None
    slots: tuple[tuple[int, Ref | DescriptorRef], ...]


class DescriptorFill(NamedTuple):
    """A TMA descriptor argument of a direct launch: the launcher's arguments at [start, start + width)
    come from Triton's `make_tensordesc_arg` of the descriptor over `ref`, kept per base address in
    `made` (they depend on nothing else within one plan)."""

    start: int
    width: int
    ref: DescriptorRef
    meta: Any
    made: dict


class DirectLaunch(NamedTuple):
    """A `Launch` through the launcher under Triton's descriptor wrapper (`direct_launch`): the
    wrapper's per-call loop over every argument, the views of pointer arguments (their addresses go
    instead), and the re-encoding of a descriptor whose base is where it was in an earlier call, are
    skipped. `launch` is the recorded launch (for hooks)."""

    launch: Launch
    raw: Callable
    head: tuple  # (cooperative grid, PDL)
    args: tuple  # the launcher's kernel arguments: inputs, buffers and descriptors None, kept tensors addresses
    tensors: tuple[tuple[int, Ref], ...]
    descriptors: tuple[DescriptorFill, ...]

    def run(self, tensors: list[Tensor], stream: int) -> None:
        args = list(self.args)
        for position, ref in self.tensors:
            args[position] = address(ref, tensors)
        for fill in self.descriptors:
            args[fill.start:fill.start + fill.width] = descriptor_words(fill, tensors)
        launch, compiled = self.launch, self.launch.compiled
        self.raw(*launch.grid, stream, compiled.function, *self.head, None, None, compiled.packed_metadata, None,
                 None, None, *args)


MAX_DESCRIPTORS_KEPT = 64  # per descriptor argument of a plan: the base addresses a loop cycles through


def descriptor_words(fill: DescriptorFill, tensors: list[Tensor]) -> list:
    base = address(fill.ref.ref, tensors)
    words = fill.made.get(base)
    if words is None:
        descriptor = copy.copy(fill.ref.template)
        descriptor.base = resolve(fill.ref.ref, tensors)
        words = make_tensordesc_arg(descriptor, fill.meta)
        if len(fill.made) >= MAX_DESCRIPTORS_KEPT:
            fill.made.clear()
        fill.made[base] = words
    return words


def address(ref: Ref, tensors: list[Tensor]) -> int:
    """The device address of the tensor `ref` names, without building its view: all a launcher reads of
    a pointer argument (an int skips the launcher's own `data_ptr` call and pointer query)."""
    x = tensors[ref.index]
    return x.data_ptr() if ref.view is None else x.data_ptr() + ref.view[0] * ref.view[3].itemsize


def make_tensordesc_arg(descriptor, meta) -> list:
    from triton.backends.nvidia.driver import make_tensordesc_arg as make

    return make(descriptor, meta)


BASE_ARGS_FORMAT = "iiiKKppOOOOOO"  # Triton 3.6's launcher: grid, stream, function, flags, scratch, metadata, hooks


def direct_launch(launch: Launch) -> DirectLaunch | Launch:
    """`launch` as a `DirectLaunch` where its compiled kernel has Triton 3.6's CUDA launcher with no
    scratch memory and every TMA descriptor is encoded on the host; else `launch` itself."""
    launcher = launch.compiled.run
    unwrapped = unwrapped_launcher(getattr(launcher, "launch", None))
    if unwrapped is None or getattr(launcher, "global_scratch_size", 1) or getattr(launcher, "profile_scratch_size", 1):
        return launch
    raw, descriptor_positions, metas = unwrapped
    if any(meta is None for meta in metas):
        return launch
    slots = dict(launch.slots)
    args, tensors, descriptors = [], [], []
    for position, arg in enumerate(launch.args):
        if position in descriptor_positions:
            meta = metas[len(descriptors)]
            ref = slots.get(position)
            if not isinstance(ref, DescriptorRef):
                return launch  # a descriptor the plan keeps as it is: not worth a path of its own
            width = 1 + 2 * len(ref.template.shape)
            descriptors.append(DescriptorFill(len(args), width, ref, meta, {}))
            args += [None] * width
            continue
        if position in slots:
            tensors.append((len(args), slots[position]))
        args.append(kept_address(arg))
    head = (launcher.launch_cooperative_grid, launcher.launch_pdl)
    return DirectLaunch(launch, raw, head, tuple(args), tuple(tensors), tuple(descriptors))


def kept_address(arg):
    """A tensor the plan keeps (neither input nor buffer: the decode kernels' error record and doorbell) as
    its address, which the launcher would query again every call; anything else as it is. Device memory
    and pinned host memory (a mapped address under CUDA's unified addressing) are the kernels' own."""
    if isinstance(arg, Tensor) and (arg.is_cuda or arg.is_pinned()):
        return arg.data_ptr()
    return arg


def unwrapped_launcher(launch) -> tuple[Callable, frozenset, list] | None:
    """(raw launcher, positions of descriptor arguments, their metadata) of a launcher's `launch`: itself
    with no descriptors, or what Triton 3.6's `wrap_handle_tensordesc` closed over; None for anything else."""
    from triton.backends.nvidia import driver

    if launch is None or getattr(driver, "_BASE_ARGS_FORMAT", None) != BASE_ARGS_FORMAT:
        return None
    if getattr(launch, "__qualname__", "") != "wrap_handle_tensordesc.<locals>.inner":
        return launch, frozenset(), []
    cells = dict(zip(launch.__code__.co_freevars, (cell.cell_contents for cell in launch.__closure__)))
    if not {"launcher", "tensordesc_indices", "tensordesc_meta"} <= set(cells):
        return None
    positions = frozenset(cells["tensordesc_indices"])
    metas = list(cells["tensordesc_meta"] or [None] * len(positions))
    return cells["launcher"], positions, metas


class InPlace(NamedTuple):
    """An in-place tensor op of the pass (`IN_PLACE`), replayed in its place among the launches."""

    func: Callable
    args: tuple  # tensors as Refs
    kwargs: dict

    def run(self, tensors: list[Tensor]) -> None:
        self.func(*(resolve(a, tensors) if isinstance(a, Ref) else a for a in self.args), **self.kwargs)


class Plan(NamedTuple):
    buffers: tuple[Buffer, ...]
    steps: tuple[Launch | InPlace, ...]
    result: Any  # the pass's result with its tensors as Refs
    device: torch.device
    needs_allocator: bool

    def run(self, inputs: list[Tensor]):
        tensors = inputs + [allocate(b) for b in self.buffers]
        if self.needs_allocator:
            ensure_allocator()
        with on_device(self.device):
            stream = current_stream(self.device)
            hooked = launch_hooks() is not None
            for step in self.steps:
                if type(step) is DirectLaunch and not hooked:
                    step.run(tensors, stream)
                elif type(step) is DirectLaunch:
                    replay_launch(step.launch, tensors, stream)
                elif type(step) is Launch:
                    replay_launch(step, tensors, stream)
                else:
                    step.run(tensors)
        return rebuild(self.result, tensors)


def launch_hooks():
    """Triton's launch enter and exit hooks, or None when neither is active."""
    runtime = triton_knobs().runtime
    enter, leave = active(runtime.launch_enter_hook), active(runtime.launch_exit_hook)
    return None if enter is None and leave is None else (enter, leave)


def active(hook):
    """A launch hook, or None for none or an empty `HookChain` (Triton installs an empty chain: calling
    it and building its metadata would cost every launch)."""
    calls = getattr(hook, "calls", None)
    return None if hook is None or (isinstance(calls, list) and not calls) else hook


@functools.cache
def triton_knobs():
    from triton import knobs

    return knobs


def ensure_allocator() -> None:
    from .passes import ensure_allocator as ensure

    ensure()


def allocate(buffer: Buffer) -> Tensor:
    if buffer.made == COUNTERS:
        return kept_counters(buffer.shape[0], buffer.device)
    x = torch.empty_strided(buffer.shape, buffer.stride, dtype=buffer.dtype, device=buffer.device)
    return x.zero_() if buffer.made == ZEROED else x


COUNTERS_KEPT: OrderedDict = OrderedDict()  # (device, stream) -> int32 zeros
MAX_COUNTER_STREAMS = 64


def stream_counters(count: int, device: torch.device) -> Tensor:
    """`count` int32 zeros for one launch of kernels that leave them zero when they finish (the decode
    kernels' arrival counts). Outside CUDA-graph capture they are kept per (device, stream), so a call
    neither allocates nor zeroes them (launches on one stream run one after another); a capture gets
    zeros of its own, which its graph owns. A pass being recorded replays them the same way."""
    recorder = getattr(LOCAL, "recorder", None)
    if recorder is None:
        return kept_counters(count, device)
    recorder.paused = True
    try:
        counters = kept_counters(count, device)
    finally:
        recorder.paused = False
    recorder.tensors.append(counters)
    recorder.buffers.append(Buffer((count,), (1,), torch.int32, device, COUNTERS))
    return counters


def kept_counters(count: int, device: torch.device) -> Tensor:
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.zeros(count, dtype=torch.int32, device=device)
    stream = current_stream(device)
    kept = COUNTERS_KEPT.get((device, stream))
    if kept is None or kept.numel() < count:
        size = max(count, 2 * kept.numel()) if kept is not None else count
        kept = COUNTERS_KEPT[device, stream] = new_counters(size, device)
        if len(COUNTERS_KEPT) > MAX_COUNTER_STREAMS:  # freed in the order of their own streams' work
            COUNTERS_KEPT.popitem(last=False)
    return kept[:count]


def new_counters(size: int, device: torch.device) -> Tensor:
    """int32 zeros for the current stream, made on a thread of their own (`errors.on_own_thread`: not in
    the memory pool of a CUDA graph that this thread may be warming up), allocated and zeroed on it."""
    if device.type != "cuda":
        return torch.zeros(size, dtype=torch.int32, device=device)
    stream = torch.cuda.current_stream(device)

    def make():
        with torch.cuda.stream(stream):
            return torch.zeros(size, dtype=torch.int32, device=device)

    return on_own_thread(make)


def on_device(device: torch.device):
    """Make `device` current for the launches (a CUDA device other than the current one)."""
    if device.type != "cuda" or torch.cuda.current_device() == device.index:
        return NO_CONTEXT
    return torch.cuda.device(device.index)


def current_stream(device: torch.device) -> int:
    return torch._C._cuda_getCurrentRawStream(device.index) if device.type == "cuda" else 0


class NoContext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


NO_CONTEXT = NoContext()


def resolve(ref: Ref | DescriptorRef, tensors: list[Tensor]):
    if isinstance(ref, DescriptorRef):
        descriptor = copy.copy(ref.template)
        descriptor.base = resolve(ref.ref, tensors)
        return descriptor
    x = tensors[ref.index]
    if ref.view is None:
        return x
    offset, shape, strides, dtype = ref.view
    if dtype == x.dtype:
        return x.as_strided(shape, strides, x.storage_offset() + offset)
    first = x.storage_offset() * x.element_size() // dtype.itemsize
    return torch.empty(0, dtype=dtype, device=x.device).set_(x.untyped_storage(), first + offset, shape, strides)


def rebuild(result, tensors: list[Tensor]):
    if isinstance(result, Ref):
        return resolve(result, tensors)
    return tuple(rebuild(x, tensors) for x in result)


def replay_launch(launch: Launch, tensors: list[Tensor], stream: int) -> None:
    args = list(launch.args)
    for position, ref in launch.slots:
        args[position] = tensors[ref.index] if type(ref) is Ref and ref.view is None else resolve(ref, tensors)
    compiled = launch.compiled
    runtime = triton_knobs().runtime
    enter, leave = active(runtime.launch_enter_hook), active(runtime.launch_exit_hook)
    metadata = compiled.launch_metadata(launch.grid, stream, *args) if enter is not None else None
    compiled.run(*launch.grid, stream, compiled.function, compiled.packed_metadata, metadata, enter, leave, *args)


# ---------------------------------------------------------------- recording

def leaves_no_trace(func, args: tuple, result) -> bool:
    """Whether a replay may skip this call: a metadata read, or a view or no-op conversion of a tensor."""
    if func in METADATA:
        return True
    if func in UNLESS_COPYING:
        return result is args[0]
    return func in VIEWS and same_storage(result, args[0])


def same_storage(a, b) -> bool:
    """Whether a view op's result `a` is a view of `b` (indexing by a tensor copies instead)."""
    return isinstance(a, Tensor) and isinstance(b, Tensor) and (
        a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())


class NotReplayable(Exception):
    """Raised inside recording when a pass's launches cannot be replayed; the pass still ran."""


class Recorder(TorchFunctionMode):
    """Watches one run of a pass: its buffers, its launches, and whether anything else happened."""

    def __init__(self, inputs: list[Tensor]):
        super().__init__()
        self.tensors: list[Tensor] = list(inputs)
        self.buffers: list[Buffer] = []
        self.steps: list[Launch | InPlace] = []
        self.refused: str | None = None
        self.paused = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if self.paused:
            return result
        if func in ALLOCATE or func in ALLOCATE_ZEROED:
            self.tensors.append(result)
            self.buffers.append(Buffer(tuple(result.shape), result.stride(), result.dtype, result.device,
                                       ZEROED if func in ALLOCATE_ZEROED else EMPTY))
        elif func in IN_PLACE:
            self.note_in_place(func, args, kwargs or {})
        elif not leaves_no_trace(func, args, result) and self.refused is None:
            self.refused = getattr(func, "__name__", repr(func))  # a new tensor, a value read: not replayable
        return result

    def note_in_place(self, func, args: tuple, kwargs: dict) -> None:
        try:
            refs = tuple(self.ref(a) if isinstance(a, Tensor) else a for a in args)
        except NotReplayable as why:
            self.refused = self.refused or str(why)
            return
        if any(r is None for r in refs) or any(isinstance(v, Tensor) for v in kwargs.values()):
            self.refused = self.refused or f"{func.__name__} on a tensor the pass neither took nor made"
            return
        self.steps.append(InPlace(func, refs, kwargs))

    def ref(self, x: Tensor) -> Ref | None:
        """x as an input, a buffer or a view of one; None for a tensor the pass neither took nor made
        (a constant the plan keeps)."""
        for index, known in enumerate(self.tensors):
            if x is known:
                return Ref(index)
        storage = x.untyped_storage().data_ptr()
        sharing = [i for i, t in enumerate(self.tensors) if t.untyped_storage().data_ptr() == storage]
        if not sharing:
            return None
        base = self.tensors[sharing[0]]
        offset, rest = divmod(x.data_ptr() - base.data_ptr(), x.element_size())
        if len(sharing) > 1 or rest or (base.storage_offset() * base.element_size()) % x.element_size():
            raise NotReplayable("an argument is a view that cannot be traced to one input or buffer")
        return Ref(sharing[0], (offset, tuple(x.shape), x.stride(), x.dtype))

    def record(self, kernel, grid, compiled, args: tuple, kwargs: dict) -> None:
        names, defaults = parameters(kernel)
        full = list(args) + [kwargs.get(name, defaults[i]) for i, name in enumerate(names) if i >= len(args)]
        slots = []
        for position, arg in enumerate(full):
            if isinstance(arg, Tensor):
                ref = self.ref(arg)
            elif isinstance(getattr(arg, "base", None), Tensor):  # a TMA descriptor
                ref = self.descriptor_ref(arg)
            else:
                ref = None
            if ref is not None:
                slots.append((position, ref))
                full[position] = None
        grid = tuple(grid) + (1,) * (3 - len(grid))
        self.steps.append(Launch(compiled, grid, tuple(full), tuple(slots)))

    def descriptor_ref(self, descriptor) -> DescriptorRef | None:
        ref = self.ref(descriptor.base)
        if ref is None:
            return None
        template = copy.copy(descriptor)
        template.base = None
        return DescriptorRef(ref, template)

    def plan(self, result, device: torch.device) -> Plan:
        if self.refused is not None:
            raise NotReplayable(f"the pass ran {self.refused}")
        launches = [step for step in self.steps if type(step) is Launch]
        if not launches:
            raise NotReplayable("the pass launched no kernel")
        refs = self.result_refs(result)
        needs_allocator = any(getattr(launch.compiled.metadata, "global_scratch_size", 0) for launch in launches)
        steps = tuple(direct_launch(step) if type(step) is Launch else step for step in self.steps)
        return Plan(tuple(self.buffers), steps, refs, device, needs_allocator)

    def result_refs(self, result):
        if isinstance(result, Tensor):
            ref = self.ref(result)
            if ref is None:
                raise NotReplayable("the pass returned a tensor it neither took nor allocated")
            return ref
        if isinstance(result, (tuple, list)):
            return tuple(self.result_refs(x) for x in result)
        raise NotReplayable(f"the pass returned {type(result).__name__}")


@functools.cache
def parameters(kernel) -> tuple[tuple[str, ...], tuple]:
    """The kernel's parameter names and defaults (None where it has none)."""
    names = tuple(kernel.arg_names)
    defaults = tuple(None if p.default is inspect.Parameter.empty else p.default for p in kernel.params)
    return names, defaults


LOCAL = threading.local()


def run_kernel(kernel, grid, *args, **kwargs):
    """`kernel[grid](*args, **kwargs)`, noted by the recorder of the pass being recorded, if any."""
    recorder = getattr(LOCAL, "recorder", None)
    if recorder is None:
        return kernel[grid](*args, **kwargs)
    recorder.paused = True  # the launch's and the recording's own torch calls are not the pass's
    try:
        compiled = kernel[grid](*args, **kwargs)
        if compiled is None or not hasattr(compiled, "run"):
            recorder.refused = recorder.refused or "a launch that returned no compiled kernel"
        else:
            recorder.record(kernel, grid, compiled, args, kwargs)
    except NotReplayable as why:
        recorder.refused = recorder.refused or str(why)
    finally:
        recorder.paused = False
    return compiled


# ---------------------------------------------------------------- the plan cache

PLANS: OrderedDict = OrderedDict()
REFUSED: OrderedDict = OrderedDict()  # signatures whose pass cannot be replayed, and why


GENERATION = 0  # counts `clear` calls: a plan kept outside PLANS (`KeptPlan`) is current only within one


def clear() -> None:
    """Forget every plan (after changing module-level knobs that the signature does not cover), those kept
    by callers (`KeptPlan`) too."""
    global GENERATION
    PLANS.clear()
    REFUSED.clear()
    GENERATION += 1


class KeptPlan(NamedTuple):
    """A plan held by a caller that keys it on a signature of its own covering the pass's (`exattn.checked_calls`):
    it runs while `current()`, that is while no `clear` and no change of the pass's extra key came between."""

    plan: Plan
    stamp: tuple
    stamp_now: Callable[[], tuple]

    def current(self) -> bool:
        return self.stamp == self.stamp_now()


def signature_of(value, inputs: list[Tensor]):
    """What a plan is keyed on: a tensor's layout and alignment; anything else's value. The tensors
    among `value` (tensors, tuples, lists, named tuples) are appended to `inputs`, in order."""
    if isinstance(value, Tensor):
        inputs.append(value)
        return tensor_layout(value)
    if isinstance(value, (tuple, list)):
        return type(value), tuple([signature_of(item, inputs) for item in value])
    return value


def replayable(extra_key: Callable[[], Any] | None = None, enabled: Callable[..., bool] | None = None):
    """Decorate a pass: calls whose signature (plus `extra_key()`, e.g. the backend's settings) was
    recorded replay its plan; `enabled(*args, **kwargs)` False runs the pass as it is, as does a call
    made while another pass is being recorded (its launches belong to that recording)."""

    def decorate(run_pass):
        def key_of(args: tuple, kwargs: dict, inputs: list[Tensor]) -> tuple:
            return (run_pass, signature_of(args, inputs), signature_of(tuple(sorted(kwargs.items())), inputs),
                    extra_key() if extra_key else None)

        def stamp() -> tuple:
            return GENERATION, extra_key() if extra_key else None

        def plan_for(*args, **kwargs) -> KeptPlan | None:
            """The plan these arguments replay, to keep (`KeptPlan`); None if there is none."""
            if enabled is not None and not enabled(*args, **kwargs):
                return None
            plan = PLANS.get(key_of(args, kwargs, []))
            return None if plan is None else KeptPlan(plan, stamp(), stamp)

        @functools.wraps(run_pass)
        def wrapper(*args, **kwargs):
            if getattr(LOCAL, "recorder", None) is not None or (enabled is not None and not enabled(*args, **kwargs)):
                return run_pass(*args, **kwargs)
            inputs: list[Tensor] = []
            key = key_of(args, kwargs, inputs)
            plan = PLANS.get(key)
            if plan is not None:
                PLANS.move_to_end(key)
                return plan.run(inputs)
            if key in REFUSED:
                return run_pass(*args, **kwargs)
            return record(functools.partial(run_pass, *args, **kwargs), inputs, key)

        wrapper.plan_for = plan_for
        return wrapper

    return decorate


def record(run_pass, inputs: list[Tensor], key):
    recorder = Recorder(inputs)
    LOCAL.recorder = recorder
    try:
        with recorder:
            result = run_pass()
    finally:
        LOCAL.recorder = None
    try:
        remember(PLANS, key, recorder.plan(result, inputs[0].device))
    except NotReplayable as why:
        remember(REFUSED, key, str(why))
    return result


def remember(cache: OrderedDict, key, value) -> None:
    cache[key] = value
    if len(cache) > MAX_PLANS:
        cache.popitem(last=False)
