"""The fused kernel: it builds and loads with the model, and is exact at its own block sizes, with a cache, with
dropout (against a mask re-derived here from the seed), in bfloat16 and float16, from other threads, on odd
strides; it refuses a second derivative; its build cache survives stale locks, bad settings, unusable folders,
other checkouts and other environments."""

import dataclasses
import math
import os
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import reference
import torch
from helpers import make_case, run_attention

from nezha_hf import NezhaConfig, NezhaModel, fused_attention
from nezha_hf.attention_ops import AttentionProblem
from nezha_hf import relative_attention as ra


def kernel(q, k, v, mask, K, offset=0, dropout=0.0, seed=0):
    table = ra.sinusoid_relative_table(K, q.shape[-1])
    problem = AttentionProblem(dataclasses.replace(mask, query_offset=offset), q.shape[-1] ** -0.5, dropout,
                               torch.tensor(seed))
    return fused_attention.fused_attention(q, k, v, table, problem).transpose(1, 2)


def assert_matches(got, expected, leaves, expected_leaves, atol=1e-5):
    torch.testing.assert_close(got, expected, atol=atol, rtol=0)
    grad = torch.randn_like(got)
    for name, a, b in zip("qkv", torch.autograd.grad((got * grad).sum(), leaves),
                          torch.autograd.grad((expected * grad).sum(), expected_leaves)):
        torch.testing.assert_close(a, b, atol=atol, rtol=0, msg=f"d{name}")


def test_kernel_builds():
    # CI has a compiler and ninja: a kernel that fails to build must fail here, not fall back quietly.
    assert fused_attention.fused_kernel() is not None, "the fused attention kernel did not build (see the log)"


@pytest.mark.parametrize("implementation, loads", [(None, True), ("nezha_fused", True), ("eager", False),
                                                   ("nezha_chunked", False)])
def test_kernel_is_loaded_with_the_model_that_uses_it(implementation, loads):
    fused_attention.forget_fused_kernel()
    config = NezhaConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    NezhaModel._from_config(config, attn_implementation=implementation)
    assert fused_attention.fused_kernel_loaded() == loads


def test_kernel_is_not_built_for_a_model_made_for_another_device(tmp_path):
    fused_attention.forget_fused_kernel()
    config = NezhaConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    ra.prepare_attention(None, "cuda")
    with torch.device("meta"):  # what from_pretrained builds on before the weights are placed
        NezhaModel(config)
    assert not fused_attention.fused_kernel_loaded()
    NezhaModel(config).save_pretrained(tmp_path)
    fused_attention.forget_fused_kernel()
    NezhaModel.from_pretrained(tmp_path)  # placed on the CPU: now it is built
    assert fused_attention.fused_kernel_loaded()


@pytest.mark.parametrize("mode", ["bidirectional", "causal", "prefix"])
def test_kernel_default_blocks_base_size(mode):
    # The kernel's own blocks (256 queries, 512 keys) over 1,100 tokens: three key blocks, a partial last block,
    # K and head size of the base model; the batch mixes padded and full rows. Forward and backward.
    assert fused_attention.KERNEL_BLOCK_SIZES == (0, 0)
    q, k, v, mask, allowed = make_case(2, 2, 1100, 64, 64, mode, [1100, 700], torch.float32, seed=6)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    references = [t.clone().requires_grad_() for t in (q, k, v)]
    assert_matches(kernel(*leaves, mask, 64), reference.attention(*references, 64, allowed)[0], leaves, references)


