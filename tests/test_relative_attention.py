"""Every attention path against the independent O(L^2 d) reference (`tests/reference.py`), outputs and gradients."""

import pytest
import reference
import torch
from helpers import count_calls, make_case, run_attention
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nezha_hf import attention_kernel, three_regions
from nezha_hf import relative_attention as ra

PATHS = (ra.gather_relative_attention, ra.three_region_attention, ra.fused_relative_attention)


@pytest.fixture
def small_blocks(monkeypatch):
    """Three regions at every length, in small blocks; the kernel in small blocks: several blocks even for short inputs."""
    monkeypatch.setattr(ra, "THREE_REGIONS_MIN_LENGTH", 1)
    monkeypatch.setattr(three_regions, "BAND_BLOCK_SIZE", 16)  # several blocks, and lengths that do not fill one
    monkeypatch.setattr(attention_kernel, "KERNEL_BLOCK_SIZES", (8, 16))  # online softmax over several key blocks


PATHS = (ra.gather_relative_attention, ra.three_region_attention, ra.fused_relative_attention)


def check_against_reference(q, k, v, mask, allowed, K, atol):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    expected, _ = reference.attention(q, k, v, K, allowed)
    grad_out = torch.randn_like(expected)
    expected_grads = torch.autograd.grad((expected * grad_out).sum(), (q, k, v))
    for path in PATHS:
        got = run_attention(path, q, k, v, mask, K)
        torch.testing.assert_close(got, expected, atol=atol, rtol=0, msg=f"{path.__name__} forward")
        grads = torch.autograd.grad((got * grad_out).sum(), (q, k, v))
        for name, g, e in zip("qkv", grads, expected_grads):
            torch.testing.assert_close(g, e, atol=atol, rtol=0, msg=f"{path.__name__} d{name}")


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


@pytest.mark.parametrize(
    "path,function",
    [(ra.three_region_attention, three_regions.ThreeRegionFunction),
     (ra.fused_relative_attention, attention_kernel.KernelFunction)],
)
def test_linear_memory_paths_are_used(path, function, small_blocks, monkeypatch):
    calls = count_calls(monkeypatch, function)
    q, k, v, mask, _ = make_case(1, 1, 40, 8, 4, "bidirectional", None, torch.float32, seed=0)
    run_attention(path, q, k, v, mask, 4)
    assert calls, f"{function.__name__} did not run"


def test_fully_masked_rows_no_nan(small_blocks):
    q, k, v, mask, _ = make_case(2, 2, 30, 8, 4, "bidirectional", [30, 1], torch.float32, seed=3)
    mask.key_is_valid[1] = False  # the whole second sequence is padding
    for path in PATHS:
        out = run_attention(path, q, k, v, mask, 4)
        assert not out.isnan().any()
        if path is not ra.gather_relative_attention:  # gather averages uniformly, as transformers 4.x did
            assert not out[1].any(), f"{path.__name__}: a row with no visible key must be zero"


@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 3e-2)])
def test_low_precision_close_to_float32(dtype, atol, small_blocks):
    q, k, v, mask, _ = make_case(1, 2, 300, 16, 8, "bidirectional", [250], torch.float32, seed=4)
    full = run_attention(ra.gather_relative_attention, q, k, v, mask, 8)
    for path in PATHS:  # the kernel is float32 only: bfloat16 goes to three regions
        low = run_attention(path, q.to(dtype), k.to(dtype), v.to(dtype), mask, 8)
        assert not low.isnan().any()
        torch.testing.assert_close(low.float(), full, atol=atol, rtol=0)
