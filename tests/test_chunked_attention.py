"""The chunked path: against the reference in any chunking, with caches, dropout and bfloat16, and in linear memory."""

import dataclasses

import pytest
import reference
import torch
from helpers import make_case, tiny_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from nezha_hf import NezhaConfig, NezhaModel, chunked_attention
from nezha_hf import relative_attention as ra
from nezha_hf.attention_ops import AttentionProblem


def run(q, k, v, mask, K, offset=0, dropout=0.0, seed=0):
    table = ra.sinusoid_relative_table(K, q.shape[-1]).to(q.device, q.dtype)
    key_is_valid, key_is_source = (None if t is None else t.to(q.device) for t in (mask.key_is_valid, mask.key_is_source))
    mask = dataclasses.replace(mask, key_is_valid=key_is_valid, key_is_source=key_is_source, query_offset=offset)
    problem = AttentionProblem(mask, q.shape[-1] ** -0.5, dropout, torch.tensor(seed))
    return chunked_attention.chunked_attention(q, k, v, table, problem).transpose(1, 2)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    length=st.integers(1, 90), K=st.integers(1, 20), rows=st.integers(1, 40), new=st.integers(0, 10),
    mode=st.sampled_from(["bidirectional", "causal", "prefix"]), padded=st.booleans(), seed=st.integers(0, 999),
)
def test_any_chunking_matches_the_reference(length, K, rows, new, mode, padded, seed, monkeypatch):
    """Chunks of `rows` queries (dividing the length or not, smaller than K or not); with `new` > 0 only the last
    `new` queries are run against all keys, as when decoding with a cache."""
    monkeypatch.setattr(chunked_attention, "CHUNK_SCORES", 1)
    monkeypatch.setattr(chunked_attention, "MIN_CHUNK_ROWS", rows)
    pad = [length, max(1, length - 3)] if padded else None
    q, k, v, mask, allowed = make_case(2, 2, length, 8, K, mode, pad, torch.float32, seed)
    new = min(new, length) if mode != "bidirectional" else 0
    offset = length - new if new else 0
    q_run = q[..., offset:, :].clone().requires_grad_()
    k, v = k.clone().requires_grad_(), v.clone().requires_grad_()
    got = run(q_run, k, v, mask, K, offset)
    q_ref = q.clone().requires_grad_()
    expected = reference.attention(q_ref, k, v, K, allowed)[0][..., offset:, :]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    grad = torch.randn_like(got)
    got_grads = torch.autograd.grad((got * grad).sum(), (q_run, k, v))
    expected_grads = torch.autograd.grad((expected * grad).sum(), (q_ref, k, v))
    for name, a, b in zip("qkv", got_grads, (expected_grads[0][..., offset:, :], *expected_grads[1:])):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=f"d{name}")


def chunk_keep_mask(q, k, mask, K, p, seed):
    """The keep mask the chunked path draws, rebuilt chunk by chunk (as the forward chunks) with the generators it
    seeds."""
    table = ra.sinusoid_relative_table(K, q.shape[-1])
    keep = torch.ones(*q.shape[:-1], k.shape[-2])  # keys a chunk never sees are masked anyway
    for chunk in chunked_attention._chunks(q, k, table, AttentionProblem(mask, 1.0), buffers=1):
        shape = (*q.shape[:2], chunk.size, chunk.keys)
        keep[..., chunk.rows, : chunk.keys] = chunk.keep(shape, p, seed, q.device) * (1 - p)
    return keep


@pytest.mark.parametrize("mode", ["bidirectional", "causal", "prefix"])
def test_dropout_matches_the_reference_given_the_same_mask(mode, monkeypatch):
    """The forward runs chunks of two 7-query groups and the backward chunks of one (it holds two buffers), so the
    gradients match only if the backward redraws the forward's mask in its own chunking."""
    monkeypatch.setattr(chunked_attention, "CHUNK_SCORES", 14 * 2 * 2 * 50)
    monkeypatch.setattr(chunked_attention, "MIN_CHUNK_ROWS", 7)
    assert [chunked_attention.chunk_rows(2, 2, 50, 50, buffers) for buffers in (1, 2)] == [14, 7]
    p, seed = 0.3, 1234
    q, k, v, mask, allowed = make_case(2, 2, 50, 8, 6, mode, [50, 41], torch.float32, seed=2)
    keep = chunk_keep_mask(q, k, mask, 6, p, seed)
    assert 0.6 < keep[allowed.expand_as(keep)].mean() < 0.8  # of the entries a query can see
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    got = run(*leaves, mask, 6, dropout=p, seed=seed)
    references = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = reference.attention(*references, 6, allowed, keep=keep, dropout=p)[0]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    grad = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad((got * grad).sum(), leaves), torch.autograd.grad((expected * grad).sum(), references)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_dropout_is_seeded_and_differs_across_seeds():
    q, k, v, mask, _ = make_case(1, 2, 64, 8, 4, "bidirectional", None, torch.float32, seed=0)
    first, again, other = (run(q, k, v, mask, 4, dropout=0.2, seed=s) for s in (7, 7, 8))
    assert torch.equal(first, again) and not torch.equal(first, other)


@pytest.mark.parametrize("mode", ["bidirectional", "causal"])
def test_the_dropout_mask_does_not_depend_on_the_chunking(mode, monkeypatch):
    q, k, v, mask, _ = make_case(2, 2, 90, 8, 4, mode, [90, 70], torch.float32, seed=4)
    monkeypatch.setattr(chunked_attention, "MIN_CHUNK_ROWS", 8)
    outputs = []
    for scores in (1, 3 * 8 * 2 * 2 * 90, 1 << 30):  # chunks of 8, 24 and all 90 queries
        monkeypatch.setattr(chunked_attention, "CHUNK_SCORES", scores)
        outputs.append(run(q, k, v, mask, 4, dropout=0.3, seed=5))
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(outputs[2], outputs[0], atol=1e-6, rtol=0)