@pytest.mark.parametrize("mode", ["causal", "prefix"])
def test_kernel_with_a_kv_cache(mode):
    """The last 5 queries against all 700 keys, as a decoding step with a cache sees them."""
    q, k, v, mask, allowed = make_case(2, 2, 700, 16, 8, mode, [700, 650], torch.float32, seed=8)
    new = 5
    leaves = [q[..., -new:, :].clone().requires_grad_(), k.clone().requires_grad_(), v.clone().requires_grad_()]
    references = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = reference.attention(*references, 8, allowed)[0][..., -new:, :]
    got = kernel(*leaves, mask, 8, offset=700 - new)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    grad = torch.randn_like(got)
    got_grads = torch.autograd.grad((got * grad).sum(), leaves)
    expected_grads = torch.autograd.grad((expected * grad).sum(), references)
    torch.testing.assert_close(got_grads[0], expected_grads[0][..., -new:, :], atol=1e-5, rtol=0)
    for a, b in zip(got_grads[1:], expected_grads[1:]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("new", [1, 16, 17], ids=lambda n: f"{n}-queries")
def test_few_queries_read_the_keys_where_they_lie(new, dtype):
    """Up to 16 queries (a decoding step) are multiplied with the keys and values in place, not prepared for block
    products first (`kDirectQueries`); 17 take the blocks. Both against the reference, with padding, the UniLM mask, a
    cache's offset and dropout (the kernel's hash-drawn mask), forward and gradients."""
    p, seed, length, K = 0.3, 42, 90, 6
    q, k, v, mask, allowed = make_case(2, 3, length, 16, K, "prefix", [90, 70], torch.float64, seed=3)
    low = [t.to(dtype) for t in (q[..., -new:, :], k, v)]
    leaves = [t.clone().requires_grad_() for t in low]
    exact = [t.double().requires_grad_() for t in (low[0], low[1], low[2])]
    full_query = torch.cat([q[..., :-new, :], exact[0]], -2)
    keep = kernel_keep_mask(seed, 2, 3, length, length, p)
    expected = reference.attention(full_query, exact[1], exact[2], K, allowed, keep=keep, dropout=p)[0][..., -new:, :]
    got = kernel(*leaves, mask, K, offset=length - new, dropout=p, seed=seed)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.double(), expected, atol=tolerance, rtol=0)
    grad = torch.randn(expected.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for name, a, b in zip("qkv", torch.autograd.grad((got.double() * grad).sum(), leaves),
                          torch.autograd.grad((expected * grad).sum(), exact)):
        torch.testing.assert_close(a.double(), b, atol=5 * tolerance, rtol=0, msg=f"d{name}")


# --- dropout ---------------------------------------------------------------------------------------------


def mix32(x):
    """lowbias32, written out here from its definition (uint32 arithmetic wraps in numpy)."""
    x = np.asarray(x, dtype=np.uint32)
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint32(16))
        x = x * np.uint32(0x7FEB352D)
        x = x ^ (x >> np.uint32(15))
        x = x * np.uint32(0x846CA68B)
        return x ^ (x >> np.uint32(16))


def kernel_keep_mask(seed, batch, heads, queries, keys, p, offset=0):
    """The kernel's keep mask: hash(seed, batch * heads + head, query position i, key j) >= p * 2^32."""
    lo, hi = np.uint32(seed & 0xFFFFFFFF), np.uint32(seed >> 32)
    rows = mix32(mix32(mix32(lo ^ mix32(hi)) ^ np.arange(batch * heads, dtype=np.uint32))[:, None]
                 ^ np.arange(offset, offset + queries, dtype=np.uint32)[None, :])
    with np.errstate(over="ignore"):
        columns = np.arange(keys, dtype=np.uint32) * np.uint32(0x9E3779B9)
    bits = mix32(rows[..., None] ^ columns[None, None, :])
    return torch.from_numpy(bits >= np.uint32(min(math.ldexp(p, 32), 2**32 - 1))).view(batch, heads, queries, keys)


@pytest.mark.parametrize("mode", ["bidirectional", "causal", "prefix"])
def test_dropout_matches_the_reference_given_the_same_mask(mode, monkeypatch):
    monkeypatch.setattr(fused_attention, "KERNEL_BLOCK_SIZES", (16, 32))  # several blocks each way
    p, seed = 0.3, 123456789123
    q, k, v, mask, allowed = make_case(2, 3, 150, 8, 6, mode, [150, 130], torch.float32, seed=1)
    keep = kernel_keep_mask(seed, 2, 3, 150, 150, p)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    references = [t.clone().requires_grad_() for t in (q, k, v)]
    assert_matches(kernel(*leaves, mask, 6, dropout=p, seed=seed),
                   reference.attention(*references, 6, allowed, keep=keep, dropout=p)[0], leaves, references)


