"""The three attention paths against the independent O(L^2 d) reference, outputs and gradients."""

import pytest
import reference
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nezha_hf import relative_attention as ra


PATHS = (ra.gather_relative_attention, ra.three_region_attention, ra.fused_relative_attention)


class FakeModule(torch.nn.Module):
    def __init__(self, max_relative_position):
        super().__init__()
        self.max_relative_position = max_relative_position


def make_case(batch, heads, length, head_size, K, mode, pad_lengths, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, heads, length, head_size, generator=g, dtype=dtype) for _ in range(3))
    valid = None
    if pad_lengths is not None:
        valid = torch.arange(length)[None, :] < torch.tensor(pad_lengths)[:, None]
    source = None
    if mode == "prefix":
        source_lengths = torch.randint(1, length + 1, (batch,), generator=g)
        source = torch.arange(length)[None, :] < source_lengths[:, None]
    mask = ra.RelativeAttentionMask(key_is_valid=valid, causal=mode != "bidirectional", key_is_source=source)
    allowed = reference.allowed_mask(length, valid, mode != "bidirectional", source)
    return q, k, v, mask, allowed


def run(path, q, k, v, mask, K):
    table = ra.sinusoid_relative_table(K, q.shape[-1]).to(q.dtype)
    out, _ = path(FakeModule(K).eval(), q, k, v, mask, q.shape[-1] ** -0.5, relative_table=table)
    return out.transpose(1, 2)


def check_against_reference(q, k, v, mask, allowed, K, atol):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    expected, _ = reference.attention(q, k, v, K, allowed)
    grad_out = torch.randn_like(expected)
    expected_grads = torch.autograd.grad((expected * grad_out).sum(), (q, k, v))
    for path in PATHS:
        got = run(path, q, k, v, mask, K)
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


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=attention_cases())
def test_paths_match_reference_float32(case, monkeypatch_module):
    q, k, v, mask, allowed = make_case(**case, dtype=torch.float32)
    check_against_reference(q, k, v, mask, allowed, case["K"], atol=1e-5)


@pytest.fixture(scope="module")
def monkeypatch_module():
    # Force the three-region path at every length (by default short inputs use the gather maths).
    mp = pytest.MonkeyPatch()
    mp.setattr(ra, "THREE_REGIONS_MIN_LENGTH", 1)
    mp.setattr(ra, "BAND_BLOCK_SIZE", 16)  # several blocks, and lengths that do not fill one
    mp.setattr(ra, "KERNEL_BLOCK_SIZES", (8, 16))  # the kernel's online softmax over several key blocks
    yield mp
    mp.undo()


@pytest.mark.parametrize("implementation, loads", [(None, True), ("nezha_fused", True), ("eager", False)])
def test_kernel_is_loaded_with_the_model(implementation, loads, monkeypatch):
    # A model on the kernel path loads it when it is created, not inside its first forward pass.
    from nezha_hf import NezhaConfig, NezhaModel

    monkeypatch.setattr(ra, "_compiled_kernel", {})
    config = NezhaConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    NezhaModel._from_config(config, attn_implementation=implementation)
    assert ("module" in ra._compiled_kernel) == loads
    if loads:
        assert ra._compiled_kernel["module"] is not None


@pytest.mark.parametrize("mode", ["bidirectional", "causal", "prefix"])
def test_three_regions_gradcheck_float64(mode, monkeypatch_module):
    q, k, v, mask, _ = make_case(2, 2, 23, 4, 3, mode, [23, 15], torch.float64, seed=1)
    table = ra.sinusoid_relative_table(3, 4).double()

    def fn(q, k, v):
        return ra.three_region_attention(FakeModule(3).eval(), q, k, v, mask, 0.5, relative_table=table)[0]

    assert torch.autograd.gradcheck(fn, tuple(t.requires_grad_() for t in (q, k, v)))


@pytest.mark.parametrize("mode", ["bidirectional", "causal", "prefix"])
@pytest.mark.parametrize("length,K", [(41, 9), (41, 4), (13, 12)])
def test_band_windows_and_chunks(mode, length, K, monkeypatch_module, monkeypatch):
    # Blocks of 4 queries: band windows reach up to 3 blocks on each side, and the band runs in
    # several chunks of 3 blocks; the batch mixes padded and unpadded sequences.
    monkeypatch.setattr(ra, "BAND_BLOCK_SIZE", 4)
    monkeypatch.setattr(ra, "BAND_BLOCKS_PER_CHUNK", 3)
    q, k, v, mask, allowed = make_case(3, 2, length, 8, K, mode, [length, 7, length - 2], torch.float32, seed=5)
    check_against_reference(q, k, v, mask, allowed, K, atol=1e-5)