def test_bfloat16_forward_and_backward_close_to_float32():
    q, k, v, mask, allowed = make_case(2, 2, 120, 16, 8, "prefix", [120, 100], torch.float32, seed=5)
    leaves = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    got = run(*leaves, mask, 8)
    references = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = reference.attention(*references, 8, allowed)[0]
    torch.testing.assert_close(got.float(), expected, atol=3e-2, rtol=0)
    grad = torch.randn_like(expected)
    for a, b in zip(torch.autograd.grad((got.float() * grad).sum(), leaves),
                    torch.autograd.grad((expected * grad).sum(), references)):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b, atol=8e-2, rtol=0)


# --- accelerators: run where one exists ----------------------------------------------------------


def accelerator(name):
    backend = getattr(torch, name, None)
    available = backend is not None and backend.is_available()
    return pytest.param(name, marks=pytest.mark.skipif(not available, reason=f"no {name} device on this machine"))


@pytest.mark.parametrize("device", [accelerator("cuda"), accelerator("mps"), accelerator("xpu")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_an_accelerator_the_chunked_path_runs_and_matches_the_reference(device, dtype, attention_calls):
    """A model created on the device runs the chunked path (the kernel is CPU code); forward and gradients against the
    reference computed on the CPU in float32."""
    with torch.device(device):
        model = NezhaModel(tiny_config(max_relative_position=6)).to(dtype).eval()
    q, k, v, mask, allowed = make_case(2, 2, 300, 8, 6, "prefix", [300, 250], torch.float32, seed=9)
    leaves = [t.to(device, dtype).requires_grad_() for t in (q, k, v)]
    got = run(*leaves, mask, 6)
    references = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = reference.attention(*references, 6, allowed)[0]
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float().cpu(), expected, atol=tolerance, rtol=0)
    grad = torch.randn_like(expected)
    for a, b in zip(torch.autograd.grad((got.float().cpu() * grad).sum(), leaves),
                    torch.autograd.grad((expected * grad).sum(), references)):
        torch.testing.assert_close(a.float().cpu(), b, atol=tolerance * 3, rtol=0)
    model(torch.randint(0, 99, (2, 40), device=device))
    assert {call.ran for call in attention_calls} == {ra.Engine.CHUNKED}, attention_calls


# --- linear memory ------------------------------------------------------------------------------------


class LargestAllocation(TorchDispatchMode):
    """Remembers the element count of the largest tensor any operation returns (what it had to allocate)."""

    def __init__(self):
        super().__init__()
        self.largest, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(tensor, torch.Tensor) and tensor.numel() > self.largest:
                self.largest, self.op = tensor.numel(), func
        return out


LONG = 16384
BASE_LAYER = dict(vocab_size=100, hidden_size=768, num_hidden_layers=1, num_attention_heads=12, intermediate_size=3072,
                  max_relative_position=64, attention_probs_dropout_prob=0.1, hidden_dropout_prob=0.1)


@pytest.mark.parametrize("implementation", [ra.Engine.FUSED.value, ra.Engine.CHUNKED.value, ra.Engine.THREE_REGIONS.value])
def test_no_selectable_implementation_allocates_length_squared_on_meta(implementation):
    """A base-width layer, 16,384 tokens, training with dropout, forward and backward on the meta device: no tensor of
    L x L per head anywhere (the gather path would need 12 x 16384^2)."""
    with torch.device("meta"):
        model = NezhaModel._from_config(NezhaConfig(**BASE_LAYER), attn_implementation=implementation).train()
    ids = torch.zeros(1, LONG, dtype=torch.long, device="meta")
    with LargestAllocation() as mode:
        model(ids).last_hidden_state.sum().backward()
    # The largest tensors are the feed-forward's (L x 3072) and a chunk's scores; one head's L x L would be 16384^2.
    assert mode.largest < LONG * LONG, (mode.op, mode.largest)


def test_the_chunked_engine_itself_stays_linear_on_meta():
    """The op's own forward and backward (what runs on a GPU), executed on meta tensors, chunk by chunk."""
    heads, size = 12, 64
    q, k, v, grad = (torch.empty(1, heads, LONG, size, device="meta") for _ in range(4))
    table = torch.empty(129, size, device="meta")
    flags = dict(key_is_valid=torch.empty(1, LONG, dtype=torch.bool, device="meta"))
    problem = AttentionProblem(ra.RelativeAttentionMask(**flags), 0.125, 0.1, torch.tensor(3))
    with LargestAllocation() as mode:
        [out] = chunked_attention.forward_chunks(q, k, v, table, problem)
        chunked_attention.backward_chunks(grad, q, k, v, table, problem, out.transpose(1, 2))
    # The largest tensors are a chunk buffer and the keys or values with their two tail columns (heads x L x (d + 3)).
    assert mode.largest <= max(chunked_attention.CHUNK_SCORES, heads * LONG * (size + 3)), (mode.op, mode.largest)


def test_model_on_the_chunked_path_matches_the_gather_path():
    torch.manual_seed(0)
    model = NezhaModel(tiny_config()).eval()
    ids = torch.randint(1, 99, (2, 70))
    mask = torch.ones_like(ids)
    mask[1, 50:] = 0
    with torch.no_grad():
        model.set_attn_implementation("eager")
        expected = model(ids, attention_mask=mask).last_hidden_state
        model.set_attn_implementation(ra.Engine.CHUNKED.value)
        got = model(ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
