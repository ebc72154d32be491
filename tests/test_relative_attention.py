"""Every attention path against the independent O(L^2 d) reference (`tests/reference.py`), and which path runs where."""

import dataclasses
import logging
from pathlib import Path

import pytest
import reference
import torch
from helpers import make_case, run_attention
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nezha_hf import chunked_attention, fused_attention, three_regions
from nezha_hf import attention_ops as ops
from nezha_hf import relative_attention as ra
from nezha_hf.relative_attention import Engine

PATHS = (Engine.GATHER, Engine.FUSED, Engine.CHUNKED, Engine.THREE_REGIONS)


@pytest.fixture
def small_blocks(monkeypatch):
    """Every engine in small pieces, so that short inputs span several of them: three regions at every
    length with 16-query band blocks, the kernel with 8-query / 16-key blocks, the chunked path in chunks of
    a few queries."""
    monkeypatch.setattr(ra, "THREE_REGIONS_MIN_LENGTH", 1)
    monkeypatch.setattr(three_regions, "BAND_BLOCK_SIZE", 16)
    monkeypatch.setattr(fused_attention, "KERNEL_BLOCK_SIZES", (8, 16))
    monkeypatch.setattr(chunked_attention, "CHUNK_SCORES", 1)
    monkeypatch.setattr(chunked_attention, "MIN_CHUNK_ROWS", 5)


def check_against_reference(q, k, v, mask, allowed, K, atol, paths=PATHS):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    expected, _ = reference.attention(q, k, v, K, allowed)
    grad_out = torch.randn(expected.shape, generator=torch.Generator().manual_seed(0), dtype=expected.dtype)
    expected_grads = torch.autograd.grad((expected * grad_out).sum(), (q, k, v))
    for path in paths:
        got = run_attention(path, q, k, v, mask, K)
        torch.testing.assert_close(got, expected, atol=atol, rtol=0, msg=f"{path.name} forward")
        grads = torch.autograd.grad((got * grad_out).sum(), (q, k, v))
        for name, g, e in zip("qkv", grads, expected_grads):
            torch.testing.assert_close(g, e, atol=atol, rtol=0, msg=f"{path.name} d{name}")


@st.composite
def attention_cases(draw):
    batch = draw(st.integers(1, 3))
    K = draw(st.integers(1, 12))
    length = draw(st.one_of(st.integers(1, 3 * K + 70), st.sampled_from([1, K, K + 1, 2 * K + 1])))
    padded = draw(st.booleans())
    pad_lengths = [draw(st.integers(1, length)) for _ in range(batch)] if padded else None
    return dict(
        batch=batch,
        heads=draw(st.integers(1, 3)),
        length=length,
        head_size=draw(st.sampled_from([2, 4, 8, 16])),
        K=K,
        mode=draw(st.sampled_from(["bidirectional", "causal", "prefix"])),
        pad_lengths=pad_lengths,
        seed=draw(st.integers(0, 2**16)),
    )


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(case=attention_cases())
def test_paths_match_reference_float32(case, small_blocks):
    q, k, v, mask, allowed = make_case(**case, dtype=torch.float32)
    check_against_reference(q, k, v, mask, allowed, case["K"], atol=1e-5)


@pytest.mark.parametrize("path", PATHS, ids=lambda path: path.name)
def test_fully_masked_rows_no_nan(path, small_blocks):
    """One answer from every engine for a sequence that is all padding: zeros, as transformers 5's BERT gives
    by default (its sdpa attention; its eager one averages uniformly, as transformers 4.x did)."""
    q, k, v, mask, _ = make_case(2, 2, 30, 8, 4, "bidirectional", [30, 1], torch.float32, seed=3)
    mask.key_is_valid[1] = False  # the whole second sequence is padding
    out = run_attention(path, q, k, v, mask, 4)
    assert not out.isnan().any()
    assert not out[1].any(), f"{path.name}: a row with no visible key must be zero"


