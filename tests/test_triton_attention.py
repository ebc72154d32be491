"""The Triton engine, run on CPU tensors under Triton's interpreter (`TRITON_INTERPRET=1`): forward and gradients
against the float64 reference across block edges (the interpreter's blocks are 16) and the band (K = 4, and K
beyond the length), tiles of every class (left tail, band, right tail) in one call with every mask kind, a KV
cache's offset (an int, or a tensor never read on the host), a decoding step split over programs, dropout (Philox on
32-bit counters, checked against an independent Philox; its mask the same in the backward, kept entries scaled by
1 / (1 - p)), bfloat16 / float16, float32 in IEEE products whatever the TF32 switches; in a model, with `generate`;
launch grids for any number of heads; an out-of-memory error raised as itself; the chunked engine with one warning
where Triton is missing or a kernel fails to compile, for that kernel's switches only. And, in a process where Triton
compiles, the kernels compiled ahead of time for an H100 (no GPU needed). Small sizes: the interpreter runs a block in
numpy."""

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import reference
import torch
from helpers import tiny_config

from nezha_hf import NezhaForUniLM, NezhaModel
from nezha_hf import relative_attention as ra
from nezha_hf import triton_attention as ta
from nezha_hf.attention_ops import AttentionProblem, RelativeAttentionMask

triton = pytest.importorskip("triton", reason="Triton is part of the dev install (`[triton]`)")
tl = triton.language
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def interpreted(monkeypatch):
    """Triton's interpreter (conftest.py sets TRITON_INTERPRET=1 before anything imports Triton); no earlier failure,
    and no backward checked yet."""
    from nezha_hf import triton_kernels

    assert triton_kernels.INTERPRETING, "TRITON_INTERPRET=1 was not set when Triton was imported"
    monkeypatch.setattr(ta, "_set_aside", {})
    monkeypatch.setattr(ta, "_checked_backwards", set())


def run(q, k, v, K, mask=RelativeAttentionMask(), dropout=0.0, seed=0, table=None):
    """The Triton op on float tensors `[batch, heads, length, d]`; returns `[batch, heads, queries, d]`."""
    table = ra.sinusoid_relative_table(K, q.shape[-1]) if table is None else table
    table = table.to(q.dtype)
    problem = AttentionProblem(mask, q.shape[-1] ** -0.5, dropout, torch.tensor(seed))
    return ta.triton_attention(q, k, v, table, problem).transpose(1, 2)


def inputs(batch, heads, queries, keys, d, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, length, d, dtype=torch.float64, generator=generator)
            for length in (queries, keys, keys)]


def compare(q64, k64, v64, K, mask, allowed, offset=0, dtype=torch.float32, atol=2e-5, keep=None, dropout=0.0,
            seed=0, table=None):
    """The Triton op in `dtype` against the reference in float64, output and the three gradients. `offset` is the
    queries' first position (an int, or a tensor given to the op as it is); `table` a float64 table (the sinusoid when
    None)."""
    leaves = [t.to(dtype).requires_grad_() for t in (q64, k64, v64)]
    got = run(*leaves, K, dataclasses.replace(mask, query_offset=offset), dropout, seed, table)
    exact = [t.clone().requires_grad_() for t in (q64, k64, v64)]
    expected, _ = reference.attention(*exact, K, allowed, query_offset=int(offset), keep=keep, dropout=dropout,
                                      table=table)
    torch.testing.assert_close(got.double(), expected, atol=atol, rtol=0)
    grad = torch.randn(expected.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    mine = torch.autograd.grad(got, leaves, grad.to(dtype))
    theirs = torch.autograd.grad(expected, exact, grad)
    for name, a, b in zip("qkv", mine, theirs):
        torch.testing.assert_close(a.double(), b, atol=atol * 4, rtol=0, msg=lambda text, name=name: f"d{name}: {text}")


# (batch, heads, length, d): lengths that end inside a block of 16, a head size below the 16 a block product needs.
MASKS = {
    "none": lambda valid, source: (RelativeAttentionMask(), None),
    "padding": lambda valid, source: (RelativeAttentionMask(key_is_valid=valid), dict(key_valid=valid)),
    "causal": lambda valid, source: (RelativeAttentionMask(causal=True), dict(causal=True)),
    "causal+padding": lambda valid, source: (RelativeAttentionMask(key_is_valid=valid, causal=True),
                                             dict(key_valid=valid, causal=True)),
    "unilm-prefix": lambda valid, source: (RelativeAttentionMask(key_is_valid=valid, causal=True, key_is_source=source),
                                           dict(key_valid=valid, causal=True, key_is_source=source)),
}


@pytest.mark.parametrize("K", [4, 50], ids=["K=4", "K-beyond-length"])
@pytest.mark.parametrize("kind", list(MASKS))
def test_forward_and_gradients_match_the_reference(kind, K):
    batch, heads, length, d = 2, 2, 37, 8
    q, k, v = inputs(batch, heads, length, length, d)
    valid = torch.ones(batch, length, dtype=torch.bool)
    valid[1, 30:] = False  # a padded row block
    valid[0, :3] = False  # left padding: under a causal mask the first queries see nothing
    source = torch.zeros(batch, length, dtype=torch.bool)
    source[0, :20], source[1, :9] = True, True
    mask, rules = MASKS[kind](valid, source)
    allowed = None if rules is None else reference.allowed_mask(length, **rules)
    compare(q, k, v, K, mask, allowed)


# An offset of 17: the first block of 16 queries ends at position 32, the first key of a block of 16, which a loop
# bound one short would skip.
@pytest.mark.parametrize("queries, offset", [(1, 40), (5, 28), (19, 17)], ids=["one-token", "five", "crossing-blocks"])
def test_queries_continuing_a_cache(queries, offset):
    keys, K = offset + queries, 4
    q, k, v = inputs(1, 2, queries, keys, 8, seed=queries)
    valid = torch.ones(1, keys, dtype=torch.bool)
    valid[0, :2] = False  # a left-padded prompt
    mask = RelativeAttentionMask(key_is_valid=valid, causal=True)
    allowed = reference.allowed_mask(queries, valid, causal=True, query_offset=offset, key_length=keys)
    compare(q, k, v, K, mask, allowed, offset=offset)
    # The offset read by the kernels (a tensor on the queries' device, as a static cache's) or on the host (an int; on
    # a GPU also an int made a CPU tensor by `attention_ops.flatten`): the same output.
    floats = [t.float() for t in (q, k, v)]
    in_memory = run(*floats, K, dataclasses.replace(mask, query_offset=torch.tensor(offset)))
    problem = AttentionProblem(dataclasses.replace(mask, query_offset=offset), 8**-0.5)
    on_host, _ = ta.triton_forward(*floats, ra.sinusoid_relative_table(K, 8), problem)
    torch.testing.assert_close(on_host.transpose(1, 2), in_memory, atol=0, rtol=0)


def dropout_mask(batch, heads, length, dropout, seed):
    """The keep mask the kernel draws for `seed`, read off its output: with one-hot values (`v_j = e_j`) and a zero
    table, output entry `[i, j]` is `p_ij / (1 - p)` where key j is kept and 0 where it is dropped."""
    q, k, _ = (t.float() for t in inputs(batch, heads, length, length, length, seed=7))
    one_hot = torch.eye(length).expand(batch, heads, length, length).contiguous()
    out = run(q, k, one_hot, 4, dropout=dropout, seed=seed, table=torch.zeros(9, length))
    probabilities = torch.softmax(q.double() @ k.double().transpose(-1, -2) / math.sqrt(length), -1)
    return out != 0, out.double(), probabilities


def test_dropout_keeps_one_minus_p_of_the_entries_scaled_by_its_inverse(caplog):
    """The rate runs in steps of 1/256 (8-bit draws; said once, in a warning): 0.3 runs as 77/256, and kept entries
    are scaled by 256/179, so the expectation over masks is the output without dropout."""
    dropout, steps = 0.3, 77
    with caplog.at_level("WARNING"):
        kept, out, probabilities = dropout_mask(2, 2, 40, dropout, seed=11)
    assert "a rate of 0.3 runs as 77/256" in caplog.text
    rate, draws = kept.double().mean().item(), kept.numel()
    assert abs(rate - (1 - steps / 256)) < 4 * math.sqrt(dropout * (1 - dropout) / draws), rate
    torch.testing.assert_close(out[kept], (probabilities * 256 / (256 - steps))[kept], atol=1e-6, rtol=0)
    other, _, _ = dropout_mask(2, 2, 40, dropout, seed=12)
    assert not torch.equal(kept, other), "two seeds drew the same mask"


@pytest.mark.parametrize("dropout", [0.001, 0.999])
def test_a_dropout_rate_that_rounds_to_none_or_all_is_the_next_engines(dropout):
    """A rate within half a step (1/512) of 0 or 1, but not 0 or 1, is neither dropped nor run as 0 or 1: the Triton
    engine hands the call on (`TritonKernelFailed`), so that `relative_attention` gives it to the exact engines."""
    q, k, v = inputs(1, 1, 8, 8, 8)
    with pytest.raises(ta.TritonKernelFailed, match="steps of 1/256"):
        run(q.float(), k.float(), v.float(), 4, dropout=dropout)


def test_a_seed_read_from_memory_draws_the_mask_a_seed_read_on_the_host_draws(monkeypatch):
    """A traced call's seed is a tensor on the GPU, which the kernels read from memory (`SEED_IN_MEMORY`); an eager
    call's, on the CPU, is read on the host: the same seed keeps the same pairs either way, forward and backward
    (here the kernels are made to read a CPU seed from memory)."""
    q, k, v = (t.float().requires_grad_() for t in inputs(1, 2, 40, 40, 16, seed=6))
    grad = torch.randn(1, 40, 2, 16, generator=torch.Generator().manual_seed(2))
    problem = AttentionProblem(RelativeAttentionMask(), 0.25, 0.25, torch.tensor(0x1234_5678_9ABC))
    table = ra.sinusoid_relative_table(4, 16)
    results = []
    for in_memory in (False, True):
        monkeypatch.setattr(ta, "_seed_on_device", lambda problem, in_memory=in_memory: in_memory)
        out = ta.triton_attention(q, k, v, table, problem)
        results.append([out, *torch.autograd.grad(out, (q, k, v), grad)])
    assert ta.Switches.of(q, problem).seed_on_device
    for host, memory in zip(*results):
        assert torch.equal(host, memory)
    undropped = ta.triton_attention(q, k, v, table, dataclasses.replace(problem, dropout=0.0))
    assert not torch.allclose(results[0][0], undropped)  # pairs were dropped


def test_dropout_of_one_drops_everything_forward_and_backward():
    """A rate of exactly 1 runs on the kernels (every draw below 256) and drops every pair: the output and all three
    gradients are 0, not NaN (the backward once divided `D` by `keep_scale`, which is 0 there)."""
    q, k, v = (t.float().requires_grad_() for t in inputs(1, 2, 40, 40, 16, seed=3))
    out = run(q, k, v, 4, dropout=1.0, seed=5)
    grads = torch.autograd.grad(out, (q, k, v), torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
    for tensor in (out, *grads):
        assert torch.equal(tensor, torch.zeros_like(tensor))


def test_dropout_backward_redraws_the_forward_mask(caplog):
    """The mask read off the kernel's output for a seed, given to the reference, gives the kernel's output and
    gradients for that seed: the backward used the forward's mask. A rate of whole 1/256 steps warns of nothing (nor
    does the backward's first run, on an example problem of its own)."""
    dropout, seed, length = 0.25, 5, 38  # a whole number of 1/256 steps; head size = length (even: sin and cos)
    with caplog.at_level("WARNING"):
        kept, _, _ = dropout_mask(1, 2, length, dropout, seed)
        q, k, v = inputs(1, 2, length, length, length, seed=3)
        compare(q, k, v, 4, RelativeAttentionMask(), None, keep=kept.double(), dropout=dropout, seed=seed)
    assert "steps of 1/256" not in caplog.text


@pytest.mark.parametrize("dtype, atol", [(torch.bfloat16, 4e-2), (torch.float16, 5e-3)], ids=["bfloat16", "float16"])
def test_reduced_precision_within_its_rounding(dtype, atol):
    """bfloat16 / float16 inputs, float32 accumulation: within the rounding of the inputs (bfloat16 keeps 8 bits,
    float16 11) of the float64 reference."""
    length = 37
    q, k, v = (t.to(dtype).double() for t in inputs(1, 2, length, length, 16))  # exactly representable inputs
    valid = torch.ones(1, length, dtype=torch.bool)
    valid[0, 33:] = False
    mask = RelativeAttentionMask(key_is_valid=valid, causal=True)
    compare(q, k, v, 4, mask, reference.allowed_mask(length, valid, causal=True), dtype=dtype, atol=atol)


def test_a_table_of_another_dtype_is_taken_in_the_inputs_dtype():
    """The op takes the table in any dtype (the model passes it in the inputs'): a float32 table with bfloat16 inputs
    gives what its bfloat16 rounding gives (a compiled `tl.dot` refuses operands of two dtypes)."""
    q, k, v = (t.to(torch.bfloat16) for t in inputs(1, 2, 37, 37, 16))
    table = torch.randn(9, 16, generator=torch.Generator().manual_seed(3))
    problem = AttentionProblem(RelativeAttentionMask(causal=True), 16**-0.5)
    wide = ta.triton_attention(q, k, v, table, problem)
    torch.testing.assert_close(wide, ta.triton_attention(q, k, v, table.to(torch.bfloat16), problem), atol=0, rtol=0)


def test_a_model_runs_the_triton_engine_and_matches_eager():
    config = tiny_config(max_relative_position=4)
    torch.manual_seed(0)
    model = NezhaModel(config).eval()
    ids = torch.randint(5, 99, (2, 21))
    attention_mask = torch.ones_like(ids)
    attention_mask[1, 17:] = 0
    expected = model(ids, attention_mask=attention_mask).last_hidden_state
    model.set_attn_implementation("nezha_triton")
    with ra.recorded_attention_calls() as calls:
        got = model(ids, attention_mask=attention_mask).last_hidden_state
    assert {call.ran for call in calls} == {ra.Engine.TRITON}
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=0)


def test_cached_generation_matches_eager():
    config = tiny_config(max_relative_position=4, num_hidden_layers=1)
    torch.manual_seed(0)
    model = NezhaForUniLM(config).eval()
    ids = torch.randint(5, 99, (1, 9))
    settings = dict(max_new_tokens=4, do_sample=False, num_beams=1)
    expected = model.generate(ids, **settings)
    model.set_attn_implementation("nezha_triton")
    with ra.recorded_attention_calls() as calls:
        got = model.generate(ids, **settings)
    assert torch.equal(got, expected)
    assert {call.ran for call in calls} == {ra.Engine.TRITON} and any(call.cached for call in calls)


# The factories a graph may make a tensor with: without a device they make it on the CPU.
FACTORIES = {torch.tensor, torch.zeros, torch.ones, torch.full, torch.empty, torch.arange, torch.randint, torch.rand,
             torch.randn, torch.scalar_tensor, torch.zeros_like, torch.ones_like, torch.empty_like}


def one_graph_on_the_inputs_device(model, **inputs) -> "torch.fx.GraphModule":
    """`model(**inputs)` traced by torch.compile: one graph, no break (`torch._dynamo.explain`), in which every tensor
    the graph makes is made on a device it names (one made on the CPU by default would keep a GPU's compiled graph
    from CUDA graphs, mode="reduce-overhead"), and the Triton engine's op is called; returns the graph."""
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(model)(**inputs)
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), explanation.break_reasons
    graph = explanation.graphs[0]
    made = [node for node in graph.graph.nodes if node.op == "call_function" and node.target in FACTORIES]
    assert made and all("device" in node.kwargs for node in made), [(node.target, node.kwargs) for node in made]
    assert not [node for node in graph.graph.nodes if node.op == "get_attr"], "a tensor constant of the graph's own"
    assert any("nezha_hf.triton_forward" in str(node.target) for node in graph.graph.nodes)
    return graph