def test_dropout_rate_and_mean_are_preserved():
    """Over many rows: the drop rate is p, and the dropped probabilities still sum to 1 on average."""
    p, rows = 0.1, 4096
    # One key per row per head makes out = keep_ij / (1 - p) * (v + T[K]) with v = -T[K] + 1: out = keep / (1 - p).
    K, size = 2, 4
    table = ra.sinusoid_relative_table(K, size)
    q = torch.zeros(8, 4, rows, size)
    k = torch.zeros(8, 4, rows, size)
    v = (1 - table[K]).expand(8, 4, rows, size).contiguous()
    valid = torch.zeros(8, rows, dtype=torch.bool)
    valid[:, 0] = True  # every query sees only key 0, at distance clip(0 - i) -> row 0 for i >= K
    v[:, :, 0] = 1 - table[0]
    out = fused_attention.fused_attention(q, k, v, table, AttentionProblem(ra.RelativeAttentionMask(valid), 0.5, p,
                                                                           torch.tensor(99)))
    out = out[:, K:, :, 0]  # queries from K on see key 0 at table row 0
    kept = out * (1 - p)
    assert set(kept.unique().round(decimals=4).tolist()) <= {0.0, 1.0}
    assert abs(1 - kept.mean().item() - p) < 0.01  # 131,000 draws: 3 standard deviations of the rate is 0.0025
    assert abs(out.mean().item() - 1) < 0.015  # the mean is preserved


def test_dropout_is_reproducible_under_manual_seed_and_differs_between_calls():
    config = NezhaConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                         attention_probs_dropout_prob=0.2, hidden_dropout_prob=0.0)
    torch.manual_seed(0)
    model = NezhaModel(config).train()
    ids = torch.randint(0, 50, (2, 60))
    torch.manual_seed(5)
    first, second = model(ids).last_hidden_state, model(ids).last_hidden_state
    torch.manual_seed(5)
    again = model(ids).last_hidden_state
    assert torch.equal(first, again) and not torch.equal(first, second)


def test_dropout_backward_agrees_with_finite_differences():
    """With the seed fixed the output is a function of q, k, v: its gradient matches central differences."""
    q, k, v, mask, _ = make_case(1, 2, 40, 8, 4, "prefix", [33], torch.float32, seed=3)
    q, k, v = (t.double().float().requires_grad_() for t in (q, k, v))
    direction = [torch.randn_like(t) for t in (q, k, v)]
    weight = torch.randn(1, 2, 40, 8)

    def loss(*tensors):
        return (kernel(*tensors, mask, 4, dropout=0.25, seed=77) * weight).sum()

    analytic = sum((g * d).sum() for g, d in zip(torch.autograd.grad(loss(q, k, v), (q, k, v)), direction))
    eps = 1e-2
    with torch.no_grad():
        plus = loss(*(t + eps * d for t, d in zip((q, k, v), direction)))
        minus = loss(*(t - eps * d for t, d in zip((q, k, v), direction)))
    assert torch.allclose(analytic, (plus - minus) / (2 * eps), rtol=2e-3, atol=2e-3), (analytic, (plus - minus) / (2 * eps))


# --- robustness ------------------------------------------------------------------------------------------


def test_second_derivatives_are_refused_clearly():
    q, k, v, mask, _ = make_case(1, 2, 20, 8, 4, "bidirectional", None, torch.float32, seed=0)
    q.requires_grad_()
    (grad,) = torch.autograd.grad(kernel(q, k, v, mask, 4).pow(2).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="no second derivative"):
        grad.pow(2).sum().backward()


def test_kernel_releases_the_gil():
    """While one thread runs the kernel, another keeps running Python (with the GIL held it would stall throughout)."""
    q, k, v, mask, _ = make_case(1, 4, 3000, 64, 64, "bidirectional", None, torch.float32, seed=0)
    kernel(q, k, v, mask, 64)  # warm up
    done, ticks = threading.Event(), []
    worker = threading.Thread(target=lambda: (kernel(q, k, v, mask, 64), kernel(q, k, v, mask, 64), done.set()))
    start = time.perf_counter()
    worker.start()
    while not done.is_set():
        ticks.append(time.perf_counter())
        sum(range(200))
    worker.join()
    duration = time.perf_counter() - start
    longest_stall = max(b - a for a, b in zip([start, *ticks], [*ticks, time.perf_counter()]))
    assert len(ticks) > 100 and longest_stall < duration / 3, (len(ticks), longest_stall, duration)


def test_expanded_inputs_are_read_correctly():
    """Stride-0 (expanded) length and batch dimensions give the same result as the same data laid out normally."""
    q, k, v, mask, _ = make_case(1, 2, 1, 8, 4, "bidirectional", None, torch.float32, seed=0)
    q, k, v = (t.expand(3, 2, 50, 8) for t in (q, k, v))
    assert q.stride(2) == 0 and q.stride(0) == 0
    torch.testing.assert_close(kernel(q, k, v, ra.RelativeAttentionMask(), 4),
                               kernel(*(t.contiguous() for t in (q, k, v)), ra.RelativeAttentionMask(), 4))


