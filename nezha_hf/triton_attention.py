"""NEZHA attention on GPUs: the Triton kernels of `triton_kernels.py` as the engine `nezha_triton`.

FlashAttention-2 with NEZHA's relative terms, its tiles by class (the kernels' docstring says how), forward and
backward, for float32, bfloat16 and float16 tensors on CUDA (and ROCm) GPUs, with any padding, causal or UniLM prefix
mask, a KV cache and attention dropout. A decoding step (at most 16 queries) splits its keys over the GPU's
multiprocessors and merges the splits by their log-sum-exps. With `TRITON_INTERPRET=1` set before Triton is imported,
the same kernels run on CPU tensors through Triton's interpreter when `nezha_triton` is asked for by name (slowly: that
is how they are tested without a GPU).

Registered as the `torch.library` ops `nezha_hf::triton_forward` / `_backward` (`attention_ops.engine_op`), which
`triton_attention` calls. Memory besides the inputs, outputs and gradients: the log-sum-exp and `D_i` per query, and
a decoding step's partial outputs; nothing per (query, table row).

- Launches: one grid axis of (head, block) programs (CUDA allows 65,535 on the others), on the tensors' GPU.
- Failures: an out-of-memory error reaches the caller as PyTorch's own, and the engine stays usable. A kernel that
  fails to compile (or launch) is set aside for its `Switches` and part (forward, decoding forward or backward) only,
  with one warning naming them: those calls raise `TritonKernelFailed` (an `EngineUnavailable`), which
  `relative_attention` hands to the next engine of the chain (`attention_ops.Engine`); calls with other switches still
  run the kernels. Before the first forward of a kind of call that needs gradients, the kernels its backward will
  launch are compiled (Triton's warmup through the backward's launchers), so that a backward that cannot compile is
  found while another engine can still take the call.
- float32: every product is made in the kernels in IEEE float32, whatever `torch.backends.cuda.matmul.allow_tf32` or
  `torch.set_float32_matmul_precision` say: no PyTorch matrix product is on the path (PyTorch computes only the
  elementwise `D_i = dO_i . O_i`, the key bounds and flags).
- No host synchronisation: nothing on the path reads a GPU tensor on the host. A static cache's offset (a tensor on
  the GPU) is read by the kernels; the dropout seed is a CPU tensor (`relative_attention` draws it there). The one
  exception: whether a bfloat16 / float16 call's table is the exact sinusoid (the band by rotation, forward and
  backward) is compared once per table tensor and version (`relative_attention` passes the model's own table, not a
  copy per call).
"""

import copy
import functools
import importlib.util
import math
import os
import sys
import weakref
from dataclasses import dataclass

import torch
from transformers.utils import logging

from .attention_ops import (
    AttentionProblem,
    Engine,
    EngineUnavailable,
    RelativeAttentionMask,
    engine_op,
    fallback_words,
    max_relative_position,
    sinusoid_relative_table,
    tracing,
)

logger = logging.get_logger(__name__)

DEVICES = ("cuda",)  # ROCm GPUs are "cuda" devices to PyTorch
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LOG2E = math.log2(math.e)  # the kernels keep scores in base 2
# The interpreter has no multiprocessors to fill: a decoding step splits its keys as if there were this many, so that
# tests run the split path.
INTERPRETER_PROCESSORS = 4


class TritonKernelFailed(EngineUnavailable):
    """A Triton kernel failed to compile or launch here for a call's switches (the message names them and the
    error); calls with those switches raise it from then on, without trying again."""


@dataclass(frozen=True)
class Switches:
    """What a call's kernels are compiled for, besides their tuned block sizes: a kernel that fails to compile is set
    aside for these switches only."""

    dtype: torch.dtype
    head_size: int
    padding: bool
    causal: bool
    source_keys: bool  # UniLM's prefix mask (under `causal`)
    dropout: bool
    offset_on_device: bool  # the queries' offset is a tensor the kernels read
    seed_on_device: bool  # dropout's seed is a tensor the kernels read

    @classmethod
    def of(cls, query: torch.Tensor, problem: AttentionProblem) -> "Switches":
        mask = problem.mask
        return cls(query.dtype, query.shape[-1], mask.key_is_valid is not None, bool(mask.causal),
                   problem.mask.key_is_source is not None, problem.dropout > 0,
                   _offset_on_device(query, mask.query_offset), _seed_on_device(problem))

    def __str__(self) -> str:
        named = (("padding", self.padding), ("causal", self.causal), ("UniLM source keys", self.source_keys),
                 ("dropout", self.dropout), ("the offset on the GPU", self.offset_on_device),
                 ("the seed on the GPU", self.seed_on_device))
        return ", ".join([str(self.dtype).removeprefix("torch."), f"head size {self.head_size}",
                          *(name for name, on in named if on)])

    def constexprs(self, kernels) -> dict:
        """The kernels' compile-time arguments."""
        return dict(HAS_VALID=self.padding, CAUSAL=self.causal, HAS_SOURCE=self.source_keys, DROPOUT=self.dropout,
                    OFFSET_IN_MEMORY=self.offset_on_device, SEED_IN_MEMORY=self.seed_on_device,
                    WIDEN=kernels.INTERPRETING and self.dtype == torch.bfloat16,
                    IEEE=self.dtype == torch.float32, BLOCK_D=_head_block(self.head_size))