def test_a_compiled_training_step_and_decoding_step_are_one_graph_made_for_cuda_graphs():
    """A training step (dropout, padding: the seed drawn in the graph, on the queries' device, where the kernels
    read it) and a decoding step on transformers' static cache (the offset a tensor the kernels read) compile to one
    graph each with nothing on the CPU by default (`one_graph_on_the_inputs_device`); the compiled training step's
    backward runs the Triton op's and matches eager's (dropout 0 there, so the two can be compared)."""
    from transformers import StaticCache

    torch.manual_seed(0)
    model = NezhaForUniLM(tiny_config(num_hidden_layers=1, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1))
    model.set_attn_implementation("nezha_triton")
    ids = torch.randint(5, 99, (2, 24), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 17:] = 0
    graph = one_graph_on_the_inputs_device(model.train(), input_ids=ids, attention_mask=mask)
    seeds = [node for node in graph.graph.nodes if node.target is torch.randint]
    assert seeds and all(node.kwargs["device"] == ids.device for node in seeds)

    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    grads = []
    for run in (compiled, model):
        model.zero_grad()
        run(input_ids=ids, attention_mask=mask).logits.float().pow(2).mean().backward()
        grads.append(model.nezha.encoder.layer[0].attention.self.query.weight.grad.clone())
    torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=1e-4)

    model.eval()
    cache = StaticCache(config=model.config, max_cache_len=32)
    with torch.no_grad():
        prefill = model(input_ids=ids[:, :12], attention_mask=mask[:, :12], past_key_values=cache, use_cache=True,
                        cache_position=torch.arange(12))
        step = dict(input_ids=prefill.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True,
                    attention_mask=torch.cat([mask[:, :12], torch.ones(2, 20, dtype=mask.dtype)], 1),
                    cache_position=torch.tensor([12]))
        one_graph_on_the_inputs_device(model, **step)
    torch._dynamo.reset()


def test_without_triton_one_warning_and_the_chunked_engine(monkeypatch):
    monkeypatch.setattr(ta, "triton_installed", lambda: False)
    q, k, v = (t.float() for t in inputs(1, 2, 20, 20, 8))
    warnings = []
    monkeypatch.setattr(ta.logger, "warning_once", lambda message: warnings.append(message))
    situation_calls = []
    for _ in range(2):
        with ra.recorded_attention_calls() as calls:
            out, _ = ra.relative_attention(torch.nn.Module().eval(), q, k, v, None, 8**-0.5,
                                           relative_table=ra.sinusoid_relative_table(4, 8),
                                           requested=ra.Engine.TRITON)
        situation_calls += calls
    assert {call.ran for call in situation_calls} == {ra.Engine.CHUNKED}
    assert "Triton is not installed" in situation_calls[0].why
    assert warnings and all("pip install triton" in message for message in warnings)
    expected, _ = reference.attention(q.double(), k.double(), v.double(), 4)
    torch.testing.assert_close(out.transpose(1, 2).double(), expected, atol=2e-5, rtol=0)


