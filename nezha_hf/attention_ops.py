"""What a NEZHA attention call is asked, the rules every engine follows, and the glue every engine shares.

For a head of size `d`, query position `i`, key position `j` and `K = max_relative_position(table)`:

    r(i, j) = clip(j - i, -K, K) + K                       # a row of the table, 0 .. 2K
    s_ij    = (q_i . k_j + q_i . T[r(i, j)]) * scale       over the keys query i sees
    out_i   = sum_j softmax_j(s_ij) (v_j + T[r(i, j)])     0 for a query that sees no key

- `Engine` names the engines, in the order of their fallback chain: one that cannot run a call hands it to the next.
- `RelativeAttentionMask` says which keys each query sees (padding, causal, UniLM prefix, a KV cache's offset)
  without an `L x L` tensor; `AttentionProblem` is one call's whole description (the mask, the score scale, attention
  dropout and its seed), built once per call and passed by name.
- The rules, written once here and used by every Python engine (the C++ kernel's tests check it against them):
  `query_positions`, `relative_position_index`, `visible_keys` and `sees_nothing`.
- `gather_attention`: the attention in standard ops with `L x L` scores per head (the gather engine, and the
  decomposition exporters substitute for every engine's op).
- `engine_op` registers an engine's forward and backward as `torch.library` ops, whose schema is generated from
  `AttentionProblem`: the only place its fields stand in a row.
"""

import contextlib
import dataclasses
import enum
import math
import operator
import sys
import typing
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


def tracing() -> bool:
    """True under `torch.compile`, `torch.export` or `torch.jit.trace`: code must not branch on tensor values."""
    # `torch._C._is_tracing()` is `torch.jit.is_tracing()` outside TorchScript, without its two Python calls (this runs
    # at every call); `torch.compile` never reaches it
    return torch.compiler.is_compiling() or torch._C._is_tracing()


def values_known(tensor: torch.Tensor) -> bool:
    """Whether code may read `tensor`'s values: not while tracing, and never on the meta device (shapes only)."""
    return not tracing() and tensor.device.type != "meta"


class Engine(enum.Enum):
    """The engines that compute NEZHA attention, in the order of the fallback chain: an engine that cannot run a call
    hands it to the next one, down to the gather engine, which runs everywhere (`relative_attention.ENGINES` says when
    each cannot run, and renders where that leads: the table in docs/attention.md).

    Each engine has one name, its member's, from which the others follow: its `attn_implementation` (the member's
    value) is `nezha_<name>`, except the gather engine's, transformers' `"eager"` (a model's own attention function);
    its ops are `nezha_hf::<name>_forward` / `_backward` (`op_name`); logs and docs call it `label`."""

    def _generate_next_value_(name, start, count, last_values):
        return "eager" if name == "GATHER" else f"nezha_{name.lower()}"

    FUSED = enum.auto()
    TRITON = enum.auto()
    THREE_REGIONS = enum.auto()
    CHUNKED = enum.auto()
    GATHER = enum.auto()

    @property
    def op_name(self) -> str:
        """The name of its `torch.library` ops (`nezha_hf::<op_name>_forward`)."""
        return self.name.lower()

    @property
    def label(self) -> str:
        """How logs and the docs name it ("the three-regions engine")."""
        return self.name.lower().replace("_", "-")

    @property
    def fallbacks(self) -> tuple["Engine", ...]:
        """The engines after it in the chain, in order."""
        members = list(Engine)
        return tuple(members[members.index(self) + 1 :])


def fallback_words(engine: Engine) -> str:
    """What takes a call `engine` cannot run, in words from the chain, for the messages that say so."""
    *others, last = (f"the {fallback.label} engine" for fallback in engine.fallbacks)
    return (f"the first that can run of {', '.join(others)} or {last} takes its calls (docs/attention.md says which, "
            "where), with the same results")


@dataclass(frozen=True)
class RelativeAttentionMask:
    """Which keys each query may attend to, without an `L x L` tensor (`visible_keys` is the rule).

    Attributes:
        key_is_valid: `[batch, key_length]` bool, False on padding; None when nothing is padded.
        causal: queries see only keys at their position or before.
        key_is_source: `[batch, key_length]` bool for the UniLM prefix mask: with `causal`, a source
            key is visible to every query (source tokens see the whole source, target tokens see
            the source and the targets before them). Without `causal` it means nothing and is dropped
            (None), so that an engine finds it only where it acts.
        query_offset: position of the first query (the cache length while decoding): an int, or a
            0-dim tensor when a static cache reports it as one.
    """

    key_is_valid: torch.Tensor | None = None
    causal: bool = False
    key_is_source: torch.Tensor | None = None
    query_offset: int | torch.Tensor = 0

    def __post_init__(self):
        if not self.causal and self.key_is_source is not None:
            object.__setattr__(self, "key_is_source", None)