@pytest.mark.parametrize("mode", ["bidirectional", "causal", "prefix"])
@pytest.mark.parametrize("path", PATHS, ids=lambda path: path.name)
def test_rows_that_see_nothing_are_zero_and_pass_no_gradient(path, mode, small_blocks):
    """Left padding (under a causal mask the first rows then see no key) and an example that is all padding:
    those rows give zeros, nothing is NaN, and every other row and all gradients match the reference."""
    q, k, v, mask, _ = make_case(3, 2, 40, 8, 4, mode, None, torch.float32, seed=11)
    valid = torch.ones(3, 40, dtype=torch.bool)
    valid[1, :7] = False
    valid[2] = False
    source = mask.key_is_source
    mask = ra.RelativeAttentionMask(key_is_valid=valid, causal=mask.causal, key_is_source=source)
    allowed = reference.allowed_mask(40, valid, mask.causal, source)
    sees_something = allowed.any(-1, keepdim=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    got = run_attention(path, *leaves, mask, 4)
    references = [t.clone().requires_grad_() for t in (q, k, v)]
    # The reference's empty rows would be NaN; let them see every key and then zero them.
    expected = reference.attention(*references, 4, allowed | ~sees_something)[0] * sees_something
    assert not sees_something.all() and not got[~sees_something.expand_as(got)].any()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    grad = torch.randn_like(got)
    for name, a, b in zip("qkv", torch.autograd.grad((got * grad).sum(), leaves),
                          torch.autograd.grad((expected * grad).sum(), references)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=f"d{name}")


@pytest.mark.parametrize("path", PATHS, ids=lambda path: path.name)
def test_bfloat16_close_to_float32(path, small_blocks):
    q, k, v, mask, _ = make_case(1, 2, 300, 16, 8, "bidirectional", [250], torch.float32, seed=4)
    full = run_attention(Engine.GATHER, q, k, v, mask, 8)
    low = run_attention(path, q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, 8)
    assert low.dtype == torch.bfloat16 and not low.isnan().any()
    torch.testing.assert_close(low.float(), full, atol=3e-2, rtol=0)


@pytest.mark.parametrize("path", PATHS, ids=lambda path: path.name)
@pytest.mark.parametrize("mode", ["bidirectional", "causal", "prefix"])
def test_float64_is_exact_on_every_engine(path, mode, small_blocks):
    """Float64 in, float64 out, equal to the plain formula within 1e-10 (given the model's own table): no engine
    computes in float32 behind the caller's back (gradcheck users run float64)."""
    q, k, v, mask, allowed = make_case(2, 2, 45, 8, 4, mode, [45, 33], torch.float64, seed=21)
    table = ra.sinusoid_relative_table(4, 8).double()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    references = [t.clone().requires_grad_() for t in (q, k, v)]
    got = run_attention(path, *leaves, mask, 4)
    expected = reference.attention(*references, 4, allowed, table=table)[0]
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, expected, atol=1e-10, rtol=0)
    grad = torch.randn_like(got)
    for name, a, b in zip("qkv", torch.autograd.grad((got * grad).sum(), leaves),
                          torch.autograd.grad((expected * grad).sum(), references)):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0, msg=f"d{name}")


@pytest.mark.parametrize("path", PATHS, ids=lambda path: path.name)
@pytest.mark.parametrize("poison", ["nan query", "inf query", "nan key", "nan value", "-inf query",
                                    "nan keys filling the first key block"])
def test_non_finite_inputs_propagate_as_in_eager(path, poison, small_blocks):
    """A NaN or inf in the inputs gives the rows NaN that the gather engine (eager) gives, on every engine; the
    other rows are unchanged. A diverged model must not look finite. (Keys 0 to 15 are the kernel's first key block
    here: every score a row sees first is NaN, and its later blocks are finite.)"""
    q, k, v, mask, _ = make_case(2, 2, 40, 8, 4, "bidirectional", [40, 30], torch.float32, seed=13)
    tensor, positions, value = {
        "nan query": (q, 17, float("nan")), "inf query": (q, 17, float("inf")), "nan key": (k, 17, float("nan")),
        "nan value": (v, 17, float("nan")), "-inf query": (q, 17, float("-inf")),
        "nan keys filling the first key block": (k, slice(0, 16), float("nan")),
    }[poison]
    tensor[0, 1, positions, :] = value
    expected = run_attention(Engine.GATHER, q, k, v, mask, 4)
    got = run_attention(path, q, k, v, mask, 4)
    assert expected.isnan().any()
    assert torch.equal(got.isnan(), expected.isnan()), f"{path.name}: NaN in {got.isnan().sum()} entries, eager " \
                                                       f"{expected.isnan().sum()}"
    finite = ~expected.isnan()
    torch.testing.assert_close(got[finite], expected[finite], atol=1e-5, rtol=0)