def test_band_rotary_identity_far_from_the_start():
    # The band's key term is (M(a_i) q) . E_j; it must equal q . T[j - i + K] at large positions too,
    # where float32 angles would be off by 1e-3 (the angles are computed in float64).
    K, size = 64, 64
    table = ra.sinusoid_relative_table(K, size).double()
    band = ra._Band(20000, K, ra.RelativeAttentionMask(), size, torch.device("cpu"))
    q = torch.randn(1, size, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for i in (0, 5000, 19990):
        rotated = ra._reflect(q, [r[0] for r in band._query_rotation(slice(i, i + 1), torch.float64)])
        for j in (max(i - K + 1, 0), i, i + K - 1):
            sin, cos = band._angles(torch.tensor([j]))
            rotary = torch.stack((cos, sin), -1).flatten(-2)[0, 0]
            torch.testing.assert_close(rotated[0] @ rotary, q[0] @ table[j - i + K], atol=1e-5, rtol=0)


def count_calls(monkeypatch, function) -> list:
    """Record every call of an autograd Function's `apply` (the list grows by one per call)."""
    calls = []
    original = function.apply
    monkeypatch.setattr(function, "apply", lambda *a: calls.append(1) or original(*a))
    return calls


@pytest.mark.parametrize(
    "path,function",
    [(ra.three_region_attention, ra._ThreeRegionFunction), (ra.fused_relative_attention, ra._KernelFunction)],
)
def test_linear_memory_paths_are_used(path, function, monkeypatch_module, monkeypatch):
    calls = count_calls(monkeypatch, function)
    q, k, v, mask, _ = make_case(1, 1, 40, 8, 4, "bidirectional", None, torch.float32, seed=0)
    run(path, q, k, v, mask, 4)
    assert calls, f"{function.__name__} did not run"


def test_fused_kernel_contract():
    # The backward reuses the fused kernel with a shifted `out` and `lse`; this pins the contract it
    # relies on (out enters only through rowsum(dO * out)), so a PyTorch change fails here loudly.
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 9, 4, dtype=torch.float64) for _ in range(3))
    out, lse = ra._flash_forward(q, k, v, 0.0, True, scale=0.5)
    grad = torch.randn_like(out)
    shift = torch.randn(4, dtype=torch.float64)
    base = ra._flash_backward(grad, q, k, v, out, lse, 0.0, True, scale=0.5)
    # With `out - s` the kernel must use rowsum(dO * (out - s)) in dS and leave dV unchanged.
    shifted = ra._flash_backward(grad, q, k, v, out - shift, lse, 0.0, True, scale=0.5)
    probs = torch.softmax((q @ k.transpose(-1, -2) * 0.5).masked_fill(~torch.ones(9, 9, dtype=torch.bool).tril(), -torch.inf), -1)
    d_probs = grad @ v.transpose(-1, -2)
    row = ((grad * (out - shift)).sum(-1, keepdim=True))
    d_scores = probs * (d_probs - row)
    torch.testing.assert_close(shifted[0], 0.5 * d_scores @ k)
    torch.testing.assert_close(shifted[2], base[2])  # dV does not depend on out


def test_fully_masked_rows_no_nan(monkeypatch_module):
    q, k, v, mask, _ = make_case(2, 2, 30, 8, 4, "bidirectional", [30, 1], torch.float32, seed=3)
    mask.key_is_valid[1] = False  # the whole second sequence is padding
    for path in PATHS:
        out = run(path, q, k, v, mask, 4)
        assert not out.isnan().any()
        if path is not ra.gather_relative_attention:  # gather averages uniformly, as transformers 4.x did
            assert not out[1].any(), f"{path.__name__}: a row with no visible key must be zero"


@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 3e-2)])
def test_low_precision_close_to_float32(dtype, atol, monkeypatch_module):
    q, k, v, mask, _ = make_case(1, 2, 300, 16, 8, "bidirectional", [250], torch.float32, seed=4)
    full = run(ra.gather_relative_attention, q, k, v, mask, 8)
    for path in PATHS:  # the kernel is float32 only: bfloat16 goes to three regions
        low = run(path, q.to(dtype), k.to(dtype), v.to(dtype), mask, 8)
        assert not low.isnan().any()
        torch.testing.assert_close(low.float(), full, atol=atol, rtol=0)


def test_kernel_builds():
    # CI has a compiler and ninja: a kernel that fails to build must fail here, not fall back quietly.
    assert ra.compiled_kernel() is not None, "the compiled attention kernel did not build (see the logged error)"


@pytest.mark.parametrize("mode", ["bidirectional", "causal", "prefix"])
def test_kernel_default_blocks_base_size(mode):
    # The kernel's own block sizes (256 queries, 512 keys) over 1,100 tokens: three key blocks, a
    # partial last block, K and head size of the base model; the batch mixes padded and full rows.
    q, k, v, mask, allowed = make_case(2, 2, 1100, 64, 64, mode, [1100, 700], torch.float32, seed=6)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    expected, _ = reference.attention(q, k, v, 64, allowed)
    grad_out = torch.randn_like(expected)
    got = run(ra.fused_relative_attention, q, k, v, mask, 64)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    for name, g, e in zip(
        "qkv",
        torch.autograd.grad((got * grad_out).sum(), (q, k, v)),
        torch.autograd.grad((expected * grad_out).sum(), (q, k, v)),
    ):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=0, msg=f"d{name}")


def test_kernel_unavailable_falls_back_to_three_regions(monkeypatch):
    monkeypatch.setattr(ra, "_compiled_kernel", {})
    monkeypatch.setenv("NEZHA_HF_KERNEL", "0")
    assert ra.compiled_kernel() is None
    calls = count_calls(monkeypatch, ra._ThreeRegionFunction)
    q, k, v, mask, allowed = make_case(1, 2, 600, 16, 8, "causal", [550], torch.float32, seed=7)
    expected, _ = reference.attention(q, k, v, 8, allowed)
    torch.testing.assert_close(run(ra.fused_relative_attention, q, k, v, mask, 8), expected, atol=1e-5, rtol=0)
    assert calls, "the three-region path did not run"