@dataclass(frozen=True)
class AttentionProblem:
    """One attention call, besides its query, key, value and table: which keys each query sees, the score scale, and
    attention dropout (the rate, and the seed of its mask; a rate of 0 for none)."""

    mask: RelativeAttentionMask
    scaling: float
    dropout: float = 0.0
    seed: torch.Tensor | None = None


class EngineUnavailable(RuntimeError):
    """Raised by an engine that finds, when it runs, that it cannot run here (a GPU kernel that does not compile),
    after recording that so its `unusable` check says it from then on: the call is given to the next engine."""


def sinusoid_frequencies(head_size: int) -> torch.Tensor:
    """The table's angular frequencies `w_m = 10000^(-2m / head_size)`, in float32 as transformers 4.x computed them."""
    return torch.exp(torch.arange(0, head_size, 2).float() * (-math.log(10000.0) / head_size))


def sinusoid_relative_table(max_relative_position: int, head_size: int) -> torch.Tensor:
    """The fixed `(2K + 1) x head_size` table `T`, computed exactly as transformers 4.x did (float32): `T[p, 2m] =
    sin(p w_m)`, `T[p, 2m + 1] = cos(p w_m)`. Row `p` encodes the shifted index `p = clip(j - i) + K`, not the signed
    distance."""
    num_rows = 2 * max_relative_position + 1
    position = torch.arange(num_rows, dtype=torch.int64).float().unsqueeze(1)
    div_term = sinusoid_frequencies(head_size)
    table = torch.zeros(num_rows, head_size)
    table[:, 0::2] = torch.sin(position * div_term)
    table[:, 1::2] = torch.cos(position * div_term)
    return table


def max_relative_position(table: torch.Tensor) -> int:
    """`K` of a `(2K + 1) x head_size` table."""
    return (table.shape[0] - 1) // 2


# --- the rules ----------------------------------------------------------------------------------------------


def query_positions(query_length: int, query_offset: int | torch.Tensor = 0, device=None, start: int = 0):
    """Positions of the queries `start .. query_length - 1` of a call: `query_offset + arange` (the offset is the
    KV-cache length)."""
    return torch.arange(start, query_length, device=device) + query_offset


def relative_position_index(query_position: torch.Tensor, key_position: torch.Tensor, K: int) -> torch.Tensor:
    """`r(i, j) = clip(j - i, -K, K) + K`, `[queries, keys]`, for query positions i and key positions j."""
    return (key_position[None, :] - query_position[:, None]).clamp(-K, K) + K


def visible_keys(mask: RelativeAttentionMask, query_position: torch.Tensor, key_position: torch.Tensor):
    """Which keys each query sees: `[batch or 1, *leading, queries, keys]` bool for query positions `[*leading,
    queries]` and key positions `[*leading, keys]` (inside `[0, key_length)`), None when every query sees every key.
    Under `causal` a query at i sees the keys at or before i and the source keys; padding is never seen."""
    queries, keys = query_position[..., :, None], key_position[..., None, :]
    allowed = None
    if mask.causal:
        allowed = (keys <= queries)[None]
        if mask.key_is_source is not None:
            allowed = allowed | mask.key_is_source[:, keys]
    if mask.key_is_valid is not None:
        valid = mask.key_is_valid[:, keys]
        allowed = valid if allowed is None else allowed & valid
    return allowed


def sees_nothing(mask: RelativeAttentionMask, query_position: torch.Tensor) -> torch.Tensor | None:
    """Which queries see no key at all, `[batch, queries]` bool (None when every query sees one): their output is 0,
    as transformers 5's BERT gives by default, and they pass no gradient. From the key flags alone (no `L x L`): with
    padding, a query sees nothing when no key is valid or, under `causal`, when its first valid key lies after it and
    no valid key is a source key."""
    if mask.key_is_valid is None:
        return None
    keys = mask.key_is_valid.shape[1]
    first_valid = torch.where(mask.key_is_valid, torch.arange(keys, device=mask.key_is_valid.device), keys).amin(1)
    if not mask.causal:
        return (first_valid == keys)[:, None].expand(-1, query_position.shape[0])
    nothing = first_valid[:, None] > query_position[None, :]
    if mask.key_is_source is not None:
        nothing = nothing & ~(mask.key_is_valid & mask.key_is_source).any(1)[:, None]
    return nothing