def test_a_build_lock_left_by_a_killed_build_is_not_waited_on(fresh_kernel_state, caplog):
    """A build killed part-way leaves torch's lock file (`lock`) in the build folder, held by no one: before
    torch 2.14 its mere existence made every later load wait for the timeout (300 s) in silence. The kernel loads at
    once, and a warning, if any, names the file."""
    assert fused_attention.fused_kernel() is not None  # built
    leftover = fused_attention.build_directory() / "lock"
    leftover.write_text("")
    fused_attention.forget_fused_kernel()
    start = time.perf_counter()
    kernel, warnings = logged_warnings(caplog, fused_attention.fused_kernel)
    assert kernel is not None and time.perf_counter() - start < 30
    assert all(str(leftover) in w for w in warnings), warnings


def test_loading_a_complete_build_again_warns_of_nothing(fresh_kernel_state, caplog):
    """What every new process does once the kernel is built: no warning (torch 2.14 and later keep their lock file
    after every build, which is no sign of a killed one)."""
    assert fused_attention.fused_kernel() is not None  # built
    fused_attention.forget_fused_kernel()
    kernel, warnings = logged_warnings(caplog, fused_attention.fused_kernel)
    assert kernel is not None and warnings == []


def test_the_kernel_is_built_by_the_environments_ninja_whatever_path_finds_first(fresh_kernel_state, tmp_path):
    """PyTorch ran the first `ninja` on PATH: with the environment activated, the package's ninja (1.13); without,
    a system one (1.11), whose log records commands differently, so each took the other's build for a changed command
    and compiled the kernel again, a minute each time, others waiting on the lock (the suite's two workers did so
    every minute). A `ninja` first on PATH that fails is not run: the load uses the environment's."""
    import sysconfig

    assert shutil.which("ninja", path=sysconfig.get_path("scripts"))  # nezha_hf's dependency, in this environment
    stranger = tmp_path / "bin" / "ninja"
    stranger.parent.mkdir()
    stranger.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'ran'}\nexit 1\n")
    stranger.chmod(0o755)
    fresh_kernel_state.setenv("PATH", f"{stranger.parent}{os.pathsep}{os.environ['PATH']}")
    assert fused_attention.fused_kernel() is not None
    assert not (tmp_path / "ran").exists()
    assert os.environ["PATH"].startswith(str(stranger.parent))  # put back


def test_another_process_still_building_is_waited_on_for_the_timeout_only(fresh_kernel_state, caplog):
    import subprocess
    import sys

    lock = fused_attention.build_directory() / "nezha_build.lock"
    code = ("import sys, time; from filelock import FileLock\n"
            "with FileLock(sys.argv[1]):\n    print('holding', flush=True); time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        fresh_kernel_state.setenv(fused_attention.LOCK_TIMEOUT_VARIABLE, "1")
        start = time.perf_counter()
        kernel, warnings = logged_warnings(caplog, fused_attention.fused_kernel)
        assert kernel is None and time.perf_counter() - start < 30
    finally:
        holder.kill()
        holder.wait()
    assert len(warnings) == 1 and str(lock) in warnings[0] and "three-regions engine" in warnings[0]
    fused_attention.forget_fused_kernel()
    assert fused_attention.fused_kernel() is not None  # its holder gone, the lock is free


@pytest.mark.parametrize("family, machine, expected", [
    ("gcc", "x86_64", (["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp"], ["-fopenmp"])),
    ("clang", "aarch64", (["-O3", "-mcpu=native", "-fopenmp"], ["-fopenmp"])),
    ("apple-clang", "arm64", (["-O3", "-mcpu=native"], [])),  # no OpenMP without libomp
])
def test_the_flags_suit_the_compiler(family, machine, expected):
    assert fused_attention.kernel_flags(family, machine) == expected


def test_msvc_gets_its_own_flags():
    cflags, ldflags = fused_attention.kernel_flags("msvc", "AMD64")
    assert cflags[:2] == ["/O2", "/openmp"] and not any(flag.startswith("-") for flag in cflags) and ldflags == []


def test_the_compiler_family_is_read_from_the_compiler(tmp_path):
    def fake(name, version):
        path = tmp_path / name
        path.write_text(f"#!/bin/sh\necho '{version}'\n")
        path.chmod(0o755)
        return str(path)

    assert fused_attention.compiler_family(fake("c++", "Apple clang version 15.0.0 (clang-1500.3.9.4)")) == "apple-clang"
    assert fused_attention.compiler_family(fake("clang++", "Ubuntu clang version 18.1.3")) == "clang"
    assert fused_attention.compiler_family(fake("g++", "g++ (Debian 12.2.0-14) 12.2.0")) == "gcc"
    assert fused_attention.compiler_family(str(tmp_path / "nowhere")) is None


@pytest.mark.slow
@pytest.mark.parametrize("how", ["a compiler that rejects -march=native and -fopenmp", "no compiler"])
def test_without_a_usable_compiler_one_warning_names_the_engine_that_runs(tmp_path, how):
    """What a Windows or macOS user without a suitable compiler gets: one warning naming the engines that run
    instead, and a model that works. In a fresh process, with its own build folder."""
    import subprocess
    import sys

    compiler = tmp_path / "picky-c++"
    compiler.write_text("#!/bin/sh\nfor flag in \"$@\"; do case $flag in -march=native|-fopenmp) "
                        "echo \"error: unsupported option '$flag'\" >&2; exit 1;; esac; done\nexec c++ \"$@\"\n")
    compiler.chmod(0o755)
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "cache"),
           "CXX": str(compiler) if how.startswith("a compiler") else str(tmp_path / "missing-c++")}
    code = ("import torch; from nezha_hf import NezhaConfig, NezhaModel, recorded_attention_calls\n"
            "config = NezhaConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, "
            "intermediate_size=37)\n"
            "with recorded_attention_calls() as calls:\n    NezhaModel(config)(torch.randint(0, 50, (1, 20)))\n"
            "print(sorted({call.ran.value for call in calls}))")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "['nezha_chunked']"
    warnings = [line for line in done.stderr.splitlines() if "NEZHA's" in line and "unavailable" in line or
                "not built" in line]
    assert len(warnings) == 1 and "three-regions engine" in warnings[0] and "chunked engine" in warnings[0], \
        done.stderr[-3000:]
    assert ("-march=native" in warnings[0]) == how.startswith("a compiler")  # the compiler's own complaint