# --- which path runs where ------------------------------------------------------------------------------


def run_in(engine, module_training, dtype, length, dropout=0.0, query_offset=0):
    """Ask for `engine` once like a model would, and return the `AttentionCall` recorded."""
    q, k, v, mask, _ = make_case(1, 2, length, 8, 4, "causal", None, dtype, seed=0)
    mask = dataclasses.replace(mask, query_offset=query_offset)
    table = ra.sinusoid_relative_table(4, 8).to(dtype)
    module = torch.nn.Module().train(module_training)
    with ra.recorded_attention_calls() as calls:
        ra.relative_attention(module, q[..., query_offset:, :], k, v, mask, 0.3, dropout, relative_table=table,
                              requested=engine)
    return calls[-1]


@pytest.mark.parametrize(
    "engine, training, dtype, length, dropout, offset, expected",
    [
        (Engine.FUSED, False, torch.float32, 40, 0.0, 0, Engine.FUSED),
        (Engine.FUSED, True, torch.float32, 40, 0.1, 0, Engine.FUSED),  # dropout in training
        (Engine.FUSED, False, torch.float32, 40, 0.0, 39, Engine.FUSED),  # a cached step
        (Engine.FUSED, True, torch.bfloat16, 40, 0.1, 0, Engine.FUSED),
        (Engine.FUSED, False, torch.float16, 40, 0.0, 39, Engine.FUSED),
        (Engine.FUSED, True, torch.float64, 40, 0.1, 0, Engine.CHUNKED),  # float64 stays float64
        (Engine.THREE_REGIONS, False, torch.float64, 600, 0.0, 0, Engine.CHUNKED),
        (Engine.CHUNKED, False, torch.float32, 40, 0.0, 0, Engine.CHUNKED),
        (Engine.THREE_REGIONS, False, torch.float32, 600, 0.0, 0, Engine.THREE_REGIONS),
        (Engine.THREE_REGIONS, False, torch.float32, 40, 0.0, 0, Engine.CHUNKED),  # short
        (Engine.THREE_REGIONS, True, torch.float32, 600, 0.1, 0, Engine.CHUNKED),  # dropout in training
        (Engine.THREE_REGIONS, False, torch.float32, 600, 0.0, 590, Engine.CHUNKED),  # a cached step
        (Engine.GATHER, True, torch.float32, 40, 0.1, 0, Engine.GATHER),
    ],
)
def test_which_engine_runs(engine, training, dtype, length, dropout, offset, expected):
    call = run_in(engine, training, dtype, length, dropout, offset)
    assert call.ran is expected
    assert (call.why == "") == (expected is engine)  # a fallback always says why


def test_without_the_kernel_the_default_runs_the_chunked_engine(monkeypatch):
    monkeypatch.setenv("NEZHA_HF_KERNEL", "0")
    fused_attention.forget_fused_kernel()
    try:
        assert fused_attention.fused_kernel() is None
        call = run_in(Engine.FUSED, False, torch.float32, 40)
        assert call.ran is Engine.CHUNKED and "not built" in call.why
    finally:
        monkeypatch.delenv("NEZHA_HF_KERNEL")
        fused_attention.forget_fused_kernel()


def test_the_engine_that_ran_is_logged_once_at_info(caplog, monkeypatch):
    from transformers.utils import logging as hf_logging

    monkeypatch.setattr(ra, "_logged", set())
    hf_logging.enable_propagation()
    try:
        with caplog.at_level(logging.INFO, logger="nezha_hf.relative_attention"):
            for _ in range(3):
                run_in(Engine.FUSED, True, torch.float64, 40, dropout=0.1)
    finally:
        hf_logging.disable_propagation()
    lines = [r.getMessage() for r in caplog.records if "NEZHA attention" in r.getMessage()]
    assert lines == ["NEZHA attention 'nezha_fused' runs the chunked engine (cpu, torch.float64, attention dropout on, "
                     "no KV cache): the fused kernel computes in float32 (it takes float32, bfloat16 and float16)."]