# --- the attention in standard operations ---------------------------------------------------------------------


def gather_attention(query, key, value, table, problem: AttentionProblem) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NEZHA attention with `L x L` scores per head: the key term gathered from `q @ T^T`, the value term summed
    into `2K + 1` buckets. Returns `(output [batch, queries, heads, head_size], probabilities [batch, heads, queries,
    keys], lse [batch, heads, queries])`; a row that sees no key gives 0 (lse -inf)."""
    query_length, key_length = query.shape[-2], key.shape[-2]
    mask = problem.mask
    positions = query_positions(query_length, mask.query_offset, query.device)
    key_position = torch.arange(key_length, device=query.device)
    index = relative_position_index(positions, key_position, max_relative_position(table))
    index = index.expand(*query.shape[:2], query_length, key_length)
    scores = torch.matmul(query, key.transpose(-1, -2))
    scores = scores + torch.matmul(query, table.T).gather(-1, index)
    scores = scores * problem.scaling
    allowed = visible_keys(mask, positions, key_position)
    if allowed is not None:
        allowed = allowed[:, None]  # every head alike
        # Masked scores become the dtype's minimum, as in transformers 4.x (whose rows that see no key then
        # average uniformly; here those rows are set to 0 below).
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    probs = nn.functional.softmax(scores, dim=-1)
    lse = torch.logsumexp(scores, dim=-1)
    nothing = sees_nothing(mask, positions)
    if nothing is not None:
        probs = probs.masked_fill(nothing[:, None, :, None], 0.0)
        lse = lse.masked_fill(nothing[:, None], float("-inf"))
    probs = nn.functional.dropout(probs, p=problem.dropout, training=problem.dropout > 0)
    bucket_mass = probs.new_zeros(*probs.shape[:-1], table.shape[0]).scatter_add(-1, index, probs)
    output = torch.matmul(probs, value) + torch.matmul(bucket_mass, table)
    return output.transpose(1, 2).contiguous(), probs, lse


# --- engines as torch.library ops -----------------------------------------------------------------------------

TENSOR_ARGUMENTS = ("query", "key", "value", "table")
_SCHEMA_TYPES = {float: "float", bool: "bool", torch.Tensor: "Tensor", torch.Tensor | None: "Tensor?",
                 int | torch.Tensor: "Tensor"}


def _flat_fields(cls=AttentionProblem) -> list[tuple[str, str, tuple[str, ...]]]:
    """`(name, schema type, path)` of every leaf field of `cls`, nested dataclasses flattened, in declaration order."""
    leaves = []
    for field in dataclasses.fields(cls):
        kind = typing.get_type_hints(cls)[field.name]
        if dataclasses.is_dataclass(kind):
            leaves += [(name, schema, (field.name, *path)) for name, schema, path in _flat_fields(kind)]
        else:
            leaves.append((field.name, _SCHEMA_TYPES[kind], (field.name,)))
    return leaves


PROBLEM_FIELDS = _flat_fields()
PROBLEM_SCHEMA = ", ".join(f"{schema} {name}" for name, schema, _ in PROBLEM_FIELDS)


def _field_values(problem: AttentionProblem) -> list:
    """The problem's leaf fields (`PROBLEM_FIELDS`) as they are (plain attribute reads: torch.compile traces them)."""
    values = []
    for _, _, path in PROBLEM_FIELDS:
        value = problem
        for name in path:
            value = getattr(value, name)
        values.append(value)
    return values


# The problem's leaf fields that may hold a tensor, read in one C call: what `_needs_dispatcher` checks of a call.
_tensor_field_values = operator.attrgetter(*(".".join(path) for _, schema, path in PROBLEM_FIELDS
                                             if "Tensor" in schema))