def test_the_build_is_named_after_the_cpu_it_is_built_for(monkeypatch):
    name = fused_attention.kernel_name()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    assert fused_attention.kernel_name() != name or torch.backends.cpu.get_cpu_capability() == "DEFAULT"
    monkeypatch.setattr(fused_attention, "_cpu_signature", lambda: "another instruction set")
    assert fused_attention.kernel_name() != name


def test_the_fused_engine_runs_the_kernel_at_every_length(attention_calls):
    for length in (3, 700):
        q, k, v, mask, allowed = make_case(1, 2, length, 16, 8, "causal", [length - 1], torch.float32, seed=7)
        torch.testing.assert_close(run_attention(ra.Engine.FUSED, q, k, v, mask, 8),
                                   reference.attention(q, k, v, 8, allowed)[0], atol=1e-5, rtol=0)
    assert {call.ran for call in attention_calls} == {ra.Engine.FUSED}


# --- reduced precision ------------------------------------------------------------------------------------

REDUCED = [torch.bfloat16, torch.float16]


def reduced_case(mode, dtype, length=300, seed=31, K=16, head_size=64):
    """A case in `dtype` and the same inputs (rounded to it) in float64 for the reference, with its float64 table
    (the model's table, rounded to `dtype` as the model rounds it)."""
    q, k, v, mask, allowed = make_case(2, 3, length, head_size, K, mode, [length, length - 37], torch.float32, seed=seed)
    low = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    exact = [t.detach().double().requires_grad_() for t in low]
    table = ra.sinusoid_relative_table(K, head_size).to(dtype).double()
    return low, exact, mask, allowed, table


# (length, K, head size): the kernel's default blocks crossed (512 keys, 64-key panels, a partial last panel) at the
# base model's K; a small K; a band wider than the sequence.
REDUCED_SHAPES = [pytest.param(600, 64, 64, id="600-K64"), pytest.param(300, 16, 64, id="300-K16"),
                  pytest.param(150, 4, 32, id="150-K4"), pytest.param(90, 200, 16, id="90-K200")]