@pytest.mark.parametrize("kernel", ["nezha_forward_kernel", "nezha_query_grad_kernel"])
def test_a_kernel_that_fails_to_compile_is_one_warning_and_the_chunked_engine(kernel, monkeypatch, caplog):
    """A forward that fails falls back at once; a backward that would fail is found before the forward that needs
    it (on a small problem), so training falls back too instead of failing in `backward()`."""
    from nezha_hf import triton_kernels

    class Broken:  # fails to compile: at its launch and at Triton's compile-only warmup alike
        arg_names = getattr(triton_kernels, kernel).arg_names

        def __getitem__(self, grid):
            return self.warmup

        def warmup(self, *args, **kwargs):
            raise RuntimeError("PTX assembly aborted (simulated)")

    monkeypatch.setattr(triton_kernels, kernel, Broken())
    leaves = [t.float().requires_grad_() for t in inputs(1, 2, 20, 20, 8)]
    module = torch.nn.Module().eval()
    with caplog.at_level("WARNING", logger="nezha_hf"), ra.recorded_attention_calls() as calls:
        for _ in range(2):
            out, _ = ra.relative_attention(module, *leaves, None, 8**-0.5, relative_table=ra.sinusoid_relative_table(4, 8),
                                           requested=ra.Engine.TRITON)
            out.sum().backward()
    assert {call.ran for call in calls} == {ra.Engine.CHUNKED}
    assert all("PTX assembly aborted" in call.why for call in calls)
    messages = [record.getMessage() for record in caplog.records if "Triton kernel failed" in record.getMessage()]
    assert len(messages) == 1, messages
    expected, _ = reference.attention(*(t.detach().double() for t in leaves), 4)
    torch.testing.assert_close(out.transpose(1, 2).double(), expected, atol=2e-5, rtol=0)


def test_on_the_cpu_only_by_name_under_the_interpreter(monkeypatch):
    """Interpreted kernels are for testing: never what another engine falls back to on the CPU."""
    assert ta.unusable_reason("cpu", named=True) is None
    assert "by name" in ta.unusable_reason("cpu", named=False)
    assert "mps" in ta.unusable_reason("mps")
    monkeypatch.delenv("TRITON_INTERPRET")
    assert "CUDA" in ta.unusable_reason("cpu", named=True)
    q, k, v = (t.float() for t in inputs(1, 2, 20, 20, 8))
    with ra.recorded_attention_calls() as calls:
        ra.relative_attention(torch.nn.Module().eval(), q, k, v, None, 8**-0.5,
                              relative_table=ra.sinusoid_relative_table(4, 8), requested=ra.Engine.TRITON)
    assert calls[0].ran is ra.Engine.CHUNKED and "CUDA" in calls[0].why


def test_tuning_is_keyed_on_length_classes_and_a_decoding_step_gets_small_blocks(monkeypatch):
    """A decoding loop's key length grows by one per step: keyed on the length itself, the forward would be tuned
    again at every step. A decoding step is tuned over blocks of 16 queries, a long call over the larger blocks, a
    float32 call over float32's own blocks; with dropout, only blocks of whole 32 keys (its draws' groups) and, in
    the backward, none that spills its draws (`BACKWARD_PRUNING`), unless pinned alone."""
    from nezha_hf import triton_kernels as tk

    assert [tk.length_class(n) for n in (1, 16, 17, 1000, 1024, 1025)] == [16, 16, 32, 1024, 1024, 2048]
    float32 = [triton.Config({"BLOCK_M": 16, "BLOCK_N": 32}), triton.Config({"BLOCK_M": 32, "BLOCK_N": 16})]
    monkeypatch.setattr(tk, "FLOAT32_CONFIGS", float32)
    configs = [*(triton.Config({"BLOCK_M": block_m, "BLOCK_N": 128}) for block_m in (16, 64, 128)), *float32]

    def tuned(queries, named=True, ieee=False, dropout=False):  # the launches name their arguments, or not
        arguments = {"LQ_CLASS": queries, "IEEE": ieee, "DROPOUT": dropout}
        pruned = tk._configs_for(configs, arguments) if named else tk._configs_for(configs, {}, **arguments)
        return [(config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]) for config in pruned]

    for named in (True, False):
        assert tuned(16, named) == tuned(32, named) == [(16, 128)]
        assert tuned(64, named) == [(64, 128)] and tuned(4096, named) == [(64, 128), (128, 128)]
        assert tuned(16, named, ieee=True) == [(16, 32)] and tuned(4096, named, ieee=True) == [(32, 16)]
        assert tuned(4096, named, ieee=True, dropout=True) == [(16, 32)]
        assert tuned(4096, named, dropout=True) == [(64, 128), (128, 128)]
    # a block that spills dropout's draws is not tuned under dropout, but runs where it is the one pinned
    spilling = [triton.Config({"BLOCK_M": 128, "BLOCK_N": 128})]
    arguments = {"LQ_CLASS": 4096, "IEEE": False, "DROPOUT": True}
    pruned = tk._configs_for(configs, arguments, spilling_under_dropout=spilling)
    assert [(config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]) for config in pruned] == [(64, 128)]
    assert tk._configs_for(configs[2:3], arguments, spilling_under_dropout=spilling) == configs[2:3]
    assert tk.BACKWARD_PRUNING["early_config_prune"].keywords["spilling_under_dropout"] == tk.SPILLING_UNDER_DROPOUT


# --- tiles by class, dropout's counters, launches, failures, float32, decoding (issue 47) ---------------------------


def tile_classes(queries, keys, K, block=16, offset=0):
    """The classes of a call's (query block, key block) tiles, from their pairs of positions: "left" where every pair
    has j - i <= -K (all at table row 0), "right" where every pair has j - i >= K (row 2K), else "band"."""
    classes = set()
    for m0 in range(0, queries, block):
        for n0 in range(0, keys, block):
            i = torch.arange(m0, min(m0 + block, queries))[:, None] + offset
            distance = torch.arange(n0, min(n0 + block, keys))[None, :] - i
            classes.add("left" if (distance <= -K).all() else "right" if (distance >= K).all() else "band")
    return classes


@pytest.mark.parametrize("K", [1, 20])
@pytest.mark.parametrize("kind", list(MASKS))
def test_every_tile_class_against_the_reference(kind, K):
    """Tail tiles (a plain flash-attention tile with one table row), band tiles (a row per distance, clipped inside the
    tile when K is small) and tiles cut by the length, padding, causal and prefix masks, all in one call; a random
    table, so that every row used is told apart."""
    batch, heads, length, d = 2, 2, 70, 16
    assert tile_classes(length, length, K) == {"left", "band", "right"}
    q, k, v = inputs(batch, heads, length, length, d, seed=K)
    table = torch.randn(2 * K + 1, d, dtype=torch.float64, generator=torch.Generator().manual_seed(K))
    valid = torch.ones(batch, length, dtype=torch.bool)
    valid[0, 49:] = False  # right padding: the last valid key starts a block, whole blocks after it
    valid[1, :20] = False  # left padding: whole key blocks before the first
    valid[1, 40] = False  # a padded key inside a block
    source = torch.zeros(batch, length, dtype=torch.bool)
    source[0, :35], source[1, :55] = True, True  # prefixes ending inside a block
    mask, rules = MASKS[kind](valid, source)
    allowed = None if rules is None else reference.allowed_mask(length, **rules)
    compare(q, k, v, K, mask, allowed, table=table)


@pytest.mark.parametrize("kind", ["padding", "causal+padding", "unilm-prefix"])
def test_tails_of_keys_in_one_run_and_with_gaps_against_the_reference(kind):
    """Where a sequence's valid keys (and its valid source keys) are one run, as padding on either side leaves them,
    a tail's blocks wholly inside run unmasked and only the blocks its ends cut are masked; where a mask has a gap
    (a key inside a tail masked, a source key missing), every tail block is masked; and in the backward, a key block
    wholly inside the run takes its tails unmasked. Long tails (150 tokens, K = 4, blocks of 32 keys) so that each
    path runs whole blocks."""
    batch, heads, length, d, K = 3, 2, 150, 16, 4
    q, k, v = inputs(batch, heads, length, length, d, seed=9)
    valid = torch.ones(batch, length, dtype=torch.bool)
    valid[0, 131:] = False  # right padding: one run, its end inside a block
    valid[1, :45] = False  # left padding: one run, its first key inside a block
    valid[2, 70] = False  # a gap, far from the band of most queries
    source = torch.zeros(batch, length, dtype=torch.bool)
    source[0, :100], source[1, 45:120], source[2, :90] = True, True, True
    source[1, 80] = False  # a gap among the source keys
    mask, rules = MASKS[kind](valid, source)
    assert ta._key_bounds(mask, k)[:, 3].tolist() == ([1, 0, 0] if kind == "unilm-prefix" else [1, 1, 0])
    compare(q, k, v, K, mask, reference.allowed_mask(length, **rules), table=reference.relative_table(K, d))