@pytest.mark.parametrize("render", [ra.implementation_table, ra.engine_descriptions], ids=lambda f: f.__name__)
def test_the_docs_show_the_engine_table(render):
    """docs/attention.md shows which engine runs where and what each is; both must be what `ENGINES` declares."""
    page = (Path(__file__).parents[1] / "docs" / "attention.md").read_text(encoding="utf-8")
    assert render() in page, (
        f"docs/attention.md's table of engines is out of date: paste the output of "
        f"`python -c 'from nezha_hf.relative_attention import {render.__name__}; print({render.__name__}())'`"
    )


# --- the rules (attention_ops), and every engine against them ----------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(batch=st.integers(1, 3), length=st.integers(1, 30), offset=st.integers(0, 5),
       mode=st.sampled_from(["bidirectional", "causal", "prefix"]), padded=st.booleans(), seed=st.integers(0, 999))
def test_the_rules_are_the_reference_mask(batch, length, offset, mode, padded, seed):
    """`visible_keys` and `sees_nothing` against the reference's mask, written out independently in
    tests/reference.py, with queries offset as after a cache."""
    g = torch.Generator().manual_seed(seed)
    keys = length + offset
    valid = torch.rand(batch, keys, generator=g) < 0.7 if padded else None
    source = torch.rand(batch, keys, generator=g) < 0.4 if mode == "prefix" else None
    mask = ra.RelativeAttentionMask(valid, mode != "bidirectional", source, offset)
    positions = ops.query_positions(length, offset)
    expected = reference.allowed_mask(length, valid, mask.causal, source, offset, keys)[:, 0]
    got = ops.visible_keys(mask, positions, torch.arange(keys))
    assert torch.equal(torch.ones_like(expected) if got is None else got.expand_as(expected), expected)
    nothing = ops.sees_nothing(mask, positions)
    assert torch.equal(torch.zeros_like(expected[..., 0]) if nothing is None else nothing.expand(expected.shape[:-1]),
                       ~expected.any(-1))


@pytest.mark.parametrize("mode", ["bidirectional", "causal", "prefix"])
@pytest.mark.parametrize("path", PATHS, ids=lambda path: path.name)
def test_every_engine_follows_the_rules(path, mode, small_blocks):
    """With zero queries every key a query sees weighs the same, so with one-hot values output row i holds 1/n on the
    keys query i sees (plus the table's value term): every engine, the C++ kernel included, against the reference
    given the rules' mask; rows that see nothing are 0. Left padding, an all-padding example, a partly padded one."""
    length, K = 24, 3
    valid = torch.ones(3, length, dtype=torch.bool)
    valid[0, :5], valid[1], valid[2, 17:] = False, False, False
    g = torch.Generator().manual_seed(4)
    source = torch.arange(length)[None, :] < torch.tensor([[9], [3], [12]]) if mode == "prefix" else None
    mask = ra.RelativeAttentionMask(valid, mode != "bidirectional", source)
    q = torch.zeros(3, 2, length, length)
    k = torch.randn(3, 2, length, length, generator=g)
    v = torch.eye(length).expand(3, 2, length, length).contiguous()
    positions = ops.query_positions(length)
    allowed = ops.visible_keys(mask, positions, torch.arange(length))[:, None]
    nothing = ops.sees_nothing(mask, positions)
    got = run_attention(path, q, k, v, mask, K)
    expected = reference.attention(q, k, v, K, allowed | nothing[:, None, :, None])[0] * ~nothing[:, None, :, None]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_an_offset_stays_symbolic_under_torch_export():
    """Every engine is called with the problem's fields flattened; an int offset (the cache length, a symbolic size
    under torch.export) became a constant of the traced length, and an exported decoding step failed at any other
    cache length (onnxruntime: "Attempting to broadcast an axis by a dimension other than 1. 50 by 69")."""
    class Offset(torch.nn.Module):
        def forward(self, past):
            problem = ops.AttentionProblem(ops.RelativeAttentionMask(query_offset=past.shape[1]), 1.0)
            return ops.flatten(problem)[[name for name, _, _ in ops.PROBLEM_FIELDS].index("query_offset")] + 0

    exported = torch.export.export(Offset(), (torch.zeros(1, 5),), dynamic_shapes=({1: torch.export.Dim.AUTO},))
    assert int(exported.module()(torch.zeros(1, 9))) == 9