@pytest.mark.parametrize("dtype", REDUCED, ids=str)
@pytest.mark.parametrize("mode", ["bidirectional", "causal", "prefix"])
@pytest.mark.parametrize("blocks", [(0, 0), (16, 32)], ids=["default-blocks", "small-blocks"])
@pytest.mark.parametrize("length, K, head_size", REDUCED_SHAPES)
def test_reduced_precision_runs_the_kernel_and_matches_float64(dtype, mode, blocks, length, K, head_size, monkeypatch,
                                                               attention_calls):
    """bfloat16 / float16 inputs run the fused kernel itself (float32 accumulation); forward and gradients against
    the float64 formula on the same (rounded) inputs, with padding in the batch."""
    monkeypatch.setattr(fused_attention, "KERNEL_BLOCK_SIZES", blocks)
    low, exact, mask, allowed, table = reduced_case(mode, dtype, length, K=K, head_size=head_size)
    got = run_attention(ra.Engine.FUSED, *low, mask, K)
    assert {call.ran for call in attention_calls} == {ra.Engine.FUSED} and got.dtype == dtype
    expected = reference.attention(*exact, K, allowed, table=table)[0]
    tolerance = 2e-2 if dtype == torch.bfloat16 else 3e-3
    torch.testing.assert_close(got.double(), expected, atol=tolerance, rtol=0)
    grad = torch.randn_like(expected)
    for name, a, b in zip("qkv", torch.autograd.grad((got.double() * grad).sum(), low),
                          torch.autograd.grad((expected * grad).sum(), exact)):
        assert a.dtype == dtype
        torch.testing.assert_close(a.double(), b, atol=5 * tolerance, rtol=0, msg=f"d{name}")


@pytest.mark.parametrize("dtype", REDUCED, ids=str)
@pytest.mark.parametrize("length, K, head_size", REDUCED_SHAPES[:3])
def test_reduced_precision_dropout_and_cache_match_float64(dtype, length, K, head_size):
    """Dropout (the same hash-drawn mask as in float32), forward and gradients, and a KV-cache step, in bfloat16 /
    float16."""
    p, seed = 0.3, 987654321
    low, exact, mask, allowed, table = reduced_case("prefix", dtype, length, seed=2, K=K, head_size=head_size)
    keep = kernel_keep_mask(seed, 2, 3, length, length, p)
    got = kernel(*low, mask, K, dropout=p, seed=seed)
    expected = reference.attention(*exact, K, allowed, keep=keep, dropout=p, table=table)[0]
    tolerance = 3e-2 if dtype == torch.bfloat16 else 5e-3
    torch.testing.assert_close(got.double(), expected, atol=tolerance, rtol=0)
    grad = torch.randn_like(expected)
    for name, a, b in zip("qkv", torch.autograd.grad((got.double() * grad).sum(), low),
                          torch.autograd.grad((expected * grad).sum(), exact)):
        torch.testing.assert_close(a.double(), b, atol=5 * tolerance, rtol=0, msg=f"d{name}")
    new = 4  # the last queries against every key, as a decoding step sees them
    step = kernel(low[0][..., -new:, :], low[1], low[2], mask, K, offset=length - new)
    full = reference.attention(*exact, K, allowed, table=table)[0]
    torch.testing.assert_close(step.double(), full[..., -new:, :], atol=tolerance, rtol=0)


@pytest.mark.parametrize("blocks", [(0, 0), (16, 32)], ids=["default-blocks", "small-blocks"])
def test_bfloat16_packed_operands_read_every_key_row_in_place(blocks, monkeypatch):
    """Where the CPU multiplies bfloat16 itself (AMX, or AVX512-BF16), the kernel packs keys in panels as wide as a key
    block and values in blocks of rows. An odd length past one default key block (601 keys: a second block of 89, odd,
    not a whole number of 16-column groups) with distinct random keys: a key or value row packed in the wrong place
    (shifted, swapped, read twice) moves the output or a gradient off the float64 formula."""
    if not cpu_multiplies(torch.bfloat16):
        pytest.skip("this CPU multiplies bfloat16 in float32 (no AMX, no AVX512-BF16): nothing is packed")
    monkeypatch.setattr(fused_attention, "KERNEL_BLOCK_SIZES", blocks)
    low, exact, mask, allowed, table = reduced_case("bidirectional", torch.bfloat16, length=601, K=64)
    got = kernel(*low, mask, 64)
    expected = reference.attention(*exact, 64, allowed, table=table)[0]
    torch.testing.assert_close(got.double(), expected, atol=2e-2, rtol=0)
    grad = torch.randn_like(expected)
    for name, a, b in zip("qkv", torch.autograd.grad((got.double() * grad).sum(), low),
                          torch.autograd.grad((expected * grad).sum(), exact)):
        torch.testing.assert_close(a.double(), b, atol=1e-1, rtol=0, msg=f"d{name}")