def philox4x32(key: int, counters, rounds: int = 10):
    """Philox4x32 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", 2011) in numpy: the four 32-bit
    outputs for four 32-bit counter words and a 64-bit key (low word first), after `rounds` rounds."""
    import numpy as np

    low = np.uint64(0xFFFFFFFF)
    c0, c1, c2, c3 = (np.asarray(word, dtype=np.uint64) for word in counters)
    k0, k1 = np.uint64(key & 0xFFFFFFFF), np.uint64(key >> 32)
    for _ in range(rounds):
        product0, product1 = np.uint64(0xD2511F53) * c0, np.uint64(0xCD9E8D57) * c2
        c0, c1, c2, c3 = ((product1 >> np.uint64(32)) ^ c1 ^ k0, product1 & low,
                          (product0 >> np.uint64(32)) ^ c3 ^ k1, product0 & low)
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & low, (k1 + np.uint64(0xBB67AE85)) & low
    return c0, c1, c2, c3


@pytest.mark.parametrize("queries, keys", [(40, 70), (1, 150)], ids=["square", "decoding"])
def test_dropout_keeps_by_philox_on_32_bit_counters(queries, keys):
    """FlashAttention-2's rule, as the kernels' docstring gives it: query i and key j of head h are dropped when byte
    2 (k mod 2) + e of output 2 (i div 8 mod 2) + k div 2 of Philox4x32-7, keyed by the seed, on the counter
    (8 (i div 16) + i mod 8, 4 (j div 32) + (j mod 8) div 2, h, 0) is below round(256 p), for k = (j div 8) mod 4 and
    e = j mod 2. Every counter word stays below 2^32 for any realistic size, so nothing overflows. The mask is read off
    the kernel's output (one-hot values, a zero table); the decoding call splits its keys over several programs and
    must draw the same numbers."""
    import numpy as np

    batch, heads, dropout, seed = 2, 2, 0.3, (5 << 40) + 12345  # a seed with both 32-bit halves set
    q, k, _ = (t.float() for t in inputs(batch, heads, queries, keys, keys, seed=3))
    values = torch.eye(keys).expand(batch, heads, keys, keys).contiguous()
    kept = run(q, k, values, 4, dropout=dropout, seed=seed, table=torch.zeros(9, keys)) != 0
    i, j, head = np.meshgrid(np.arange(queries), np.arange(keys), np.arange(batch * heads), indexing="ij")
    expected = torch.from_numpy(rule_keeps(seed, head, i, j, round(256 * dropout)))
    assert torch.equal(kept, expected.permute(2, 0, 1).reshape(batch, heads, queries, keys))