def flatten(problem: AttentionProblem, device: torch.device | None = None) -> list:
    """The problem as the ops' flat arguments (`PROBLEM_FIELDS`): offsets and seeds as tensors, those made from an int
    or None on `device` (the CPU's when None)."""
    values = []
    for (_, schema, _), value in zip(PROBLEM_FIELDS, _field_values(problem)):
        if schema == "Tensor" and not isinstance(value, torch.Tensor):  # an int offset, or no seed
            # `torch.tensor`, not `as_tensor`: under torch.export an offset is a symbolic size (the cache length),
            # which `as_tensor` would freeze into a constant of the traced length.
            value = torch.tensor(0 if value is None else value, dtype=torch.int64, device=device)
        values.append(value)
    return values


def unflatten(values) -> AttentionProblem:
    """`flatten`'s inverse."""
    fields = {name: value for (name, _, _), value in zip(PROBLEM_FIELDS, values)}
    mask_fields = {field.name for field in dataclasses.fields(RelativeAttentionMask)}
    mask = RelativeAttentionMask(**{name: fields.pop(name) for name in mask_fields})
    return AttentionProblem(mask, **fields)


def _plain_forward(query, key, value, table, problem: AttentionProblem) -> tuple[torch.Tensor, torch.Tensor]:
    """An engine's forward in standard ops: `(output, lse)` (the decomposition exporters substitute)."""
    output, _, lse = gather_attention(query, key, value, table.to(query.dtype), problem)
    return output, lse.float()


_library = torch.library.Library("nezha_hf", "DEF")


def _inductor_falls_back_to(*ops) -> None:
    """Register `ops` (an engine's forward and backward) as Inductor fallbacks, once Inductor is loaded: compiled code
    calls the ops themselves. Called while tracing an engine's op, which precedes any Inductor lowering of it.

    Inductor would make the same fallback on its own (it has no lowering for the ops, and its decomposition table,
    unlike torch's global one where exporters find the forward's `L x L` decomposition, never holds them), but under
    the environment variable CI its developer check in `make_fallback` (torch/_inductor/lowering.py) raises on an
    op it falls back to while a decomposition of it is registered; a fallback registered as PyTorch registers its own
    (`warn=False`) is exempt. PyTorch has no public API for this: the one private call is here. The layout constraint
    is the one Inductor's own fallback would take (`GraphLowering.call_function`). Importing Inductor up front
    instead would add seconds to `import nezha_hf`.
    """
    lowering = sys.modules.get("torch._inductor.lowering")
    if lowering is None or ops[0] in lowering.lowerings:
        return
    from torch._library.utils import get_layout_constraint_tag

    for op in ops:
        constraint = lowering.tag_to_layout_constraint(get_layout_constraint_tag(op, with_default=True))
        lowering.make_fallback(op, layout_constraint=constraint, warn=False)


def _needs_dispatcher(device_types: str | None, *arguments) -> bool:
    """Whether an engine's call must go through its registered ops rather than straight to its functions: while
    tracing, under a Python dispatch or function mode (fake tensors, `FlopCounterMode`, `torch.device` as a context),
    inside a functorch transform (vmap, `torch.func.grad`), with a tensor subclass (DTensor) among `arguments`, or on
    a device the ops are not registered for (the ops then refuse it)."""
    return _modes_active() or _unusual_tensors(device_types, *arguments)


def _modes_active() -> bool:
    """Whether a call is traced, or runs under a Python dispatch or function mode or a functorch transform
    (`_needs_dispatcher`)."""
    return (tracing() or torch._C._len_torch_dispatch_stack() > 0 or torch._C._is_torch_function_mode_enabled()
            or torch._C._functorch.peek_interpreter_stack() is not None)


def _unusual_tensors(device_types: str | None, *arguments) -> bool:
    """Whether a tensor subclass is among `arguments`, or a tensor on a device other than `device_types`
    (`_needs_dispatcher`)."""
    tensor = torch.Tensor
    for argument in arguments:  # a loop, not a generator: this runs at every call
        if type(argument) is tensor:
            if device_types is not None and argument.device.type != device_types:
                return True
        elif isinstance(argument, tensor):  # a subclass
            return True
    return False


def _profiled_as(op: str):
    """While a profiler runs, a range named as the registered op `op` (what a trace of the dispatcher's route
    shows, so a profile reads the same on either route); otherwise nothing, at no cost."""
    return torch.profiler.record_function(op) if torch._C._autograd._profiler_enabled() else contextlib.nullcontext()