def cpu_multiplies(dtype):
    """Whether the CPU has instructions that multiply `dtype` pairs with float32 accumulation, as PyTorch detects
    them: AMX or AVX512-BF16 for bfloat16, AMX-FP16 for float16 (an AVX512-FP16 path is not taken: unmeasured)."""
    if dtype == torch.bfloat16:
        return torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
    return torch.cpu._is_amx_fp16_supported()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("onednn", [True, False], ids=["oneDNN", "oneDNN-off"])
@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")  # torch's, for toggling oneDNN
def test_reduced_precision_is_multiplied_in_its_own_type_where_the_cpu_can(dtype, onednn):
    """Where the CPU multiplies the type itself (AMX tiles, or AVX512-BF16's pair products without AMX), forward and
    backward multiply the reduced-precision blocks themselves; elsewhere, and with oneDNN switched off
    (`torch.backends.mkldnn`), in float32. The kernel counts each call's routine; the results are right either way."""
    low, exact, mask, allowed, table = reduced_case("causal", dtype, length=130)
    with torch.backends.mkldnn.flags(enabled=onednn):
        before = fused_attention.fused_kernel().routine_calls()
        got = kernel(*low, mask, 16)
        got.sum().backward()
        after = fused_attention.fused_kernel().routine_calls()
        expected = "reduced-precision packed" if onednn and cpu_multiplies(dtype) else "float32"
        assert fused_attention.product_routine(dtype) == expected
    assert {name: after[name] - before[name] for name in after} == {
        name: 2 if name == expected else 0 for name in after}
    want = reference.attention(*exact, 16, allowed, table=table)[0]
    torch.testing.assert_close(got.double(), want, atol=3e-2 if dtype == torch.bfloat16 else 5e-3, rtol=0)


@pytest.mark.slow
def test_the_bfloat16_products_do_not_depend_on_the_flags_the_kernel_is_built_with(tmp_path):
    """A kernel compiled without AVX-512 code (the compiler's baseline, as MSVC builds it without /arch:AVX512) still
    multiplies bfloat16 in bfloat16 where the CPU can, and right: oneDNN generates that code itself. In a fresh
    process with a build folder of its own."""
    import subprocess
    import sys

    code = ("import sys, torch\n"
            f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
            "from nezha_hf import fused_attention\n"
            "fused_attention.kernel_flags = lambda family, machine=None: (['-O2', '-fopenmp'], ['-fopenmp'])\n"
            "import reference, test_fused_attention as here\n"
            "low, exact, mask, allowed, table = here.reduced_case('prefix', torch.bfloat16, length=200)\n"
            "error = (here.kernel(*low, mask, 16).double() - reference.attention(*exact, 16, allowed, table=table)[0])\n"
            "print(fused_attention.product_routine(torch.bfloat16), '|', here.cpu_multiplies(torch.bfloat16), '|',\n"
            "      float(error.abs().max()))")
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)},
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    routine, cpu_can, error = (part.strip() for part in done.stdout.strip().splitlines()[-1].split("|"))
    assert routine == ("reduced-precision packed" if cpu_can == "True" else "float32")
    assert float(error) < 3e-2
    assert any((build / f"{build.name}.so").is_file() for build in tmp_path.iterdir())  # built with those flags


