"""The Triton engine, run on CPU tensors under Triton's interpreter (`TRITON_INTERPRET=1`): forward and gradients
against the float64 reference across block edges (the interpreter's blocks are 16) and the band (K = 4, and K
beyond the length), every mask kind, a KV cache's offset, dropout (its mask the same in the backward, kept
entries scaled by 1 / (1 - p)), bfloat16 / float16; in a model, with `generate`; and the chunked engine with one
warning where Triton is missing or its kernels fail. Small sizes: the interpreter runs a block in numpy."""

import dataclasses
import math

import pytest
import reference
import torch
from helpers import tiny_config

from nezha_hf import NezhaForUniLM, NezhaModel
from nezha_hf import relative_attention as ra
from nezha_hf import triton_attention as ta
from nezha_hf.attention_ops import AttentionProblem, RelativeAttentionMask

triton = pytest.importorskip("triton", reason="Triton is part of the dev install (`[triton]`)")


@pytest.fixture(autouse=True)
def interpreted(monkeypatch):
    """Triton's interpreter (conftest.py sets TRITON_INTERPRET=1 before anything imports Triton); no earlier failure."""
    from nezha_hf import triton_kernels

    assert triton_kernels.INTERPRETING, "TRITON_INTERPRET=1 was not set when Triton was imported"
    monkeypatch.setattr(ta, "_failure", [])


def run(q, k, v, K, mask=RelativeAttentionMask(), dropout=0.0, seed=0, table=None):
    """The Triton op on float tensors `[batch, heads, length, d]`; returns `[batch, heads, queries, d]`."""
    table = ra.sinusoid_relative_table(K, q.shape[-1]).to(q.dtype) if table is None else table
    problem = AttentionProblem(mask, q.shape[-1] ** -0.5, dropout, torch.tensor(seed))
    return ta.triton_attention(q, k, v, table, problem).transpose(1, 2)


def inputs(batch, heads, queries, keys, d, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, length, d, dtype=torch.float64, generator=generator)
            for length in (queries, keys, keys)]


def compare(q64, k64, v64, K, mask, allowed, offset=0, dtype=torch.float32, atol=2e-5, keep=None, dropout=0.0,
            seed=0):
    """The Triton op in `dtype` against the reference in float64, output and the three gradients."""
    leaves = [t.to(dtype).requires_grad_() for t in (q64, k64, v64)]
    got = run(*leaves, K, dataclasses.replace(mask, query_offset=offset), dropout, seed)
    exact = [t.clone().requires_grad_() for t in (q64, k64, v64)]
    expected, _ = reference.attention(*exact, K, allowed, query_offset=offset, keep=keep, dropout=dropout)
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
    # A static cache reports its offset as a 0-dim tensor.
    got = run(*(t.float() for t in (q, k, v)), K, dataclasses.replace(mask, query_offset=torch.tensor(offset)))
    torch.testing.assert_close(got, run(*(t.float() for t in (q, k, v)), K, dataclasses.replace(mask, query_offset=offset)))


def dropout_mask(batch, heads, length, dropout, seed):
    """The keep mask the kernel draws for `seed`, read off its output: with one-hot values (`v_j = e_j`) and a zero
    table, output entry `[i, j]` is `p_ij / (1 - p)` where key j is kept and 0 where it is dropped."""
    q, k, _ = (t.float() for t in inputs(batch, heads, length, length, length, seed=7))
    one_hot = torch.eye(length).expand(batch, heads, length, length).contiguous()
    out = run(q, k, one_hot, 4, dropout=dropout, seed=seed, table=torch.zeros(9, length))
    probabilities = torch.softmax(q.double() @ k.double().transpose(-1, -2) / math.sqrt(length), -1)
    return out != 0, out.double(), probabilities


def test_dropout_keeps_one_minus_p_of_the_entries_scaled_by_its_inverse():
    dropout = 0.3
    kept, out, probabilities = dropout_mask(2, 2, 40, dropout, seed=11)
    rate = kept.double().mean().item()
    draws = kept.numel()
    assert abs(rate - (1 - dropout)) < 4 * math.sqrt(dropout * (1 - dropout) / draws), rate
    # Kept entries are scaled by 1 / (1 - p), so the expectation over masks is the output without dropout.
    torch.testing.assert_close(out[kept], (probabilities / (1 - dropout))[kept], atol=1e-6, rtol=0)
    other, _, _ = dropout_mask(2, 2, 40, dropout, seed=12)
    assert not torch.equal(kept, other), "two seeds drew the same mask"


def test_dropout_backward_redraws_the_forward_mask():
    """The mask read off the kernel's output for a seed, given to the reference, gives the kernel's output and
    gradients for that seed: the backward used the forward's mask."""
    dropout, seed, length = 0.2, 5, 38  # head size = length (even: the table pairs sin and cos)
    kept, _, _ = dropout_mask(1, 2, length, dropout, seed)
    q, k, v = inputs(1, 2, length, length, length, seed=3)
    compare(q, k, v, 4, RelativeAttentionMask(), None, keep=kept.double(), dropout=dropout, seed=seed)


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

    class Broken:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise RuntimeError("PTX assembly aborted (simulated)")

            return launch

    monkeypatch.setattr(triton_kernels, kernel, Broken())
    monkeypatch.setattr(ta, "_checked_backwards", set())
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


def test_tuning_is_keyed_on_length_classes_and_a_decoding_step_gets_small_blocks():
    """A decoding loop's key length grows by one per step: keyed on the length itself, the forward would be tuned
    again at every step."""
    from nezha_hf import triton_kernels as tk

    assert [tk.length_class(n) for n in (1, 16, 17, 1000, 1024, 1025)] == [16, 16, 32, 1024, 1024, 2048]
    configs = [triton.Config({"BLOCK_M": block_m, "BLOCK_N": 32}) for block_m in (16, 64, 128)]
    assert [config.kwargs["BLOCK_M"] for config in tk._configs_for(configs, {"LQ_CLASS": 16})] == [16]
    assert len(tk._configs_for(configs, {"LQ_CLASS": 4096})) == 3