def rule_keeps(seed: int, head, i, j, threshold: int):
    """Whether dropout keeps query `i`, key `j` of head `head` (numpy arrays, broadcast), by the rule the test above
    states."""
    import numpy as np

    eighth, odd = (j // 8) % 4, j % 2
    outputs = philox4x32(seed, (8 * (i // 16) + i % 8, 4 * (j // 32) + (j % 8) // 2, head, np.zeros_like(i)), rounds=7)
    word = np.choose(2 * ((i // 8) % 2) + eighth // 2, outputs)
    draw = (word >> (8 * (2 * (eighth % 2) + odd)).astype(np.uint64)) & np.uint64(0xFF)
    return draw >= threshold


from nezha_hf import triton_kernels as kernels  # noqa: E402 - Triton's helpers, for the kernels below


@triton.jit
def _bytes_compared(Out, threshold):
    value = tl.arange(0, 256).to(tl.uint32)  # byte k of a word: (value + 61 k) mod 256
    word = value | (value + 61) % 256 << 8 | (value + 122) % 256 << 16 | (value + 183) % 256 << 24
    tl.store(Out + tl.arange(0, 256), kernels._bytes_at_least(word, threshold).to(tl.int32, bitcast=True))


@triton.jit
def _keys_by_queries(Out, seed, head, m0, n0, threshold, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    kept = kernels._kept_by_keys(seed, head, m0, n0, threshold, BLOCK_M, BLOCK_N)
    tl.store(Out + tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :], kept.to(tl.int8))


def test_dk_dv_tiles_draw_the_rule_at_every_tuned_block():
    """dK/dV's tiles hold keys by queries: their draws are compared four bytes at once (every byte value against every
    threshold, each byte of a word on its own) and moved as bits; the mask they make is the rule's, transposed, for
    every tuned dK/dV block, float32's included (the interpreter's tests run only its block of 16 x 32), and a tile
    away from the start."""
    import numpy as np

    value = np.arange(256)
    for threshold in range(1, 256):
        out = torch.zeros(256, dtype=torch.int32)
        _bytes_compared[(1,)](out, threshold)
        got = out.numpy().view(np.uint32)
        expected = sum(((value + 61 * k) % 256 >= threshold).astype(np.uint32) << (8 * k + 7) for k in range(4))
        assert np.array_equal(got, expected), threshold
    seed = (5 << 40) + 12345
    for block_m, block_n in [(16, 32), (64, 128), (32, 128), (64, 64), (32, 32)]:
        for m0, n0, head, threshold in [(0, 0, 0, 77), (3 * block_m, 5 * block_n, 7, 26)]:
            out = torch.zeros(block_n, block_m, dtype=torch.int8)
            _keys_by_queries[(1,)](out, seed, head, m0, n0, threshold, BLOCK_M=block_m, BLOCK_N=block_n)
            j, i = np.meshgrid(n0 + np.arange(block_n), m0 + np.arange(block_m), indexing="ij")
            expected = rule_keeps(seed, np.full_like(i, head), i, j, threshold)
            assert np.array_equal(out.numpy() != 0, expected), (block_m, block_n, m0, n0)


class Launches:
    """Stands in for kernel `real`: records each launch's grid (and keyword switches) and runs the real kernel (or
    nothing, unless `run`), or raises `error` when the switches match `failing_when`; the same for a warmup (Triton's
    compile-only launch), recorded in `warmups`."""

    def __init__(self, real, error=None, failing_when=None, run=True):
        self.real, self.error, self.failing_when, self.run = real, error, failing_when or {}, run
        self.launches, self.warmups, self.arg_names = [], [], real.arg_names  # the parameters the launcher passes

    def _fails(self, kwargs) -> bool:
        return self.error is not None and all(kwargs.get(name) == value for name, value in self.failing_when.items())

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((grid, kwargs))
            if self._fails(kwargs):
                raise self.error
            if self.run:
                return self.real[grid](*args, **kwargs)

        return launch

    def warmup(self, *args, grid, **kwargs):
        self.warmups.append((grid, kwargs))
        if self._fails(kwargs):
            raise self.error
        if self.run:
            return self.real.warmup(*args, grid=grid, **kwargs)


def programs(grid, arguments: dict):
    """The grid of a launch with `arguments` as a tuple (a callable grid is given them and the interpreter's blocks,
    as Triton gives it a launch's arguments and its configuration's)."""
    return tuple(grid({"BLOCK_M": 16, "BLOCK_N": 16, **arguments})) if callable(grid) else tuple(grid)


def described(arguments: dict) -> dict:
    """A launch's arguments as Triton's JIT specialises on them: tensors by dtype, shape and strides, others by value."""
    return {name: (value.dtype, value.shape, value.stride()) if isinstance(value, torch.Tensor) else value
            for name, value in arguments.items()}


def test_the_backward_check_compiles_the_kernels_the_backward_launches(monkeypatch):
    """Before the first forward that needs gradients, the kernels its backward will launch are compiled (Triton's
    warmup, through the backward's own launchers) with the arguments the backward then launches them with: the call's
    table (the exact sinusoid, so the band by rotation) and K, its dtype and switches (padding, causal, dropout with
    a 64-bit seed), its lengths and strides, the same grids; once per kind of call, not per call."""
    from nezha_hf import triton_kernels as tk

    names = ("nezha_row_statistics_kernel", *BACKWARD_KERNELS)
    recorders = {name: Launches(real=getattr(tk, name)) for name in names}
    for name, recorder in recorders.items():
        monkeypatch.setattr(tk, name, recorder)
    batch, heads, length, d = 2, 2, 40, 16
    q, k, v = (t.to(torch.bfloat16).requires_grad_() for t in inputs(batch, heads, length, length, d))
    valid = torch.ones(batch, length, dtype=torch.bool)
    valid[1, 31:] = False
    problem = AttentionProblem(RelativeAttentionMask(key_is_valid=valid, causal=True), d**-0.5, 0.25,
                               torch.tensor(0x1234_5678_9ABC_DEF1))
    table = ra.sinusoid_relative_table(20, d).to(torch.bfloat16)
    for _ in range(2):
        out = ta.triton_attention(q, k, v, table, problem)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(out.dtype))
    for name, recorder in recorders.items():
        assert len(recorder.warmups) == 1 and len(recorder.launches) == 2, name
        (grid, arguments), = recorder.warmups
        assert arguments["ROTATE"] and arguments["K"] == 20
        assert name not in BACKWARD_KERNELS or arguments["seed"] == 0x1234_5678_9ABC_DEF1
        for launched_grid, launched in recorder.launches:
            assert described(launched) == described(arguments), name
            assert programs(launched_grid, launched) == programs(grid, arguments), name


def test_a_masks_flags_are_made_once_per_mask_and_again_when_it_changes_or_in_a_cuda_graph(monkeypatch):
    """The kernels' key flags and bounds of a mask (and the table in the queries' dtype) are made once per mask tensor
    and reused by later calls with it (a model's layers and their backward share one mask): again after the mask
    changes in place (its version), for another mask, and at every call while a CUDA graph is being captured (the
    graph must make them from its inputs at each replay); the outputs stay the reference's."""
    made = []
    mask_tensors = ta._mask_tensors
    monkeypatch.setattr(ta, "_mask_tensors", lambda *args: made.append(1) or mask_tensors(*args))
    q, k, v = inputs(1, 2, 20, 20, 8, seed=4)
    valid = torch.ones(1, 20, dtype=torch.bool)
    valid[0, 15:] = False
    for _ in range(3):
        compare(q, k, v, 4, RelativeAttentionMask(key_is_valid=valid), reference.allowed_mask(20, valid))
    assert len(made) == 1, made
    valid[0, 12:] = False  # in place: its version changes
    compare(q, k, v, 4, RelativeAttentionMask(key_is_valid=valid), reference.allowed_mask(20, valid))
    assert len(made) == 2
    other = valid.clone()
    compare(q, k, v, 4, RelativeAttentionMask(key_is_valid=other), reference.allowed_mask(20, other))
    assert len(made) == 3
    monkeypatch.setattr(ta, "_capturing", lambda device: True)
    compare(q, k, v, 4, RelativeAttentionMask(key_is_valid=other), reference.allowed_mask(20, other))
    assert len(made) == 5  # the forward's and the backward's


def test_launch_grids_hold_any_number_of_heads(monkeypatch):
    """CUDA allows at most 65,535 programs on a grid's second and third axes: batch x heads = 70,000 must not sit
    there (the launches are recorded, not run). And the kernels run on the tensors' GPU, not the current one."""
    from nezha_hf import triton_kernels

    launchers = {name: Launches(getattr(triton_kernels, name), run=False)
                 for name in ("nezha_forward_kernel", "nezha_row_statistics_kernel", "nezha_key_value_grad_kernel",
                              "nezha_query_grad_kernel", "nezha_merge_kernel")}
    for name, launcher in launchers.items():
        monkeypatch.setattr(triton_kernels, name, launcher, raising=False)
    batch, heads, length, d = 2, 35_000, 20, 8
    q = torch.zeros(1, 1, length, d).expand(batch, heads, length, d)
    table = ra.sinusoid_relative_table(4, d)
    problem = AttentionProblem(RelativeAttentionMask(causal=True), d**-0.5)
    output, lse = ta.triton_forward(q, q, q, table, problem)
    ta.triton_backward(output.transpose(1, 2), q, q, q, table, problem, output.transpose(1, 2), lse)
    blocks = -(-length // 16)
    for name in ("nezha_forward_kernel", "nezha_row_statistics_kernel", "nezha_key_value_grad_kernel",
                 "nezha_query_grad_kernel"):
        (grid, arguments), = launchers[name].launches
        axes = programs(grid, arguments)
        assert all(axis <= 65_535 for axis in axes[1:]), (name, axes)
        assert math.prod(axes) == blocks * batch * heads, (name, axes)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert ta._device_guard(1).idx == 1
    assert ta._device_guard(0) is None and ta._device_guard(-1) is None  # the current GPU; the CPU's tensors


def test_out_of_memory_reaches_the_caller_and_the_engine_stays_usable(monkeypatch):
    """An out-of-memory error is the caller's to handle (a smaller batch): raised as PyTorch's own, and the next call
    runs the Triton kernels again."""
    from nezha_hf import triton_kernels

    real = triton_kernels.nezha_forward_kernel
    q, k, v = (t.float() for t in inputs(1, 2, 20, 20, 8))
    table = ra.sinusoid_relative_table(4, 8)
    module = torch.nn.Module().eval()
    monkeypatch.setattr(triton_kernels, "nezha_forward_kernel",
                        Launches(real, error=torch.OutOfMemoryError("CUDA out of memory (simulated)")))
    with pytest.raises(torch.OutOfMemoryError, match="simulated"):
        ra.relative_attention(module, q, k, v, None, 8**-0.5, relative_table=table, requested=ra.Engine.TRITON)
    monkeypatch.setattr(triton_kernels, "nezha_forward_kernel", real)
    with ra.recorded_attention_calls() as calls:
        out, _ = ra.relative_attention(module, q, k, v, None, 8**-0.5, relative_table=table, requested=ra.Engine.TRITON)
    assert [call.ran for call in calls] == [ra.Engine.TRITON]
    expected, _ = reference.attention(q.double(), k.double(), v.double(), 4)
    torch.testing.assert_close(out.transpose(1, 2).double(), expected, atol=2e-5, rtol=0)


def test_a_compile_failure_sets_aside_only_its_own_switches(monkeypatch, caplog):
    """The dropout variant of the forward fails to compile: dropout calls run the chunked engine (one warning naming
    the switches), calls without dropout still run the Triton kernels."""
    from nezha_hf import triton_kernels

    monkeypatch.setattr(triton_kernels, "nezha_forward_kernel",
                        Launches(triton_kernels.nezha_forward_kernel, RuntimeError("PTX assembly aborted (simulated)"),
                                 {"DROPOUT": True}))
    q, k, v = (t.float() for t in inputs(1, 2, 20, 20, 8))
    module = torch.nn.Module()
    with caplog.at_level("WARNING", logger="nezha_hf"), ra.recorded_attention_calls() as calls:
        for training in (True, False, True, False):
            ra.relative_attention(module.train(training), q, k, v, None, 8**-0.5, 0.1,
                                  relative_table=ra.sinusoid_relative_table(4, 8), requested=ra.Engine.TRITON)
    assert [call.ran for call in calls] == [ra.Engine.CHUNKED, ra.Engine.TRITON] * 2
    assert all("dropout" in call.why and "PTX assembly aborted" in call.why for call in calls[::2])
    messages = [record.getMessage() for record in caplog.records if "Triton kernel failed" in record.getMessage()]
    assert len(messages) == 1 and "dropout" in messages[0], messages


def test_float32_products_are_ieee_whatever_the_tf32_switch(monkeypatch):
    """Every float32 product is made inside the kernels in IEEE float32: no PyTorch matrix product (which
    `allow_tf32` / `set_float32_matmul_precision("high")` would turn to TF32 on a GPU) on the forward or backward
    path, and every kernel launched with its products in IEEE (the interpreter ignores `input_precision`: the compiled
    kernels' products are checked by `test_the_kernels_compile_for_an_h100`); with those switches on, float32 stays
    within 2e-5 of the float64 reference."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from nezha_hf import triton_kernels

    launchers = {name: Launches(getattr(triton_kernels, name))
                 for name in ("nezha_forward_kernel", "nezha_key_value_grad_kernel", "nezha_query_grad_kernel")}
    for name, launcher in launchers.items():
        monkeypatch.setattr(triton_kernels, name, launcher)

    aten = torch.ops.aten
    products = {aten.mm, aten.bmm, aten.addmm, aten.baddbmm, aten.addbmm, aten.dot, aten.mv, aten.addmv,
                aten.matmul, aten.linear, aten.einsum}

    class MatrixProducts(TorchDispatchMode):
        seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in products:
                self.seen.append(func)
            return func(*args, **(kwargs or {}))

    q, k, v, grad = (t.float() for t in inputs(1, 2, 37, 37, 16) + inputs(1, 2, 37, 37, 16, seed=1)[:1])
    table = ra.sinusoid_relative_table(4, 16)
    problem = AttentionProblem(RelativeAttentionMask(causal=True), 16**-0.5)
    with MatrixProducts() as recorder:
        output, lse = ta.triton_forward(q, k, v, table, problem)
        ta.triton_backward(grad, q, k, v, table, problem, output.transpose(1, 2), lse)
    assert recorder.seen == [], recorder.seen
    assert all(switches["IEEE"] for launcher in launchers.values() for _, switches in launcher.launches)
    assert all(launcher.launches for launcher in launchers.values())
    allowed, precision = torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision()
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.set_float32_matmul_precision("high")
    try:
        q64, k64, v64 = inputs(1, 2, 37, 37, 16)
        compare(q64, k64, v64, 4, RelativeAttentionMask(causal=True), reference.allowed_mask(37, causal=True))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allowed
        torch.set_float32_matmul_precision(precision)


@pytest.mark.parametrize("offset_kind", [int, torch.tensor], ids=["int-offset", "tensor-offset"])
def test_a_decoding_step_splits_its_keys_and_matches_the_reference(offset_kind, monkeypatch):
    """One query against 150 cached keys (left padding, a padded key inside the cache): the keys are split over
    several programs per head (merged by their log-sum-exps), output and gradients as the reference's."""
    from nezha_hf import triton_kernels

    forward = Launches(triton_kernels.nezha_forward_kernel)
    monkeypatch.setattr(triton_kernels, "nezha_forward_kernel", forward)
    batch, heads, offset, K = 2, 2, 149, 4
    keys = offset + 1
    q, k, v = inputs(batch, heads, 1, keys, 8, seed=offset)
    valid = torch.ones(batch, keys, dtype=torch.bool)
    valid[0, :37], valid[1, 100] = False, False
    mask = RelativeAttentionMask(key_is_valid=valid, causal=True)
    allowed = reference.allowed_mask(1, valid, causal=True, query_offset=offset, key_length=keys)
    compare(q, k, v, K, mask, allowed, offset=offset_kind(offset))
    (grid, switches), = [(grid, switches) for grid, switches in forward.launches if switches["Lk"] == keys]
    assert switches["SPLIT"] and math.prod(programs(grid, switches)) > batch * heads, "the keys were not split"


def test_no_tensor_is_read_on_the_host(monkeypatch):
    """A static cache's offset is a tensor on the GPU: reading it on the host (`int()`, `.item()`) would wait for the
    GPU at every layer of every step. The engine's host code converts no tensor to a Python number (dropout off)."""
    from pathlib import Path

    engine = {str(Path(ta.__file__)), str(Path(ta.__file__).with_name("triton_kernels.py"))}

    def refuse(name):
        original = getattr(torch.Tensor, name)

        def conversion(self, *args, **kwargs):
            if sys._getframe(1).f_code.co_filename in engine:
                raise AssertionError(f"the Triton engine read a tensor on the host ({name})")
            return original(self, *args, **kwargs)

        return conversion

    for name in ("__int__", "__index__", "__float__", "__bool__", "item", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, refuse(name))
    offset, queries = 21, 5
    q, k, v = inputs(1, 2, queries, offset + queries, 8, seed=2)
    mask = RelativeAttentionMask(causal=True)
    allowed = reference.allowed_mask(queries, causal=True, query_offset=offset, key_length=offset + queries)
    compare(q, k, v, 4, mask, allowed, offset=torch.tensor(offset))


def compile_for_a_gpu(architecture: int = 90) -> None:
    """Compile, ahead of time and without a GPU, each kernel that a representative set of calls launches, for an
    NVIDIA GPU of `architecture`, with the arguments `triton_attention` passes and each kernel's first tuned block;
    run where Triton compiles (TRITON_INTERPRET unset). Exits 3 where this Triton has no NVIDIA backend."""
    from triton.backends.compiler import GPUTarget

    from nezha_hf import triton_kernels as tk

    assert not tk.INTERPRETING, "Triton was imported under TRITON_INTERPRET"
    if "nvidia" not in triton.backends.backends:
        print("this Triton has no NVIDIA backend")
        sys.exit(3)
    pointers = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.int8: "*i8",
                torch.int32: "*i32", torch.int64: "*i64"}

    def kind(value, constexpr):
        if constexpr or value is None:
            return "constexpr"
        if isinstance(value, torch.Tensor):
            return pointers[value.dtype]
        if isinstance(value, float):
            return "fp32"
        return "i32" if -(2**31) <= value < 2**31 else "i64"

    class Compile:
        def __init__(self, kernel):
            self.kernel, self.arg_names = kernel, kernel.arg_names

        def __getitem__(self, grid):
            def launch(**arguments):
                kernel, config = self.kernel, None
                if isinstance(kernel, triton.runtime.Autotuner):
                    config, kernel = tk._configs_for(kernel.configs, {}, **arguments)[0], kernel.fn
                values = {**arguments, **(config.kwargs if config else {})}
                signature = {name: kind(values[name], i in kernel.constexprs)
                             for i, name in enumerate(kernel.arg_names)}
                constexprs = {name: values[name] for name, type_ in signature.items() if type_ == "constexpr"}
                options = dict(num_warps=config.num_warps, num_stages=config.num_stages) if config else {}
                compiled = triton.compile(triton.compiler.ASTSource(kernel, signature, constexprs),
                                          target=GPUTarget("cuda", architecture, 32), options=options)
                if values.get("IEEE"):  # float32: IEEE products (TTIR's default, unprinted), none in TF32
                    assert "tt.dot" in compiled.asm["ttir"] and "tf32" not in compiled.asm["ttir"], kernel.__name__
                print(f"{kernel.__name__} {config.kwargs if config else ''}: compiled, "
                      f"{compiled.metadata.shared} bytes of shared memory", flush=True)

            return launch

    for name in ("nezha_forward_kernel", "nezha_merge_kernel", "nezha_row_statistics_kernel",
                 "nezha_key_value_grad_kernel", "nezha_query_grad_kernel"):
        setattr(tk, name, Compile(getattr(tk, name)))
    valid = torch.ones(1, 600, dtype=torch.bool)
    every_switch = RelativeAttentionMask(valid[:, :100], True, valid[:, :100], torch.tensor(0))
    calls = [  # (dtype, queries, keys, mask, dropout): every switch; float32's blocks; a decoding step's split
        (torch.bfloat16, 100, 100, every_switch, 0.1), (torch.float32, 100, 100, RelativeAttentionMask(), 0.0),
        (torch.float16, 1, 600, RelativeAttentionMask(key_is_valid=valid, causal=True, query_offset=599), 0.0)]
    sys.path.insert(0, str(ROOT))
    from benchmarks.gpu.gpu_fake_driver import fake_hopper

    with fake_hopper():  # what the launchers ask of the GPU (its multiprocessors, for a decoding step's split)
        for dtype, queries, keys, mask, dropout in calls:
            q, k = torch.zeros(1, 2, queries, 64, dtype=dtype), torch.zeros(1, 2, keys, 64, dtype=dtype)
            table = torch.zeros(9, 64, dtype=dtype)  # the table's window; bfloat16 by rotation (the exact sinusoid)
            if dtype == torch.bfloat16:
                table = ra.sinusoid_relative_table(4, 64).to(dtype)
            problem = AttentionProblem(mask, 0.125, dropout, torch.tensor(1))
            ta.triton_forward(q, k, k, table, problem)
            if queries > 1:
                output, lse = q.clone(), torch.zeros(1, 2, queries)
                ta.triton_backward(q, q, k, k, table, problem, output, lse)


@pytest.mark.slow
def test_the_kernels_compile_for_an_h100():
    """What the interpreter runs, a compiler may refuse (block shapes, `tl.dot` sizes, layouts of a gather, Python
    values in jit code; Triton 3.6 refuses a helper that returns None). Every kernel of a call with every switch, of a
    float32 call (its products IEEE, none TF32) and of a decoding step is compiled for an H100 (sm_90) by the
    installed Triton, in a process where Triton compiles rather than interprets."""
    from pathlib import Path

    tests = Path(__file__).parent
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    environment["PYTHONPATH"] = os.pathsep.join([str(tests.parent), str(tests), environment.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", "import test_triton_attention as t; t.compile_for_a_gpu()"],
                          cwd=tests, env=environment, capture_output=True, text=True, timeout=1800)
    if done.returncode == 3:
        pytest.skip(done.stdout.strip())
    assert done.returncode == 0, done.stdout + done.stderr[-5000:]
    assert done.stdout.count("compiled") == 10, done.stdout


def test_the_yardstick_is_plain_flash_attention():
    """The yardstick the GPU gates measure NEZHA's kernels against (`benchmarks/gpu/triton_yardstick.py`, plain
    FlashAttention-2) computes softmax attention and its three gradients (against the float64 formula, under the
    interpreter), with dK/dV and dQ blocks of different shapes."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.gpu.triton_yardstick import yardstick_backward, yardstick_forward

    q, k, v = inputs(1, 2, 64, 64, 16, seed=3)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = torch.softmax(leaves[0] @ leaves[1].transpose(-1, -2) * 0.25, -1) @ leaves[2]
    grad = torch.randn(expected.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    output, lse = yardstick_forward(*(t.float() for t in (q, k, v)), 0.25, 32, 16, 4, 1)
    torch.testing.assert_close(output.double(), expected, atol=2e-6, rtol=0)
    got = yardstick_backward(grad.float(), *(t.float() for t in (q, k, v)), output, lse, 0.25, (16, 32, 4, 1),
                             (32, 16, 4, 1))
    for name, a, b in zip("qkv", got, torch.autograd.grad(expected, leaves, grad)):
        torch.testing.assert_close(a.double(), b, atol=4e-6, rtol=0, msg=lambda text, name=name: f"d{name}: {text}")


@pytest.mark.slow
def test_a_planted_64_row_block_on_8_warps_fails_the_gpu_gates(tmp_path):
    """`benchmarks/gpu/gpu_gates.py` compiles the forward for an H100 on the CPU: a 64-row block on 8 warps planted among
    its tuned configurations fails the gate "no 64-row block on 8 warps" (both warp groups compute the same rows);
    the tuned configurations pass it. The band loops are told from the tails' by the kernel file's source lines even
    when Triton's cache holds the same kernels compiled from another checkout (whose SASS names that checkout's file):
    the gates compile afresh."""
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    environment["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    other = tmp_path / "other-checkout"
    for part in ("nezha_hf", "benchmarks"):
        shutil.copytree(ROOT / part, other / part, ignore=shutil.ignore_patterns("__pycache__", "results"))
    command = ["benchmarks/gpu/gpu_gates.py", "--only", "forward", "--case", "no mask"]
    subprocess.run([sys.executable, *command], cwd=other, env=environment, capture_output=True, timeout=1800)
    done = subprocess.run([sys.executable, *command, "--plant", "nezha_forward_kernel:64,64,8,3"], cwd=ROOT,
                          env=environment, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 1, done.stdout + done.stderr[-5000:]
    twice = [line for line in done.stdout.splitlines() if "computed twice" in line]
    assert twice and all("forward (no mask), 64x64, 8 warps, 3 stages:" in line for line in twice), done.stdout
    rows = [line.split("|") for line in done.stdout.splitlines() if line.startswith("| forward | no mask |")]
    assert len(rows) == 2 and all(row[-3].strip() != "-" for row in rows), done.stdout  # each has a band loop


@pytest.mark.slow
def test_after_the_backward_check_the_backward_compiles_nothing(tmp_path):
    """With Triton compiling for a (fake) H100 (`benchmarks/gpu/gpu_fake_driver.py`: Triton's own launch path, only the
    launch stubbed): the check before a training forward compiles every kernel its backward launches, so the backward
    itself compiles none (the JIT's caches unchanged by it), for a padded bfloat16 call with dropout and the model's
    table, by rotation."""
    script = tmp_path / "probe.py"
    script.write_text(f"""
import json, sys
sys.path.insert(0, {str(ROOT)!r})
import torch
from benchmarks.gpu import gpu_gates
from benchmarks.gpu.gpu_fake_driver import fake_hopper
from nezha_hf import relative_attention as ra, triton_attention as ta, triton_kernels as tk
from nezha_hf.attention_ops import AttentionProblem, RelativeAttentionMask

def compiled():
    return {{name: len(gpu_gates._compiled(gpu_gates._jit(getattr(tk, name)))) for name in gpu_gates.NEZHA_KERNELS}}

with fake_hopper() as gpu:
    q, k, v = (torch.zeros(2, 256, 4, 64, dtype=torch.bfloat16).transpose(1, 2).requires_grad_() for _ in range(3))
    valid = torch.arange(256)[None, :] < torch.tensor([[256], [200]])
    problem = AttentionProblem(RelativeAttentionMask(key_is_valid=valid), 0.125, 0.1, torch.tensor(0x123456789ABCD))
    out = ta.triton_attention(q, k, v, ra.sinusoid_relative_table(64, 64).to(torch.bfloat16), problem)
    checked = compiled()
    out.backward(torch.ones_like(out))
    print(json.dumps([checked, compiled(), gpu.launches()]))
""")
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    environment["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    done = subprocess.run([sys.executable, str(script)], env=environment, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    checked, after_backward, launches = json.loads(done.stdout.splitlines()[-1])
    assert checked == after_backward, (checked, after_backward)
    assert all(checked[name] >= 1 for name in ("nezha_row_statistics_kernel", *BACKWARD_KERNELS)), checked
    assert launches >= 4  # the forward and the backward's three kernels reached the driver


@pytest.mark.slow
def test_a_planned_launch_passes_what_tritons_own_launch_passes(tmp_path):
    """A kind of call's first launch goes through Triton (autotuner, JIT binder) and plans the kind; later calls of the
    kind launch the compiled kernels by their plan (`triton_attention._Plan`). Against a fake H100, with Triton
    compiling: each planned launch hands Triton's launcher the grid, stream, kernel and arguments Triton's own launch
    of the same call hands it (the inputs and cached tensors the same objects, the outputs and scratch made alike,
    every other value equal), for a forward, a padded training step with dropout (the backward's three kernels) and a
    decoding step with a static cache (split and merged), without launch hooks and their metadata where no hook is
    set, and with a launch hook set, calling it with the metadata Triton's own launch gives it; a decoding step with a
    dynamic cache, whose key length is new (and its splits more), planned from another length's launches: the same
    compiled kernels and arguments as Triton's own launch; and a call whose tensor is aligned otherwise goes through
    Triton."""
    script = tmp_path / "probe.py"
    script.write_text(f"""
import json, sys
sys.path.insert(0, {str(ROOT)!r})
import torch
from triton import knobs
from triton.backends.nvidia import driver as nvidia
from benchmarks.gpu.gpu_fake_driver import fake_hopper
from nezha_hf import relative_attention as ra, triton_attention as ta
from nezha_hf.attention_ops import AttentionProblem, RelativeAttentionMask

recorded, launchers = [], []  # each launch's arguments, and its compiled kernel's launcher
original = nvidia.CudaLauncher.__call__
def record(self, *args):
    recorded.append(args)
    launchers.append(self)
    return original(self, *args)
nvidia.CudaLauncher.__call__ = record

def described(arguments):
    return [("tensor", a.dtype, tuple(a.shape), a.stride()) if isinstance(a, torch.Tensor) else
            a if isinstance(a, (int, float, bool, str, type(None))) else type(a).__name__ for a in arguments]

def launches(step, planned):
    if not planned:
        ta._plans.clear()
        ta._growing_plans.clear()
    recorded.clear()
    launchers.clear()
    step()
    return list(recorded)

table = ra.sinusoid_relative_table(64, 64).to(torch.bfloat16)
valid = torch.arange(300)[None, :] < torch.tensor([[300], [250]])
problems = {{
    "forward": AttentionProblem(RelativeAttentionMask(), 0.125),
    "training": AttentionProblem(RelativeAttentionMask(key_is_valid=valid), 0.125, 0.1, torch.tensor(0x123456789ABC)),
    "decoding": AttentionProblem(RelativeAttentionMask(key_is_valid=valid, causal=True,
                                                       query_offset=torch.tensor(299)), 0.125),
}}
results = {{}}
with fake_hopper():
    for name, problem in problems.items():
        queries = 1 if name == "decoding" else 300
        q = torch.zeros(2, queries, 4, 64, dtype=torch.bfloat16).transpose(1, 2)
        k, v = (torch.zeros(2, 4, 300, 64, dtype=torch.bfloat16) for _ in range(2))
        if name == "training":
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            grad = torch.ones(2, queries, 4, 64, dtype=torch.bfloat16)
            step = lambda: ta.triton_attention(q, k, v, table, problem).backward(grad)
        else:
            step = lambda: ta.triton_attention(q, k, v, table, problem)
        step()  # compiles, tunes and plans
        own, planned = launches(step, planned=False), launches(step, planned=True)
        identical = [[a is b for a, b in zip(x, y) if isinstance(a, torch.Tensor)] for x, y in zip(own, planned)]
        # (grid x 3, stream, kernel, its metadata; the launch's metadata and the hooks; the kernel's arguments)
        results[name] = [len(own),
                         [described(x[:6] + x[9:]) for x in own] == [described(x[:6] + x[9:]) for x in planned],
                         sum(map(sum, identical)), [x[:6] for x in own] == [x[:6] for x in planned],
                         all(x[6:9] == (None, None, None) for x in planned)]
        # with a launch hook set (a profiler's), planned launches call it as Triton's own launches do
        seen = []
        hook = lambda metadata: seen.append(sorted(metadata.get().items()) if metadata is not None else None)
        knobs.runtime.launch_enter_hook.add(hook)
        launches(step, planned=False)
        own_seen, seen[:] = list(seen), []
        launches(step, planned=True)
        knobs.runtime.launch_enter_hook.remove(hook)
        results[name].append([len(own_seen), repr(own_seen) == repr(seen), None not in seen])
    # a dynamic cache: a new key length (splits one more) planned from the launches of another
    granule = ta._kernels().SPLIT_GRANULE
    q = torch.zeros(2, 1, 4, 64, dtype=torch.bfloat16).transpose(1, 2)
    def decode(length):
        cache = torch.zeros(2, 4, length, 64, dtype=torch.bfloat16)
        problem = AttentionProblem(RelativeAttentionMask(causal=True, query_offset=length - 1), 0.125)
        return lambda: ta.triton_attention(q, cache, cache, table, problem)
    step, replans = decode(3 * granule + 1), []
    launches(decode(3 * granule - 1), planned=False)  # plans that length, and its kind less the length
    replanned = ta._Plan.replanned
    ta._Plan.replanned = lambda plan, values: replans.append(values) or replanned(plan, values)
    planned = launches(step, planned=True)
    planned_launchers = list(launchers)
    ta._Plan.replanned = replanned
    own = launches(step, planned=False)
    results["growing"] = [len(own),
                          [described(x[:6] + x[9:]) for x in own] == [described(x[:6] + x[9:]) for x in planned],
                          [x[:3] for x in own] == [x[:3] for x in planned], planned_launchers == launchers,
                          [values["splits"] for values in replans]]
    # a query aligned otherwise than the planned call's: Triton's own launch (a kernel compiled for it)
    problem, k, v = problems["forward"], k.detach(), v.detach()
    ta.triton_attention(torch.zeros(2, 300, 4, 64, dtype=torch.bfloat16).transpose(1, 2), k, v, table, problem)
    q = torch.zeros(2 * 300 * 4 * 64 + 1, dtype=torch.bfloat16)[1:].view(2, 300, 4, 64).transpose(1, 2)
    planned = []
    launch = ta._Plan.launch
    ta._Plan.launch = lambda plan, *arguments: planned.append(1) or launch(plan, *arguments)
    recorded.clear()
    ta.triton_attention(q, k, v, table, problem)
    results["misaligned"] = [q.data_ptr() % 16, len(planned), len(recorded)]
print(json.dumps(results))
""")
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    environment["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    done = subprocess.run([sys.executable, str(script)], env=environment, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.splitlines()[-1])
    for name, launched in (("forward", 1), ("training", 4), ("decoding", 2)):  # training: its forward and backward
        count, alike, identical, grids, no_hooks, hooked = results[name]
        assert count == launched and alike and grids and no_hooks, (name, results[name])
        assert hooked == [launched, True, True], (name, results[name])
        assert identical >= 3 * launched - 2, (name, results[name])  # at least the inputs, passed as they are
    count, alike, grids, kernels, splits = results["growing"]
    assert count == 2 and alike and grids and kernels and splits == [4, 4], results["growing"]
    assert results["misaligned"][0] != 0 and results["misaligned"][1:] == [0, 1], results["misaligned"]


@pytest.mark.slow
def test_dk_dv_draws_compile_for_a_gpu_where_the_threshold_is_one(tmp_path):
    """Triton's JIT makes an integer argument equal to 1 a constant: a dropout rate that rounds to 1/256 gives dK/dV's
    draws a threshold that is a Python int, not a tensor (the interpreter, which the other tests run under, passes
    tensors). The draws compile for an H100 (sm_90) with it."""
    script = tmp_path / "probe.py"
    script.write_text(f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
import triton, triton.language as tl
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from nezha_hf import triton_kernels as kernels

@triton.jit
def probe(Out, seed, head, m0, n0, threshold, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    kept = kernels._kept_by_keys(seed, head, m0, n0, threshold, BLOCK_M, BLOCK_N)
    tl.store(Out + tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :], kept.to(tl.int8))

signature = {{"Out": "*i8", "seed": "i64", "head": "i32", "m0": "i32", "n0": "i32", "threshold": "constexpr",
             "BLOCK_M": "constexpr", "BLOCK_N": "constexpr"}}
triton.compile(ASTSource(probe, signature, {{(5,): 1, (6,): 64, (7,): 128}}), target=GPUTarget("cuda", 90, 32),
               options={{"num_warps": 8}})
""")
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    environment["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    done = subprocess.run([sys.executable, str(script)], env=environment, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


# --- the forward's band by rotation (issue 55) ----------------------------------------------------------------------


def forward_launches(monkeypatch, kernel="nezha_forward_kernel"):
    """The launches of a kernel (the forward's by default), recorded and run."""
    from nezha_hf import triton_kernels as tk

    launches = Launches(real=getattr(tk, kernel))
    monkeypatch.setattr(tk, kernel, launches)
    return launches


BACKWARD_KERNELS = ("nezha_key_value_grad_kernel", "nezha_query_grad_kernel")


@pytest.mark.parametrize("dtype, atol", [(torch.bfloat16, 4e-2), (torch.float16, 5e-3)], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("queries, keys, K", [(70, 70, 3), (70, 70, 20), (21, 70, 5), (21, 70, 20), (1, 150, 20)],
                         ids=["K=3", "K=20", "continuing-a-cache", "continuing-a-cache-K=20", "decoding-split"])
def test_band_by_rotation_matches_the_formula(queries, keys, K, dtype, atol, monkeypatch):
    """bfloat16 / float16 with NEZHA's own table (the exact sinusoid): the forward's band tiles go by rotation
    (queries turned pairwise, the value term turned back; `ROTATE`), pairs clipped inside a band tile (K below the
    block) take the tails' rows; against the plain formula with the float64 sinusoid, under padding and a causal
    mask, queries continuing a cache and a decoding step split over programs."""
    launches = forward_launches(monkeypatch)
    backward = [forward_launches(monkeypatch, kernel) for kernel in BACKWARD_KERNELS]
    q, k, v = (t.to(dtype).double() for t in inputs(2, 2, queries, keys, 16, seed=K))
    valid = torch.ones(2, keys, dtype=torch.bool)
    valid[0, :3] = False  # left padding
    valid[1, keys - 5:] = False  # right padding
    valid[1, 40] = False  # a padded key inside a band
    offset = keys - queries
    mask = RelativeAttentionMask(key_is_valid=valid, causal=True)
    allowed = reference.allowed_mask(queries, valid, causal=True, query_offset=offset, key_length=keys)
    compare(q, k, v, K, mask, allowed, offset=offset, dtype=dtype, atol=atol)
    for kernel in (launches, *backward):  # the backward's band tiles go by rotation too (dQ and dK/dV)
        rotate = [switches.get("ROTATE") for _, switches in kernel.launches
                  if switches["Lk"] == keys]  # not the check's
        assert rotate and all(rotate)


# The interpreter's blocks are 16 x 32: with K = 6 a band tile's rows hold pairs clipped on both sides, with K = 30
# (2K at least the 32 keys) each row on one side only, the sides differing between a tile's rows, which the kernels
# take with one compare per pair against a threshold per row (`_clip_masks`).
ROTATED_BANDS = pytest.mark.parametrize("K, length", [(6, 45), (30, 110)], ids=["both-sides", "one-side"])


@ROTATED_BANDS
@pytest.mark.parametrize("mask_kind", ["none", "unilm-prefix"])
@pytest.mark.parametrize("dropout", [0.0, 0.3], ids=["no-dropout", "dropout"])
def test_backward_band_by_rotation_matches_the_window(mask_kind, dropout, K, length, monkeypatch):
    """The backward's band by rotation (dQ's and dK/dV's tiles: queries and output gradients turned pairwise, dQ's
    table term turned back) gives the gradients the table's window gives (forced for the second call), with dropout
    (the same pairs dropped), a ragged last block and pairs clipped inside band tiles, on both sides of a tile
    (K = 6 below the block) or on one (`ROTATED_BANDS`)."""
    from nezha_hf import triton_kernels as tk

    backward = [forward_launches(monkeypatch, kernel) for kernel in BACKWARD_KERNELS]
    q, k, v, grad = (t.to(torch.float16) for t in [*inputs(1, 2, length, length, 16, seed=7),
                                                   inputs(1, 2, length, 1, 16, 8)[0]])
    valid = torch.ones(1, length, dtype=torch.bool)
    valid[0, length - 5:] = False
    source = torch.zeros(1, length, dtype=torch.bool)
    source[0, :12] = True
    mask, _ = MASKS[mask_kind](valid, source)
    table = ra.sinusoid_relative_table(K, 16).to(torch.float16)
    problem = AttentionProblem(mask, 16**-0.5, dropout, torch.tensor(11))
    output, lse = ta.triton_forward(q, k, v, table, problem)
    rotated = ta.triton_backward(grad, q, k, v, table, problem, output.transpose(1, 2), lse)
    monkeypatch.setattr(ta, "_rotation", lambda *args: dict(ROTATE=False, Sinusoid=None))
    windowed = ta.triton_backward(grad, q, k, v, table.clone(), problem, output.transpose(1, 2), lse)  # a new table
    for kernel in backward:
        assert [switches.get("ROTATE") for _, switches in kernel.launches] == [True, False]
    assert tk.ROTATION_ROWS >= 16
    for name, a, b in zip("qkv", rotated, windowed):
        assert a.abs().max() > 0.1
        torch.testing.assert_close(a.double(), b.double(), atol=1e-2, rtol=0,
                                   msg=lambda text, name=name: f"d{name}: {text}")


@ROTATED_BANDS
def test_band_by_rotation_with_dropout_keeps_the_windows_mask(K, length, monkeypatch):
    """With dropout, the rotated band drops the same pairs the table's window does, and takes the same clipped pairs
    on both sides of a tile or one: the two paths agree (the table's window forced for the second call)."""
    launches = forward_launches(monkeypatch)
    q, k, v = (t.to(torch.float16) for t in inputs(1, 2, length, length, 16, seed=5))
    table = ra.sinusoid_relative_table(K, 16).to(torch.float16)
    problem = AttentionProblem(RelativeAttentionMask(), 16**-0.5, 0.3, torch.tensor(11))
    rotated, _ = ta.triton_forward(q, k, v, table, problem)
    monkeypatch.setattr(ta, "_rotation", lambda *args: dict(ROTATE=False, Sinusoid=None))
    windowed, _ = ta.triton_forward(q, k, v, table.clone(), problem)  # a new table: its use made again
    assert [switches["ROTATE"] for _, switches in launches.launches] == [True, False]
    torch.testing.assert_close(rotated.double(), windowed.double(), atol=5e-3, rtol=0)


def test_a_table_that_is_not_the_exact_sinusoid_takes_the_window(monkeypatch):
    """The rotation holds for the sinusoid only: a bfloat16 call with any other table (here NEZHA's with one band row
    changed) takes the table's window, and matches the formula with that table."""
    launches = forward_launches(monkeypatch)
    K, d = 5, 16
    table = reference.relative_table(K, d)
    table[K + 2] += 0.5
    q, k, v = (t.to(torch.bfloat16).double() for t in inputs(1, 2, 40, 40, d, seed=6))
    compare(q, k, v, K, RelativeAttentionMask(), None, dtype=torch.bfloat16, atol=4e-2, table=table)
    rotate = [switches["ROTATE"] for _, switches in launches.launches if switches["Lk"] == 40]  # not the check's
    assert rotate and not any(rotate)


def test_the_sinusoid_check_is_made_once_per_table_and_version(monkeypatch):
    """Whether a table is the exact sinusoid is compared once per table tensor (the comparison waits for a GPU) and
    again when the table changes in place; float32 never goes by rotation (its band stays as exact as its rows)."""
    from nezha_hf import triton_kernels as tk

    table = ra.sinusoid_relative_table(4, 8)
    assert ta._rotation(table, torch.bfloat16, tk)["ROTATE"] and ta._rotation(table, torch.float16, tk)["ROTATE"]
    assert not ta._rotation(table, torch.float32, tk)["ROTATE"]
    sinusoid = ta._rotation(table, torch.bfloat16, tk)["Sinusoid"]
    assert sinusoid.shape == (2 * 4 + 1 + tk.ROTATION_ROWS, 8) and sinusoid.dtype == torch.bfloat16
    torch.testing.assert_close(sinusoid[:9], table.to(torch.bfloat16), atol=0, rtol=0)
    compared = []
    with monkeypatch.context() as patches:
        patches.setattr(ta.torch, "equal", lambda *args: compared.append(1) or True)
        ta._is_exact_sinusoid(table, torch.bfloat16)
    assert not compared, "compared again though the table did not change"
    table[3, 0] += 0.25
    assert not ta._rotation(table, torch.bfloat16, tk)["ROTATE"]