def engine_op(engine: Engine, forward: Callable, forward_fake: Callable, backward: Callable, backward_fake: Callable,
              device_types: str | None = None) -> Callable:
    """Register `engine` as the ops `nezha_hf::{engine.op_name}_forward` / `_backward`, with autograd, a fake and a
    decomposition, and return the function the attention code calls.

    The engine writes four plain functions of the tensors and an `AttentionProblem`:

        forward(query, key, value, table, problem) -> [output [batch, queries, heads, head_size], *saved]
        backward(grad_output, query, key, value, table, problem, output, *saved) -> [grad_query, grad_key, grad_value]

    (`saved`: what its backward needs besides the inputs; `grad_output` and `output` reach the backward as `[batch,
    heads, queries, head_size]` views; the gradients are `[batch, heads, length, head_size]`), and their fakes, which
    give the outputs' shapes and dtypes from the inputs' (for tracing). `device_types` limits the ops to a device type
    (the compiled CPU kernel), None for any device. A second derivative is refused with a message.

    Returns `attention(query, key, value, table, problem) -> output [batch, queries, heads, head_size]`. Called
    eagerly on plain tensors, with no mode or transform active, it runs the same functions and the same autograd rules
    as a `torch.autograd.Function`, past the dispatcher, whose Python-registered ops cost host time a GPU's short
    calls cannot hide (`benchmarks/host_overhead.py`; docs/performance.md). Anything else (tracing, fake tensors,
    `FlopCounterMode`, subclasses such as DTensor, vmap) goes through the registered ops.
    """
    name = engine.op_name
    tensors = ", ".join(f"Tensor {argument}" for argument in TENSOR_ARGUMENTS)
    _library.define(f"{name}_forward({tensors}, {PROBLEM_SCHEMA}) -> Tensor[]")
    _library.define(f"{name}_backward(Tensor grad_output, {tensors}, {PROBLEM_SCHEMA}, Tensor[] saved) -> Tensor[]")
    dispatch = {"cpu": "CPU", None: "CompositeExplicitAutograd"}[device_types]
    tensors = len(TENSOR_ARGUMENTS)

    def run_forward(query, key, value, table, *fields):
        return list(forward(query, key, value, table, unflatten(fields)))

    def run_backward(grad_output, query, key, value, table, *fields_and_saved):
        *fields, saved = fields_and_saved
        return list(backward(grad_output, query, key, value, table, unflatten(fields), *saved))

    _library.impl(f"{name}_forward", run_forward, dispatch)
    _library.impl(f"{name}_backward", run_backward, dispatch)
    forward_op = getattr(torch.ops.nezha_hf, f"{name}_forward").default
    backward_op = getattr(torch.ops.nezha_hf, f"{name}_backward").default

    def traced_forward(*args):  # the fake: what tracing (torch.compile, torch.export) runs for the forward
        _inductor_falls_back_to(forward_op, backward_op)
        return list(forward_fake(*args[:tensors], unflatten(args[tensors:])))

    torch.library.register_fake(f"nezha_hf::{name}_forward", traced_forward)
    torch.library.register_fake(
        f"nezha_hf::{name}_backward",
        lambda grad_output, *args: list(backward_fake(grad_output, *args[:tensors], unflatten(args[tensors:-1]),
                                                      *args[-1])))

    def setup_context(ctx, inputs, output):  # torch names the op's arguments `inputs`
        fields = inputs[tensors:]
        ctx.tensor_fields = [i for i, value in enumerate(fields) if isinstance(value, torch.Tensor)]
        ctx.fields = list(fields)  # the tensors among them are replaced by the saved ones in the backward
        ctx.save_for_backward(*inputs[:tensors], *(fields[i] for i in ctx.tensor_fields), *output)

    def backward_step(ctx, grads):  # of [output, *saved]: nothing flows back through the saved statistics
        grad_output, saved = grads[0], ctx.saved_tensors
        fields = list(ctx.fields)
        for position, tensor in zip(ctx.tensor_fields, saved[tensors:]):
            fields[position] = tensor
        output, *statistics = saved[tensors + len(ctx.tensor_fields):]
        arguments = (grad_output.transpose(1, 2), *saved[:tensors], *fields, [output.transpose(1, 2), *statistics])
        # The registered op where it is needed: a second derivative asked for (its autograd refuses one), tracing.
        direct = not torch.is_grad_enabled() and not _needs_dispatcher(device_types, *arguments[:-1], *arguments[-1])
        if direct:
            with _profiled_as(backward_op.name()):
                grads = run_backward(*arguments)
        else:
            grads = backward_op(*arguments)
        return (*grads, None, *([None] * len(fields)))  # nothing for the table or the problem

    class DirectAttention(torch.autograd.Function):
        """The op's forward and autograd rules, for eager calls (see `_needs_dispatcher`): the problem is kept as it
        is (no fields flattened into tensors), and the backward gets it as the forward did."""

        @staticmethod
        def forward(ctx, problem, *inputs):  # with `ctx`, not a `setup_context`: `apply` binds no signature per call
            output = forward(*inputs, problem)
            ctx.problem = problem
            ctx.save_for_backward(*inputs, *output)
            ctx.mark_non_differentiable(*output[1:])
            return tuple(output)

        @staticmethod
        def backward(ctx, *grads):
            saved = ctx.saved_tensors
            output, *statistics = saved[tensors:]
            arguments = (grads[0].transpose(1, 2), *saved[:tensors])
            outputs = [output.transpose(1, 2), *statistics]
            # The registered op where it is needed: a second derivative asked for (its autograd refuses one), modes.
            if torch.is_grad_enabled() or _needs_dispatcher(device_types, *arguments, *outputs,
                                                            *_field_values(ctx.problem)):
                result = backward_op(*arguments, *flatten(ctx.problem), outputs)
            else:
                with _profiled_as(backward_op.name()):
                    result = backward(*arguments, ctx.problem, *outputs)
            return None, *result, None  # nothing for the problem or the table

    def no_double_backward(ctx, *grads):
        raise RuntimeError(
            f"NEZHA's {name} attention has no second derivative (e.g. a gradient penalty with create_graph=True): "
            'use attn_implementation="eager" for that.'
        )

    torch.library.register_autograd(f"nezha_hf::{name}_forward", backward_step, setup_context=setup_context)
    torch.library.register_autograd(f"nezha_hf::{name}_backward", no_double_backward)

    @torch._decomp.register_decomposition(forward_op)
    def decomposed(query, key, value, table, *fields):  # what an exported graph computes: the output (no backward)
        # Tracing with symbolic sizes runs this, not the fake, for the output's shape (FakeTensorMode prefers a
        # decomposition of the global table there): Inductor may be about to lower the op.
        _inductor_falls_back_to(forward_op, backward_op)
        problem = unflatten(fields)
        output, _ = _plain_forward(query, key, value, table, problem)
        # Zeros made functionally: exporters refuse a graph that writes into a tensor it made (`zero_`).
        return [output, *(torch.zeros_like(saved) for saved in forward_fake(query, key, value, table, problem)[1:])]

    def direct(query, key, value, table, problem: AttentionProblem) -> torch.Tensor:
        if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad
                                        or table.requires_grad):
            return DirectAttention.apply(problem, query, key, value, table)[0]
        return forward(query, key, value, table, problem)[0]

    forward_name = forward_op.name()

    def attention(query, key, value, table, problem: AttentionProblem) -> torch.Tensor:
        # `_needs_dispatcher`, the modes first: a traced call reads its fields by `flatten`'s plain attribute reads
        if _modes_active() or _unusual_tensors(device_types, query, key, value, table, *_tensor_field_values(problem)):
            # Traced, the tensors made of ints go to the queries' device: a compiled graph that makes one on the CPU
            # is not captured by CUDA graphs.
            return forward_op(query, key, value, table, *flatten(problem, query.device if tracing() else None))[0]
        if torch._C._autograd._profiler_enabled():  # a range named as the registered op's (`_profiled_as`)
            with _profiled_as(forward_name):
                return direct(query, key, value, table, problem)
        return direct(query, key, value, table, problem)

    attention.forward_op, attention.backward_op = forward_op, backward_op
    return attention


__all__ = [
    "AttentionProblem",
    "Engine",
    "EngineUnavailable",
    "RelativeAttentionMask",
    "engine_op",
    "fallback_words",
    "gather_attention",
    "max_relative_position",
    "query_positions",
    "relative_position_index",
    "sees_nothing",
    "sinusoid_frequencies",
    "sinusoid_relative_table",
    "tracing",
    "values_known",
    "visible_keys",
]