@pytest.mark.parametrize("how", ["to", "autocast"])
def test_bfloat16_models_run_the_kernel(how, attention_calls):
    config = NezhaConfig(vocab_size=50, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    torch.manual_seed(0)
    model = NezhaModel(config).eval()
    ids = torch.randint(0, 50, (2, 70))
    with torch.no_grad():
        expected = model(ids).last_hidden_state
        if how == "to":
            got = model.to(torch.bfloat16)(ids).last_hidden_state
        else:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                got = model(ids).last_hidden_state
    assert {call.ran for call in attention_calls} == {ra.Engine.FUSED}
    assert {call.dtype for call in attention_calls} == {torch.float32, torch.bfloat16}
    torch.testing.assert_close(got.float(), expected, atol=0.1, rtol=0)


# --- the build cache and the environment variables ----------------------------------------------------------


@pytest.fixture
def fresh_kernel_state(monkeypatch):
    """Forget the loaded kernel before and after, so that the test's environment decides and nothing leaks."""
    fused_attention.forget_fused_kernel()
    yield monkeypatch
    monkeypatch.undo()
    fused_attention.forget_fused_kernel()


def logged_warnings(caplog, action):
    from transformers.utils import logging as hf_logging

    hf_logging.enable_propagation()
    try:
        with caplog.at_level("WARNING"):
            result = action()
    finally:
        hf_logging.disable_propagation()
    return result, [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]


@pytest.mark.parametrize("value", ["0", "false", "FALSE", "no", "off", "Off"])
def test_the_kernel_can_be_switched_off_with_the_usual_spellings(value, fresh_kernel_state):
    fresh_kernel_state.setenv("NEZHA_HF_KERNEL", value)
    assert fused_attention.fused_kernel() is None


def test_a_bad_kernel_switch_or_lock_timeout_is_one_warning(fresh_kernel_state, caplog):
    fresh_kernel_state.setenv("NEZHA_HF_KERNEL", "maybe")
    fresh_kernel_state.setenv(fused_attention.LOCK_TIMEOUT_VARIABLE, "abc")
    kernel, warnings = logged_warnings(caplog, fused_attention.fused_kernel)
    assert kernel is not None  # the default: on, with the default timeout
    assert len([w for w in warnings if "NEZHA_HF_KERNEL=" in w]) == 1
    assert len([w for w in warnings if "NEZHA_HF_KERNEL_LOCK_TIMEOUT=" in w]) == 1


@pytest.mark.parametrize("value", ["nan", "inf", "-5", "abc"])
def test_lock_timeouts_must_be_finite_and_not_negative(value, fresh_kernel_state, caplog):
    fresh_kernel_state.setenv(fused_attention.LOCK_TIMEOUT_VARIABLE, value)
    timeout, warnings = logged_warnings(caplog, fused_attention.lock_timeout)
    assert timeout == fused_attention.DEFAULT_LOCK_TIMEOUT and any(value in w for w in warnings)


def test_torch_extensions_dir_is_where_the_kernel_is_cached(tmp_path, fresh_kernel_state):
    fresh_kernel_state.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    assert fused_attention.build_directory().parent == tmp_path / "cache"


def test_an_unusable_cache_folder_is_one_warning_and_the_chunked_engine(tmp_path, fresh_kernel_state, caplog):
    (tmp_path / "a-file").write_text("not a folder")
    fresh_kernel_state.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "a-file" / "cache"))
    kernel, warnings = logged_warnings(caplog, fused_attention.fused_kernel)
    assert kernel is None and len(warnings) == 1 and "a-file" in warnings[0]
    config = NezhaConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    with ra.recorded_attention_calls() as calls:
        NezhaModel(config)(torch.randint(0, 50, (1, 9)))  # builds and runs, on the chunked engine
    assert {call.ran for call in calls} == {ra.Engine.CHUNKED}


def test_the_build_name_follows_the_environment_not_the_checkout(monkeypatch, tmp_path):
    """Two checkouts of the same source share one build; two environments (another torch, other headers) get one
    each, so neither rebuilds the other's."""
    name = fused_attention.kernel_name()
    copy = tmp_path / "fused_attention.cpp"
    copy.write_bytes(fused_attention.KERNEL_SOURCE.read_bytes())
    monkeypatch.setattr(fused_attention, "KERNEL_SOURCE", copy)
    assert fused_attention.kernel_name() == name
    import torch.utils.cpp_extension as cpp_extension

    include_paths = cpp_extension.include_paths
    monkeypatch.setattr(cpp_extension, "include_paths", lambda *a, **k: [str(tmp_path / "other-env"),
                                                                          *include_paths(*a, **k)])
    assert fused_attention.kernel_name() != name


@pytest.mark.slow
def test_a_second_checkout_loads_the_built_kernel_without_compiling(tmp_path):
    """A copy of the package elsewhere (another checkout) in a fresh process: the kernel built by this one loads
    from the shared cache, the build folder unchanged (nothing compiled)."""
    import subprocess
    import sys

    assert fused_attention.fused_kernel() is not None
    build = fused_attention.build_directory()
    before = {p.name: p.stat().st_mtime_ns for p in build.iterdir()}
    shutil.copytree(Path(fused_attention.__file__).parent, tmp_path / "checkout" / "nezha_hf",
                    ignore=shutil.ignore_patterns("__pycache__"))
    code = ("import nezha_hf, nezha_hf.fused_attention as f; assert nezha_hf.__file__.startswith(%r); "
            "print(f.build_directory()); assert f.fused_kernel() is not None" % str(tmp_path / "checkout"))
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(tmp_path / "checkout")})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == str(build)
    assert {p.name: p.stat().st_mtime_ns for p in build.iterdir()} == before
