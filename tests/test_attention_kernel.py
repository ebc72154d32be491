"""The compiled kernel: it builds, loads with the model, runs at its own block sizes, and falls back cleanly."""

import pytest
import reference
import torch
from helpers import count_calls, make_case, run_attention

from nezha_hf import attention_kernel, three_regions
from nezha_hf import relative_attention as ra


def test_kernel_builds():
    # CI has a compiler and ninja: a kernel that fails to build must fail here, not fall back quietly.
    assert attention_kernel.compiled_kernel() is not None, "the compiled attention kernel did not build (see the logged error)"


@pytest.mark.parametrize("implementation, loads", [(None, True), ("nezha_fused", True), ("eager", False)])
def test_kernel_is_loaded_with_the_model(implementation, loads, monkeypatch):
    # A model on the kernel path loads it when it is created, not inside its first forward pass.
    from nezha_hf import NezhaConfig, NezhaModel

    attention_kernel.compiled_kernel.cache_clear()
    loads_before = attention_kernel.compiled_kernel.cache_info().misses
    config = NezhaConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    NezhaModel._from_config(config, attn_implementation=implementation)
    assert (attention_kernel.compiled_kernel.cache_info().misses > loads_before) == loads
    if loads:
        assert attention_kernel.compiled_kernel() is not None


@pytest.mark.parametrize("mode", ["bidirectional", "causal", "prefix"])
def test_kernel_default_blocks_base_size(mode):
    # The kernel's own block sizes (256 queries, 512 keys) over 1,100 tokens: three key blocks, a
    # partial last block, K and head size of the base model; the batch mixes padded and full rows.
    q, k, v, mask, allowed = make_case(2, 2, 1100, 64, 64, mode, [1100, 700], torch.float32, seed=6)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    expected, _ = reference.attention(q, k, v, 64, allowed)
    grad_out = torch.randn_like(expected)
    got = run_attention(ra.fused_relative_attention, q, k, v, mask, 64)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    for name, g, e in zip(
        "qkv",
        torch.autograd.grad((got * grad_out).sum(), (q, k, v)),
        torch.autograd.grad((expected * grad_out).sum(), (q, k, v)),
    ):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=0, msg=f"d{name}")


def test_kernel_unavailable_falls_back_to_three_regions(monkeypatch):
    monkeypatch.setenv("NEZHA_HF_KERNEL", "0")
    attention_kernel.compiled_kernel.cache_clear()
    try:
        assert attention_kernel.compiled_kernel() is None
        calls = count_calls(monkeypatch, three_regions.ThreeRegionFunction)
        q, k, v, mask, allowed = make_case(1, 2, 600, 16, 8, "causal", [550], torch.float32, seed=7)
        expected, _ = reference.attention(q, k, v, 8, allowed)
        got = run_attention(ra.fused_relative_attention, q, k, v, mask, 8)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
        assert calls, "the three-region path did not run"
    finally:
        monkeypatch.delenv("NEZHA_HF_KERNEL")
        attention_kernel.compiled_kernel.cache_clear()
