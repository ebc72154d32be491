"""The three-region engine: gradients, band windows and chunks, the rotary identity, the PyTorch kernel it relies on."""

import pytest
import torch
from helpers import make_case
from test_relative_attention import check_against_reference

from nezha_hf import relative_attention as ra
from nezha_hf import three_regions
from nezha_hf.attention_ops import AttentionProblem


@pytest.fixture
def three_regions_always(monkeypatch):
    """Three regions at every length (by default short inputs use the gather maths)."""
    monkeypatch.setattr(ra, "THREE_REGIONS_MIN_LENGTH", 1)


@pytest.mark.slow  # the whole Jacobian, column by column: 25-100 s a mode on 2 cores
@pytest.mark.parametrize("mode", ["bidirectional", "causal", "prefix"])
def test_three_regions_gradcheck_float64(mode, three_regions_always, monkeypatch):
    monkeypatch.setattr(three_regions, "BAND_BLOCK_SIZE", 16)
    q, k, v, mask, _ = make_case(2, 2, 23, 4, 3, mode, [23, 15], torch.float64, seed=1)
    table = ra.sinusoid_relative_table(3, 4).double()

    def fn(q, k, v):
        return ra.ENGINES[ra.Engine.THREE_REGIONS].run(q, k, v, table, AttentionProblem(mask, 0.5))[0]

    assert torch.autograd.gradcheck(fn, tuple(t.requires_grad_() for t in (q, k, v)))


@pytest.mark.parametrize("mode", ["bidirectional", "causal", "prefix"])
@pytest.mark.parametrize("length,K", [(41, 9), (41, 4), (13, 12)])
def test_band_windows_and_chunks(mode, length, K, three_regions_always, monkeypatch):
    # Blocks of 4 queries: band windows reach up to 3 blocks on each side, and the band runs in
    # several chunks of 3 blocks; the batch mixes padded and unpadded sequences.
    monkeypatch.setattr(three_regions, "BAND_BLOCK_SIZE", 4)
    monkeypatch.setattr(three_regions, "BAND_BLOCKS_PER_CHUNK", 3)
    q, k, v, mask, allowed = make_case(3, 2, length, 8, K, mode, [length, 7, length - 2], torch.float32, seed=5)
    check_against_reference(q, k, v, mask, allowed, K, atol=1e-5)


def test_band_rotary_identity_far_from_the_start():
    # The band's key term is (M(a_i) q) . E_j; it must equal q . T[j - i + K] at large positions too,
    # where float32 angles would be off by 1e-3 (the angles are computed in float64).
    K, size = 64, 64
    table = ra.sinusoid_relative_table(K, size).double()
    band = three_regions.Band(20000, K, ra.sinusoid_frequencies(size), ra.RelativeAttentionMask())
    q = torch.randn(1, size, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for i in (0, 5000, 19990):
        rotated = three_regions.reflect(q, [r[0] for r in band.query_rotation(slice(i, i + 1), torch.float64)])
        for j in (max(i - K + 1, 0), i, i + K - 1):
            sin, cos = band.angles(torch.tensor([j]))
            rotary = torch.stack((cos, sin), -1).flatten(-2)[0, 0]
            torch.testing.assert_close(rotated[0] @ rotary, q[0] @ table[j - i + K], atol=1e-5, rtol=0)


def test_fused_kernel_contract():
    # The backward reuses the fused kernel with a shifted `out` and `lse`; this pins the contract it
    # relies on (out enters only through rowsum(dO * out)), so a PyTorch change fails here loudly.
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 9, 4, dtype=torch.float64) for _ in range(3))
    out, lse = three_regions.flash_forward(q, k, v, 0.0, True, scale=0.5)
    grad = torch.randn_like(out)
    shift = torch.randn(4, dtype=torch.float64)
    base = three_regions.flash_backward(grad, q, k, v, out, lse, 0.0, True, scale=0.5)
    # With `out - s` the kernel must use rowsum(dO * (out - s)) in dS and leave dV unchanged.
    shifted = three_regions.flash_backward(grad, q, k, v, out - shift, lse, 0.0, True, scale=0.5)
    probs = torch.softmax((q @ k.transpose(-1, -2) * 0.5).masked_fill(~torch.ones(9, 9, dtype=torch.bool).tril(), -torch.inf), -1)
    d_probs = grad @ v.transpose(-1, -2)
    row = ((grad * (out - shift)).sum(-1, keepdim=True))
    d_scores = probs * (d_probs - row)
    torch.testing.assert_close(shifted[0], 0.5 * d_scores @ k)
    torch.testing.assert_close(shifted[2], base[2])  # dV does not depend on out