def _head_block(head_size: int) -> int:
    """The kernels' head-size block `BLOCK_D`: a power of two of at least 16."""
    return max(16, 1 << (head_size - 1).bit_length())


_set_aside: dict[tuple[str, Switches], str] = {}  # (part, switches) whose kernel failed here, and why
_checked_backwards: set[tuple] = set()  # the kinds of call whose backward kernels compiled here (`_check_backward`)


def interpreting() -> bool:
    """Whether Triton runs kernels through its interpreter (`TRITON_INTERPRET=1`), on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def triton_installed() -> bool:
    """Whether Triton can be imported."""
    return importlib.util.find_spec("triton") is not None


def unusable_reason(device: str, named: bool = True) -> str | None:
    """Why the Triton engine cannot run on `device` here, or None when it can: it runs on CUDA / ROCm GPUs, and on CPU
    tensors under `TRITON_INTERPRET=1` when asked for by name (`named`; slow, so never as another engine's fallback);
    it needs Triton installed (else one warning). While the `TritonKernelFailed` of a call is being handled (the
    engines' contract: `relative_attention` chooses again inside its `except EngineUnavailable`), its reason: that call
    goes to the next engine, while calls with other switches still run the kernels."""
    if device == "cpu" and not (interpreting() and named):
        return "the Triton kernel runs on CUDA GPUs (on the CPU only under TRITON_INTERPRET=1, asked for by name)"
    if device not in (*DEVICES, "cpu"):
        return f"the Triton kernel runs on CUDA and ROCm GPUs, not {device}"
    if not triton_installed():
        reason = "Triton is not installed (pip install triton)"
        logger.warning_once(f"NEZHA attention: {reason}; {fallback_words(Engine.TRITON)}.")
        return reason
    failure = sys.exc_info()[1]
    return str(failure) if isinstance(failure, TritonKernelFailed) else None


@functools.cache
def _kernels():
    """`triton_kernels`, imported when first needed (it imports Triton), once: an import statement costs a call's host
    time a microsecond. Written as `from .triton_kernels import`, the form transformers follows to copy a remote-code
    checkpoint's files."""
    from .triton_kernels import __name__ as name

    return sys.modules[name]


def _refuse_set_aside(part: str, switches: Switches) -> None:
    """Raise `TritonKernelFailed` when the `part` kernels failed to compile here for `switches`."""
    reason = _set_aside.get((part, switches))
    if reason is not None:
        raise TritonKernelFailed(reason)


class _Launching:
    """A context for launching a call's `part` kernels: on the queries' GPU (Triton launches on the current CUDA
    device). An out-of-memory error passes as it is; any other sets the part aside for the call's `Switches` (one
    warning) and becomes `TritonKernelFailed`."""

    def __init__(self, part: str, query: torch.Tensor, problem: AttentionProblem):
        self.part, self.query, self.problem, self.guard = part, query, problem, None

    def __enter__(self):
        self.guard = _device_guard(self.query.get_device())
        if self.guard is not None:
            self.guard.__enter__()

    def __exit__(self, kind, error, trace) -> None:
        if self.guard is not None:
            self.guard.__exit__(kind, error, trace)
        if not isinstance(error, Exception) or isinstance(error, torch.OutOfMemoryError):
            return
        switches = Switches.of(self.query, self.problem)
        reason = (f"the Triton kernel failed to compile for the {self.part} with {switches} ({type(error).__name__}: "
                  f"{error})")
        if (self.part, switches) not in _set_aside:
            _set_aside[(self.part, switches)] = reason
            _checked_backwards.clear()  # a training call checks again, and finds its backward set aside
            logger.warning(f"NEZHA attention: {reason}; from now on, for such calls, {fallback_words(Engine.TRITON)}.")
        raise TritonKernelFailed(reason) from error


def _device_guard(index: int) -> torch.cuda.device | None:
    """A context in which CUDA device `index` is the current one (Triton launches on the current device), or None
    where it is already, or for the CPU's tensors (`index` -1: the interpreter's)."""
    if index < 0 or index == torch.cuda.current_device():
        return None
    return torch.cuda.device(index)


def _offset_on_device(query: torch.Tensor, offset: int | torch.Tensor) -> bool:
    """Whether the kernels read the queries' offset from memory: a tensor on the queries' device, whose value the host
    would have to wait for. An int, or a tensor on the CPU with GPU queries, is read here."""
    return isinstance(offset, torch.Tensor) and offset.get_device() == query.get_device()


def _seed_on_device(problem: AttentionProblem) -> bool:
    """Whether the kernels read dropout's seed from memory: a tensor on a GPU (a traced call's, drawn there so that a
    CUDA graph draws it at each replay; read on the host it would wait for the GPU). A seed on the CPU (an eager call's)
    is read here."""
    return problem.dropout > 0 and isinstance(problem.seed, torch.Tensor) and problem.seed.device.type != "cpu"


def _decoding_splits(programs: int, queries: int, keys: int, device: torch.device, kernels) -> tuple[int, int]:
    """`(splits, keys per split)` of a forward with `programs` heads: a decoding step (one block of queries) splits
    its keys into chunks of whole `SPLIT_GRANULE`s, enough for about two programs per multiprocessor (FlashDecoding);
    other calls `(1, keys)`."""
    if queries > kernels.DECODING_BLOCK_M:
        return 1, keys
    wanted = -(-2 * _multiprocessors(device) // programs)
    chunk = kernels.SPLIT_GRANULE * max(1, -(-keys // (wanted * kernels.SPLIT_GRANULE)))
    return -(-keys // chunk), chunk


_processors: dict[torch.device, int] = {}  # multiprocessors per device, asked once


def _multiprocessors(device: torch.device) -> int:
    """The multiprocessors of `device`'s GPU: `INTERPRETER_PROCESSORS` under the interpreter; for CPU tensors with
    Triton compiling, those of the GPU Triton's active driver stands for (`benchmarks/gpu/gpu_fake_driver.py`)."""
    if interpreting():
        return INTERPRETER_PROCESSORS
    if device not in _processors:
        if device.type == "cpu":
            from triton.runtime import driver

            _processors[device] = driver.active.utils.get_device_properties(0)["multiprocessor_count"]
        else:
            _processors[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _processors[device]


def _forward_part(splits: int) -> str:
    return "decoding forward" if splits > 1 else "forward"


def _key_flags(flags: torch.Tensor | None, key: torch.Tensor) -> torch.Tensor | None:
    """Key flags as the kernels read them: `[batch, keys]` int8, contiguous."""
    return None if flags is None else flags.to(device=key.device, dtype=torch.int8).contiguous()


def _key_bounds(mask: RelativeAttentionMask, key: torch.Tensor) -> torch.Tensor | None:
    """`[batch, 4]` int32 per sequence: its first valid key, last valid key + 1, last valid source key + 1 (0 when
    none), so that the kernels skip the key blocks no query sees, and whether its valid keys, and its valid source keys
    from the first valid one, are each one run (1), as padding on either side and UniLM's source leave them, so that
    the kernels mask only the blocks their ends cut (0: a mask with gaps, every tail block masked); None without
    padding or source keys."""
    valid, source = mask.key_is_valid, mask.key_is_source
    if valid is None and source is None:
        return None
    batch, _, keys, _ = key.shape
    position = torch.arange(keys, device=key.device)
    valid = (torch.ones(batch, keys, dtype=torch.bool, device=key.device) if valid is None
             else valid.to(key.device, torch.bool))
    first = torch.where(valid, position, keys).amin(1)
    end = torch.where(valid, position + 1, 0).amax(1)
    one_run = valid.sum(1) == (end - first).clamp_min(0)
    if source is None:
        sources = torch.zeros_like(end)
    else:
        valid_source = valid & source.to(key.device, torch.bool)
        sources = torch.where(valid_source, position + 1, 0).amax(1)
        one_run &= valid_source.sum(1) == (sources - first).clamp_min(0)
    return torch.stack((first, end, sources, one_run), 1).to(torch.int32)


def _mask_tensors(mask: RelativeAttentionMask, key: torch.Tensor) -> dict:
    """The kernels' `KeyValid`, `KeyIsSource` and `KeyBounds` of a mask (`_key_flags`, `_key_bounds`)."""
    return dict(KeyValid=_key_flags(mask.key_is_valid, key), KeyIsSource=_key_flags(mask.key_is_source, key),
                KeyBounds=_key_bounds(mask, key))


def _strides(tensor: torch.Tensor, name: str, row: str, heads_first: bool = True) -> dict:
    """The kernels' stride arguments `stride_{name}b`, `...h`, `...{row}`, `...d` of a `[batch, heads, length, d]`
    tensor (`heads_first`) or a `[batch, length, heads, d]` one."""
    b, first, second, d = tensor.stride()
    heads, length = (first, second) if heads_first else (second, first)
    return {f"stride_{name}b": b, f"stride_{name}h": heads, f"stride_{name}{row}": length, f"stride_{name}d": d}


# --- a call's arguments, and its launches decided once per kind of call --------------------------------------------


@dataclass(frozen=True)
class _TableUse:
    """What the kernels take of a table for queries of one dtype (`_table_use`)."""

    table: torch.Tensor  # in the queries' dtype, contiguous
    rotate: bool  # the band by rotation (`_rotation`)
    sinusoid: torch.Tensor | None  # the sinusoid the band by rotation reads, when it does


def _table_use(table: torch.Tensor, dtype: torch.dtype, kernels) -> _TableUse:
    """The table as the kernels take it for queries of `dtype`, made once per table and version (`_derived`: a model's
    layers share one table)."""

    def make() -> _TableUse:
        rotation = _rotation(table, dtype, kernels)
        return _TableUse(table.to(dtype).contiguous(), rotation["ROTATE"], rotation["Sinusoid"])

    return _derived(("table", dtype), make, table)


def _kind(part: str, query, key, value, table, problem: AttentionProblem, rotate: bool, *others) -> tuple:
    """What decides a call's launches besides its own values (`_call_values`): calls of one kind launch the same
    compiled kernels on the same grids with the same other arguments (its `Switches`, sizes, strides, scale, dropout
    rate, table size and whether the band goes by rotation; `others`: the strides of the backward's output and
    gradient). Made of plain values, cheaply: it is made at every call. The keys' shape and the keys' and values'
    strides come last (`_growing_kind` replaces them)."""
    mask = problem.mask
    return (part, query.dtype, query.get_device(), query.shape, query.stride(), table.shape[0], rotate,
            mask.key_is_valid is not None, mask.causal, mask.key_is_source is not None,
            _offset_on_device(query, mask.query_offset), _seed_on_device(problem), problem.scaling, problem.dropout,
            *others, key.shape, key.stride(), value.stride())


def _growing_kind(kind: tuple, key, length_values: dict, kernels) -> tuple | None:
    """The kind of a decoding forward (`kind`) without its key length: what its kernels are compiled and tuned for
    from that length (its `length_class`, whether it splits) and from the ints that follow it (`length_values`:
    `_key_length_values`), so that a dynamic cache, which grows by a key at every step, finds its launches planned
    (`_growing_plans`) at each new length. What an int is compiled for is Triton's own rule
    (`native_specialize_impl`: 1 as a constant, a multiple of 16, 32 or 64 bits), so a plan never launches a kernel
    Triton would not have chosen; None (every key length planned on its own) with a Triton without it."""
    specialise = getattr(kernels.triton.runtime.jit, "native_specialize_impl", None)
    if specialise is None:
        return None
    batch, heads, keys, size = key.shape
    return (*kind[:-3], batch, heads, size, kernels.length_class(keys), length_values["splits"] > 1,
            *(specialise(None, number, False, True, True) for number in length_values.values()))


def _key_length_values(key, value, splits: int, chunk: int) -> dict:
    """The arguments of a decoding forward that follow its key length, by name: what a plan made at another length
    takes in place of its own (`_Plan.replanned`), and what Triton's first launch of a kind is given."""
    return {"Lk": key.shape[-2], "splits": splits, "key_chunk": chunk, **_strides(key, "k", "n"),
            **_strides(value, "v", "n")}


def _call_values(query, key, value, use: _TableUse, problem: AttentionProblem) -> dict:
    """The kernels' arguments that change from call to call, by name (a planned launch takes every other from its
    plan, `_Plan`): the inputs; the table as the kernels take it (`_table_use`) and the mask's flags and bounds (made
    once per mask, `_derived`: a model's layers and their backward share one); the offset; dropout's seed."""
    mask = problem.mask
    values = dict(Q=query, Kx=key, V=value, Table=use.table, Sinusoid=use.sinusoid, KeyValid=None, KeyIsSource=None,
                  KeyBounds=None, Offset=None, offset=0, Seed=None, seed=0)
    if _seed_on_device(problem):
        values["Seed"] = problem.seed
    elif problem.dropout > 0:
        values["seed"] = int(problem.seed)
    if mask.key_is_valid is not None or mask.key_is_source is not None:
        values.update(_derived(("mask", key.device, key.shape[-2]), lambda: _mask_tensors(mask, key),
                               mask.key_is_valid, mask.key_is_source))
    if _offset_on_device(query, mask.query_offset):
        values["Offset"] = mask.query_offset
    else:
        values["offset"] = int(mask.query_offset)
    return values


def _arguments(query, key, table, problem: AttentionProblem, switches: Switches, kernels) -> dict:
    """The arguments every kernel of a call takes that are the same for every call of its kind (`_kind`), but the
    strides, by name: the sizes, the scale, dropout's threshold and scale, and the switches."""
    _, heads, queries, size = query.shape
    keys = key.shape[-2]
    if not problem.scaling > 0:  # the kernels take a row's maximum before the scale (plain FlashAttention-2's way)
        raise TritonKernelFailed(f"the Triton kernels take a positive score scale, not {problem.scaling}")
    return dict(
        heads=heads, Lq=queries, Lk=keys, D=size, K=max_relative_position(table), scale_log2=problem.scaling * LOG2E,
        **_dropout_draws(problem.dropout), LQ_CLASS=kernels.length_class(queries),
        LK_CLASS=kernels.length_class(keys), **switches.constexprs(kernels),
    )


class _Plan:
    """One kernel's launch, decided for a kind of call (`_kind`) by the kind's first launch through Triton (the
    autotuner's choice, the JIT's compiled kernel): the compiled kernel and its grid, every argument in the kernel's
    order, and where a later call of the kind puts its own values (`_call_values`, outputs and scratch)."""

    def __init__(self, kernel, grid, arguments: dict, compiled, call: dict):
        config = getattr(kernel, "best_config", None)  # an autotuned kernel's choice for this kind
        every = {**arguments, **(config.kwargs if config is not None else {})}
        # without the call's own values: a plan holds no tensor of the call that made it
        self.names, self.grid_of = kernel.arg_names, grid
        self.others = {name: value for name, value in every.items() if name not in call}
        self.grid = _grid(grid, self.others)
        self.compiled = compiled
        # What Triton's launcher takes besides the grid, the stream and the arguments (as torch Inductor's launchers
        # call it): the loaded kernel and its packed metadata
        self.run, self.function, self.metadata = compiled.run, compiled.function, compiled.packed_metadata
        # the call's values but those this launch was given as None (a backward kernel's other gradients' outputs)
        self.slots = [(index, name) for index, name in enumerate(self.names)
                      if name in call and arguments[name] is not None]
        self.arguments = [None if name in call else self.others[name] for name in self.names]
        self.positions = {name: index for index, name in enumerate(self.names)}

    def replanned(self, values: dict) -> "_Plan":
        """This launch with the ints `values` (by name; those the kernel takes) in place of its own, its grid made
        again with them."""
        plan = copy.copy(self)
        values = {name: value for name, value in values.items() if name in self.others}
        plan.others = {**self.others, **values}
        plan.grid = _grid(self.grid_of, plan.others)
        plan.arguments = self.arguments.copy()
        for name, value in values.items():
            plan.arguments[self.positions[name]] = value
        return plan

    def launch(self, call: dict, stream: int, hooked: bool) -> None:
        """Launch on `stream` with `call`'s values: straight into Triton's launcher, or (`hooked`: a launch hook is
        set, e.g. a profiler's, which reads the launch's metadata) through the compiled kernel's own runner, which
        makes that metadata."""
        arguments = self.arguments.copy()
        for index, name in self.slots:
            arguments[index] = call[name]
        if hooked:
            self.compiled[self.grid](*arguments)
        else:
            self.run(*self.grid, stream, self.function, self.metadata, None, None, None, *arguments)


def _grid(grid, arguments: dict) -> tuple[int, int, int]:
    """A launch's three grid sizes: `grid`, or what it makes of the kernel's `arguments` (those the tuning chose
    among them)."""
    grid = tuple(grid(arguments) if callable(grid) else grid)
    return grid + (1,) * (3 - len(grid))


def _hooks_set(runtime) -> bool:
    """Whether a launch hook is set in Triton's `runtime` settings: a `HookChain` holding a hook, or (older Tritons) a
    function, not None."""
    enter, exit = runtime.launch_enter_hook, runtime.launch_exit_hook
    return (enter is not None and bool(getattr(enter, "calls", True))
            or exit is not None and bool(getattr(exit, "calls", True)))


class _Launches:
    """Every kernel launch of a kind of call, planned (`_Plan`), in order, with whether each tensor the call was given
    (not those it made: `made`) was aligned to 16 bytes (the JIT specialised the kernels on that; the kind fixes the
    rest of what it specialised on); a forward's decoding splits; the active Triton driver's `get_current_stream` and
    Triton's runtime settings (its launch hooks)."""

    def __init__(self, plans: list[_Plan], call: dict, made, splits: int):
        self.plans, self.splits = plans, splits
        self.aligned = [(name, value.data_ptr() % 16 == 0) for name, value in call.items()
                        if isinstance(value, torch.Tensor) and name not in made]
        triton = _kernels().triton
        self.current_stream, self.runtime = triton.runtime.driver.active.get_current_stream, triton.knobs.runtime

    def replanned(self, values: dict) -> "_Launches":
        """These launches with the ints `values` (by name) in place of their own (`_Plan.replanned`)."""
        launches = copy.copy(self)
        launches.plans = [plan.replanned(values) for plan in self.plans]
        launches.splits = values.get("splits", self.splits)
        return launches

    def launch(self, call: dict, device: int) -> bool:
        """Launch the plans with `call`'s values on the current stream of GPU `device` (the current device, where
        Triton launches), unless a tensor of `call` is aligned otherwise than planned (False: Triton's JIT launches
        that call)."""
        for name, aligned in self.aligned:
            if (call[name].data_ptr() % 16 == 0) != aligned:
                return False
        hooked, stream = _hooks_set(self.runtime), self.current_stream(device)
        for plan in self.plans:
            plan.launch(call, stream, hooked)
        return True


_plans: dict[tuple, _Launches] = {}  # the kinds of call planned here
_growing_plans: dict[tuple, _Launches] = {}  # the kinds of decoding forward planned here, less their key lengths
PLANNED_KINDS = 1024  # kinds kept at most in each (a decoding loop with a dynamic cache makes a kind per step)


def _planned(plans: dict, kind: tuple, launches: _Launches) -> _Launches:
    """`launches` planned for `kind` in `plans` (emptied first where it holds `PLANNED_KINDS`)."""
    if len(plans) >= PLANNED_KINDS:
        plans.clear()
    plans[kind] = launches
    return launches


def _launch_all(kind: tuple, launches: list, call: dict, made, warmup: bool = False,
                splits: int = 1) -> _Launches | None:
    """Launch each `(kernel, grid, arguments)` through Triton (its autotuner and JIT) with the arguments that kernel
    takes (`arguments` may hold more), or (`warmup`) only compile them; then plan the kind (`_Launches`, returned)
    where every launch ran a compiled kernel (under the interpreter none does: every call goes through Triton).
    `made`: the names of `call`'s tensors the call allocated itself, whose alignment is the allocator's (at least 64
    bytes)."""
    kernels = _kernels()
    launched = []
    for kernel, grid, arguments in launches:
        names = set(kernel.arg_names)
        own = {name: value for name, value in arguments.items() if name in names}
        launched.append((kernel, grid, own, _launch(kernel, grid, warmup, **own)))
    if not warmup and all(isinstance(compiled, kernels.triton.compiler.CompiledKernel) for *_, compiled in launched):
        return _planned(_plans, kind, _Launches([_Plan(kernel, grid, own, compiled, call)
                                                 for kernel, grid, own, compiled in launched], call, made, splits))
    return None


def _launch(kernel, grid, warmup: bool, **arguments):
    """Launch `kernel` on `grid`, or (`warmup`) only compile what that launch would launch: Triton's own warmup, through
    the same autotuner pruning and JIT specialisation. What Triton returns: the compiled kernel launched, where it
    compiles."""
    if warmup:
        return kernel.warmup(grid=grid, **arguments)
    return kernel[grid](**arguments)


def _keep_rate(keep_scale: float) -> float:
    """`1 - p` of a dropout's `keep_scale` (`_dropout_draws`): 0 where every pair is dropped (`keep_scale` 0)."""
    return 1 / keep_scale if keep_scale else 0.0


def _dropout_draws(dropout: float) -> dict:
    """The kernels' `threshold` and `keep_scale` for a dropout rate: a pair is dropped when its 8-bit draw is below
    `threshold = round(256 p)` (FlashAttention-2's 8-bit draws), so the rate runs as `threshold / 256`, and kept
    pairs are scaled by `256 / (256 - threshold)` (the expectation stays the output without dropout). A rate that
    rounds to 0 or 1 but is not one is the next engine's (`TritonKernelFailed`), never dropped silently or wholly."""
    threshold = math.floor(dropout * 256 + 0.5)
    if dropout == 0 or dropout == 1:
        return dict(threshold=threshold, keep_scale=1.0 if dropout == 0 else 0.0)
    if threshold in (0, 256):
        raise TritonKernelFailed(f"the Triton kernels draw dropout in steps of 1/256, and a rate of {dropout} rounds to "
                                 f"{threshold // 256}")
    if threshold != dropout * 256:
        logger.warning_once(f"NEZHA attention: the Triton kernels draw dropout in steps of 1/256 (FlashAttention-2's "
                            f"8-bit draws): a rate of {dropout} runs as {threshold}/256 = {threshold / 256:.4f}.")
    return dict(threshold=threshold, keep_scale=256 / (256 - threshold))


# Results made from tensors (`_derived`): (what, the sources' ids) -> (weak references to them, their versions, the
# index of the first that is a tensor, result).
_derived_values: dict[tuple, tuple] = {}
_sinusoids: dict[tuple, torch.Tensor] = {}  # (K, head size, dtype, device) -> the kernels' `Sinusoid`


def _capturing(tensor: torch.Tensor) -> bool:
    """Whether a CUDA graph is being captured on the current stream of `tensor`'s GPU."""
    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()


def _derived(what: tuple, make, *sources: torch.Tensor | None, decided_on_host: bool = False):
    """`make()`, the result `what` made from `sources` (tensors, or None), kept while each source lives unchanged (its
    version): the layers of a model, which share one table and one mask, and their backward make it once. Made again
    for inference tensors (which count no versions) and, unless the host decides it once for all (a Python value,
    `decided_on_host`), while a CUDA graph is being captured: the graph must make it from its inputs at each replay."""
    key = (what, *map(id, sources))
    known = _derived_values.get(key)
    if known is not None:
        references, versions, first, result = known
        for reference, version, source in zip(references, versions, sources):
            if source is not None and (reference() is not source or source._version != version):
                break
        else:
            if decided_on_host or not _capturing(sources[first]):
                return result
    tensors = [source for source in sources if source is not None]
    result = make()
    if not any(tensor.is_inference() for tensor in tensors) and (decided_on_host or not _capturing(tensors[0])):
        forget = lambda _, values=_derived_values: values.pop(key, None)  # noqa: E731 (a source was freed)
        _derived_values[key] = (tuple(None if source is None else weakref.ref(source, forget) for source in sources),
                                tuple(None if source is None else source._version for source in sources),
                                next(i for i, source in enumerate(sources) if source is not None), result)
    return result


def _is_exact_sinusoid(table: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether `table` in `dtype` is, entry for entry, the sinusoid `sinusoid_relative_table` makes (NEZHA's table):
    then the band tiles, forward and backward, go by rotation (`triton_kernels._rotated_band`), which holds for that
    table only; any other table takes the table's window. Compared once per table tensor and version (the comparison
    waits for the GPU), the answer kept while the table lives."""

    def compare() -> bool:
        rows, size = table.shape
        return rows % 2 == 1 and size % 2 == 0 and torch.equal(
            table.to(dtype), sinusoid_relative_table(max_relative_position(table), size).to(table.device, dtype))

    return _derived(("exact sinusoid", dtype), compare, table, decided_on_host=True)


def _rotation(table: torch.Tensor, dtype: torch.dtype, kernels) -> dict:
    """The kernels' `ROTATE` and `Sinusoid` (the sinusoid continued to `2K + ROTATION_ROWS` rows, in `dtype`, made
    once per size): by rotation for bfloat16 and float16 with the exact sinusoid; float32, whose products must stay
    as exact as the table's own rows, and any other table, by the table's window."""
    if dtype == torch.float32 or not _is_exact_sinusoid(table, dtype):
        return dict(ROTATE=False, Sinusoid=None)
    K, size = max_relative_position(table), table.shape[1]
    key = (K, size, dtype, table.device)
    if key not in _sinusoids:
        _sinusoids[key] = sinusoid_relative_table(K + -(-kernels.ROTATION_ROWS // 2), size).to(table.device, dtype)
    return dict(ROTATE=True, Sinusoid=_sinusoids[key])


def _blocks(length: int, block: int) -> int:
    """Blocks of `block` rows that cover `length`."""
    return -(-length // block)


def triton_forward(query, key, value, table, problem: AttentionProblem) -> list[torch.Tensor]:
    """NEZHA attention forward by the Triton kernels: `[output [batch, queries, heads, head_size], lse [batch, heads,
    queries] float32]`; see `attention_ops.engine_op`. Raises `TritonKernelFailed` where the forward failed to compile
    for the call's switches."""
    kernels = _kernels()
    batch, heads, queries, size = query.shape
    keys = key.shape[-2]
    output = query.new_empty(batch, queries, heads, size)
    lse = query.new_empty(batch, heads, queries, dtype=torch.float32)
    if queries == 0 or keys == 0:
        return [output.zero_(), lse.fill_(float("-inf"))]
    use = _table_use(table, query.dtype, kernels)
    kind = _kind("forward", query, key, value, table, problem, use.rotate)
    call = _call_values(query, key, value, use, problem)
    made = dict(Out=output, Lse=lse, Partial=None, PartialStats=None)
    planned, growing = _plans.get(kind), None
    if planned is None:
        splits, chunk = _decoding_splits(batch * heads, queries, keys, query.device, kernels)
        _refuse_set_aside(_forward_part(splits), Switches.of(query, problem))
        if queries <= kernels.DECODING_BLOCK_M:  # a decoding step: planned at another key length?
            length_values = _key_length_values(key, value, splits, chunk)
            growing = _growing_kind(kind, key, length_values, kernels)
            if growing in _growing_plans:
                planned = _planned(_plans, kind, _growing_plans[growing].replanned(length_values))
    else:
        splits = planned.splits
    if splits > 1:  # each split's unnormalised output, maximum and sum, merged by `nezha_merge_kernel`
        rows = batch * heads * splits * queries
        made.update(Partial=torch.empty(rows, _head_block(size), dtype=torch.float32, device=query.device),
                    PartialStats=torch.empty(rows, 2, dtype=torch.float32, device=query.device))
    call.update(made)
    with _Launching(_forward_part(splits), query, problem):
        if planned is not None and planned.launch(call, query.get_device()):
            return [output, lse]
        splits, chunk = _decoding_splits(batch * heads, queries, keys, query.device, kernels)
        arguments = {**_arguments(query, key, table, problem, Switches.of(query, problem), kernels), **call,
                     "ROTATE": use.rotate, **_strides(query, "q", "m"), **_strides(output, "o", "m", heads_first=False),
                     **_key_length_values(key, value, splits, chunk), "SPLIT": splits > 1}
        launches = [(kernels.nezha_forward_kernel,
                     lambda meta: (_blocks(queries, meta["BLOCK_M"]) * meta["splits"] * batch * heads,), arguments)]
        if splits > 1:
            launches.append((kernels.nezha_merge_kernel, (_blocks(queries, kernels.DECODING_BLOCK_M) * batch * heads,),
                             dict(arguments, BLOCK_M=kernels.DECODING_BLOCK_M)))
        planned = _launch_all(kind, launches, call, made, splits=splits)
        if planned is not None and growing is not None:
            _planned(_growing_plans, growing, planned)
    return [output, lse]


def triton_backward(grad_output, query, key, value, table, problem: AttentionProblem, output,
                    lse) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of query, key and value (`[batch, heads, length, head_size]`) by the Triton kernels; see
    `attention_ops.engine_op` (`grad_output` and `output` are `[batch, heads, queries, head_size]` views)."""
    batch, heads, queries, size = query.shape
    keys = key.shape[-2]
    if queries == 0 or keys == 0:
        return tuple(torch.zeros(batch, heads, length, size, dtype=query.dtype, device=query.device)
                     for length in (queries, keys, keys))
    # Every element is written by the kernels (a key or query no other sees gets 0).
    grads = tuple(torch.empty(batch, heads, length, size, dtype=query.dtype, device=query.device)
                  for length in (queries, keys, keys))
    with _Launching("backward", query, problem):
        _backward_kernels(grad_output, query, key, value, table, problem, output, lse, grads, warmup=False)
    return grads


def _backward_kernels(grad_output, query, key, value, table, problem: AttentionProblem, output, lse, grads: tuple,
                      warmup: bool) -> None:
    """Launch the backward's kernels into `grads` (`(grad_query, grad_key, grad_value)`), or (`warmup`) compile them
    only (`_check_backward`)."""
    kernels = _kernels()
    batch, heads, queries, size = query.shape
    keys = key.shape[-2]
    use = _table_use(table, query.dtype, kernels)
    kind = _kind("backward", query, key, value, table, problem, use.rotate, grad_output.stride(), output.stride())
    call = _call_values(query, key, value, use, problem)
    # Per query and tile class: the log-sum-exp less a tail's key term, D_i = dO_i . O_i less its output term; for the
    # band by rotation, its clipped pairs' terms and the queries and output gradients turned.
    made = dict(DQ=grads[0], DK=grads[1], DV=grads[2],
                RowLse=torch.empty(batch, heads, 3, queries, dtype=torch.float32, device=query.device),
                RowDot=torch.empty(batch, heads, 3, queries, dtype=torch.float32, device=query.device),
                RowTerms=None, RotQ=None, RotDO=None)
    if use.rotate:
        made.update(RowTerms=torch.empty(batch, heads, 4, queries, dtype=torch.float32, device=query.device),
                    RotQ=torch.empty(batch, heads, queries, size, dtype=query.dtype, device=query.device),
                    RotDO=torch.empty(batch, heads, queries, size, dtype=query.dtype, device=query.device))
    call.update(DO=grad_output, O=output, Lse=lse, **made)
    planned = _plans.get(kind)
    if not warmup and planned is not None and planned.launch(call, query.get_device()):
        return
    switches = Switches.of(query, problem)
    _refuse_set_aside("backward", switches)
    arguments = {**_arguments(query, key, table, problem, switches, kernels), **call, "ROTATE": use.rotate,
                 "scale": problem.scaling, **_strides(query, "q", "m"), **_strides(key, "k", "n"),
                 **_strides(value, "v", "n"), **_strides(grad_output, "o", "m"), **_strides(output, "y", "m")}
    statistics = dict(arguments, keep_rate=_keep_rate(arguments["keep_scale"]), BLOCK_M=kernels.STATISTICS_BLOCK_M)
    _launch_all(kind, [
        (kernels.nezha_row_statistics_kernel, (_blocks(queries, kernels.STATISTICS_BLOCK_M) * batch * heads,),
         statistics),
        (kernels.nezha_key_value_grad_kernel, lambda meta: (_blocks(keys, meta["BLOCK_N"]) * batch * heads,),
         dict(arguments, DQ=None)),  # the gradients whose outputs a backward kernel is given
        (kernels.nezha_query_grad_kernel, lambda meta: (_blocks(queries, meta["BLOCK_M"]) * batch * heads,),
         dict(arguments, DK=None, DV=None)),
    ], call, made, warmup)


def _forward_fake(query, key, value, table, problem):
    batch, heads, queries, size = query.shape
    return [query.new_empty(batch, queries, heads, size),
            torch.empty(batch, heads, queries, dtype=torch.float32, device=query.device)]


def _backward_fake(grad_output, query, key, value, table, problem, output, lse):
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


_attention_op = engine_op(Engine.TRITON, triton_forward, _forward_fake, triton_backward, _backward_fake)


def triton_attention(query, key, value, table, problem: AttentionProblem) -> torch.Tensor:
    """NEZHA attention by the Triton kernels, `[batch, queries, heads, head_size]`; arguments as
    `fused_attention.fused_attention`. float32, bfloat16 and float16 on CUDA GPUs (CPU tensors under
    TRITON_INTERPRET=1). Before the first call of a kind that needs gradients, the kernels its backward will launch
    are compiled (`_check_backward`); raises `TritonKernelFailed` where a kernel the call needs failed to compile
    here."""
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad) and not tracing():
        _check_backward(query, key, value, table, problem)
    return _attention_op(query, key, value, table, problem)


def _check_backward(query, key, value, table, problem: AttentionProblem) -> None:
    """Compile the kernels this call's backward will launch, before its forward runs, so that a backward that cannot
    compile is found while another engine can still take the call: Triton's warmup through the backward's own
    launchers (`_backward_kernels`), with the call's tensors and table (its `K`, whether it goes by rotation), the
    configurations the autotuner keeps for its lengths and switches, and the seed's type. Once per kind of call
    (`_kind`: its switches, sizes, strides, table size and rotation; forgotten when a backward fails, so that a
    kind whose backward was set aside goes to the next engine); a backward whose arguments Triton specialises
    otherwise (a gradient of other strides) compiles at its launch, as any kernel does."""
    kernels = _kernels()
    batch, heads, queries, size = query.shape
    keys = key.shape[-2]
    kind = _kind("backward check", query, key, value, table, problem, _table_use(table, query.dtype, kernels).rotate)
    if kind in _checked_backwards or queries == 0 or keys == 0:
        return
    _refuse_set_aside("backward", Switches.of(query, problem))
    # The forward's outputs as the backward receives them (`engine_op`): `[batch, heads, queries, d]` views.
    output = query.new_empty(batch, queries, heads, size).transpose(1, 2)
    lse = torch.empty(batch, heads, queries, dtype=torch.float32, device=query.device)
    grads = tuple(torch.empty(batch, heads, length, size, dtype=query.dtype, device=query.device)
                  for length in (queries, keys, keys))
    with _Launching("backward", query, problem):
        _backward_kernels(output, query, key, value, table, problem, output, lse, grads, warmup=True)
    _checked_backwards.add(kind)


__all__ = ["Switches", "TritonKernelFailed", "interpreting", "triton_attention", "triton_installed",
           "unusable_reason"]
