"""The GPU gates, checked on the CPU: what NEZHA's Triton launchers launch, compiled for an H100 (sm_90) and counted.

    python benchmarks/gpu/gpu_gates.py [--triton-python PYTHON] [--output FILE.json]     (`make gpu-gates`)

The calls users make, each a bfloat16 call of batch 4 x 12 heads x 2,048 tokens x head size 64, K = 64 (`CASES`):
no mask; a key-padding mask (the fine-tuning batch); a causal mask and UniLM's prefix mask (generation's prefill);
attention dropout 0.1 with a real 64-bit seed, with and without padding; and a decoding step (one query against
8,193 cached keys of a static cache). Each runs through the real launchers (`triton_attention.triton_forward` and
`triton_backward`) on CPU tensors, against a fake H100 (`gpu_fake_driver.fake_hopper`): Triton's own autotuner prunes
the configurations and runs each one once, its JIT binder specialises the arguments (which integers are multiples of
16 or 1, which pointers are aligned) and compiles the kernel for sm_90, and only the launch itself stops at the fake
driver. What is counted is what Triton compiled, taken from the JIT's own caches: a count and a launch cannot differ.
The dropout cases then run again with other seeds (a multiple of 16, 1, one below 2^31): a seed that compiles another
kernel fails a gate (the seed must not be specialised on). The plain FlashAttention-2 yardstick
(`benchmarks/gpu/triton_yardstick.py`) is compiled the same way through its launchers, with the blocks, warps, stages and
register cap of each NEZHA configuration it is measured against.

Of each compiled kernel it reports registers (`cuobjdump --dump-resource-usage`), its stack frame (spilled
registers), shared memory, blocks per H100 multiprocessor (65,536 registers, 228 KB of shared memory of which 1 KB
per block is reserved, 64 warps), HGMMA (wgmma) and HMMA (mma.sync) instructions, and for each loop of the SASS (a
backward branch; `nvdisasm`) its instructions per warp per tile, per (query, key) pair (times the warps, over the
tile's pairs) and its local-memory loads and stores (`LDL`/`STL`: spills). A loop is the band's when an instruction
of it comes from a band helper's source lines (`BAND_HELPERS`), a masked tail loop's when one comes from the mask's
(`MASK_HELPERS`: a mask with gaps, or dK/dV's key blocks cut by padding or source keys; these loops are counted and
gated for spills only), a tail's otherwise.

The gates (`gate_failures`), for the forward, dK/dV and dQ kernels of every case but decoding (whose kernels, and
the row statistics and merge kernels, are counted and reported); the script exits 1 when one fails, naming each:
- every bfloat16 product is a wgmma (no HMMA);
- no 64-row block on 8 warps: no product has fewer rows than its warps cover (16 per warp along the rows), which
  would compute the same rows twice;
- no spills in tail loops, nor in band loops or masked tail loops;
- the forward at 2 blocks per multiprocessor or more;
- tail-loop instructions per pair at most 1.1x the yardstick's (same configuration; the cases without dropout);
- a band tile at most 2.5 tail tiles (instructions per loop iteration);
- dropout adds at most 0.25 instructions per pair to each kernel's tail loop (against the same mask without it);
- a seed compiles no kernel of its own.

Triton's wheel carries ptxas, cuobjdump and nvdisasm. `--triton-python` runs the whole count under another Python's
Triton (the GPU machine's Triton 3.6, in a venv of its own: `python3 -m venv /tmp/triton36 && /tmp/triton36/bin/pip
install triton==3.6.0`), with this Python's PyTorch and packages appended to its path. The table names the Triton
that compiled. These are counts from a compiler, not timings: they say where time can go on a GPU.
"""

import argparse
import contextlib
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from unittest import mock

# Triton 3.9 warns unless told; floating-point contraction (fused multiply-adds) on, as Triton 3.6 on the GPU machine.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.gpu import gpu_fake_driver  # noqa: E402  (imports nothing that needs Triton or PyTorch)

KERNELS_FILE = ROOT / "nezha_hf" / "triton_kernels.py"

# The calls the gates compile for (the H100 run's case): batch x heads x tokens x head size, the table's K.
BATCH, HEADS, TOKENS, HEAD_SIZE, K = 4, 12, 2048, 64, 64
DROPOUT = 0.1
DECODING_KEYS = 8193  # a decoding step: one query after 8,192 cached tokens
# Each case: its mask (`_mask`) and dropout rate; the decoding step runs a forward only.
CASES = {"no mask": ("none", 0.0), "no mask, dropout": ("none", DROPOUT), "padding": ("padding", 0.0),
         "padding, dropout": ("padding", DROPOUT), "causal": ("causal", 0.0), "UniLM prefix": ("unilm", 0.0),
         "decoding": ("decoding", 0.0)}
WITHOUT_DROPOUT = {"no mask, dropout": "no mask", "padding, dropout": "padding"}
YARDSTICK = "yardstick"  # the yardstick's case
REPORTED_ONLY = ("decoding",)  # cases counted and reported, not gated
# Seeds a dropout case runs again with: none may compile a kernel of its own (a multiple of 16, which Triton would
# specialise on; 1, which it would make a constant; one below 2^31, which it would pass as a 32-bit integer).
OTHER_SEEDS = (16 * 0x2345_6789_ABCD, 1, 12345)

# NEZHA's gated kernels and the yardstick kernel each is measured against.
YARDSTICK_OF = {"nezha_forward_kernel": "yardstick_forward_kernel",
                "nezha_key_value_grad_kernel": "yardstick_key_value_grad_kernel",
                "nezha_query_grad_kernel": "yardstick_query_grad_kernel"}
SHORT = {"nezha_forward_kernel": "forward", "nezha_key_value_grad_kernel": "dK/dV", "nezha_query_grad_kernel": "dQ",
         "nezha_row_statistics_kernel": "row statistics", "nezha_merge_kernel": "merge",
         "yardstick_forward_kernel": "yardstick forward", "yardstick_key_value_grad_kernel": "yardstick dK/dV",
         "yardstick_query_grad_kernel": "yardstick dQ"}
NEZHA_KERNELS = ("nezha_forward_kernel", "nezha_merge_kernel", "nezha_row_statistics_kernel",
                 "nezha_key_value_grad_kernel", "nezha_query_grad_kernel")
# The helpers of `triton_kernels.py` that only band tiles run: a loop holding their lines is the band's.
BAND_HELPERS = ("_by_pair", "_add_times_window", "_rotated_band_tile", "_rotated_key_value_tile",
                "_rotated_query_tile")
# The helper that masks a tile's pairs: a tail loop holding its lines is a masked one (masks with gaps; dK/dV's key
# blocks that padding or source keys cut), not the plain tail loop that runs every block padding leaves whole.
MASK_HELPERS = ("_visible",)

# An H100's multiprocessor (../shared/docs/gpu-measuring.md).
SM_REGISTERS, SM_SHARED, BLOCK_RESERVED_SHARED, SM_WARPS, SM_BLOCKS = 65536, 228 * 1024, 1024, 64, 32

# The gates' limits.
TAIL_PER_PAIR_LIMIT = 1.1  # times the yardstick's
BAND_TILE_LIMIT = 2.5  # tail tiles
DROPOUT_PER_PAIR_LIMIT = 0.25  # instructions per pair
FORWARD_BLOCKS_PER_SM = 2


# --- the calls, through the real launchers against a fake H100 (PyTorch, nezha_hf and Triton) -------------------


def _mask(kind: str, keys: int):
    """The `RelativeAttentionMask` of a case's mask kind for `keys` keys: right padding of other lengths per sequence
    (the fine-tuning batch), causal, UniLM's prefix (a source of the first third of each sequence's tokens, padded),
    or a decoding step's (a static cache's: the filled slots valid, causal, the offset a tensor)."""
    import torch

    from nezha_hf.attention_ops import RelativeAttentionMask

    lengths = torch.tensor([keys, keys * 7 // 8, keys // 2, keys // 4])[:BATCH]
    valid = torch.arange(keys)[None, :] < lengths[:, None]
    if kind == "none":
        return RelativeAttentionMask()
    if kind == "padding":
        return RelativeAttentionMask(key_is_valid=valid)
    if kind == "causal":
        return RelativeAttentionMask(causal=True)
    if kind == "unilm":
        return RelativeAttentionMask(key_is_valid=valid, causal=True,
                                     key_is_source=torch.arange(keys)[None, :] < lengths[:, None] // 3)
    if kind == "decoding":
        filled = torch.ones(BATCH, keys, dtype=torch.bool)
        return RelativeAttentionMask(key_is_valid=filled, causal=True, query_offset=torch.tensor(keys - 1))
    raise ValueError(kind)


def _compiled(jit) -> dict:
    """The kernels a JIT function has compiled so far, by its cache key (every device)."""
    return {(device, key): kernel for device, caches in jit.device_caches.items() for key, kernel in caches[0].items()}


def _jit(kernel):
    """The JIT function of a kernel, autotuned or not."""
    import triton

    return kernel.fn if isinstance(kernel, triton.runtime.Autotuner) else kernel


class _NoLaunch:
    """Stands for a kernel left out (`--only`): `kernel[grid](...)` does nothing."""

    def __init__(self, kernel):
        self.arg_names = kernel.arg_names  # the parameters the launchers pass

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _planted(kernel, configs: list) -> None:
    """Add `configs` to an autotuned kernel's, kept by its pruning whatever the call (compiled for every case)."""
    prune = kernel.early_config_prune
    kernel.configs = [*kernel.configs, *configs]
    kernel.early_config_prune = lambda all_configs, named, **kwargs: [
        *(config for config in prune(all_configs, named, **kwargs) if not any(config is c for c in configs)),
        *configs]


def compile_calls(cases: list[str], only: list[str] | None = None, planted: dict | None = None) -> dict:
    """Run each case's forward and backward (a decoding step: its forward) through the launchers against the fake
    H100, and the yardstick through its own with each configuration counted; count every kernel Triton compiled.
    Compiled afresh, in a Triton cache of their own: Triton's cache keys kernels by their source, so a kernel cached
    from another checkout would name that checkout's file in its SASS, and no loop would be told a band's."""
    os.environ.pop("TRITON_INTERPRET", None)
    with tempfile.TemporaryDirectory() as cache, mock.patch.dict(os.environ, TRITON_CACHE_DIR=cache):
        return _compile_calls(cases, only or [], planted or {})


def _compile_calls(cases: list[str], only: list[str], planted: dict) -> dict:
    import torch
    import triton

    from benchmarks.gpu import triton_yardstick
    from nezha_hf import relative_attention, triton_attention
    from nezha_hf import triton_kernels as kernels
    from nezha_hf.attention_ops import AttentionProblem

    assert not kernels.INTERPRETING, "Triton was imported under TRITON_INTERPRET"
    assert Path(kernels.__file__).resolve() == KERNELS_FILE, f"imported {kernels.__file__}, not {KERNELS_FILE}"
    band_lines, mask_lines = _helper_lines(kernels, BAND_HELPERS), _helper_lines(kernels, MASK_HELPERS)
    table = relative_attention.sinusoid_relative_table(K, HEAD_SIZE).to(torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    rows, seen, failures = [], set(), []

    def new_rows(case: str, module, names) -> list[dict]:
        found = []
        for name in names:
            jit = _jit(getattr(module, name))
            for key, compiled in _compiled(jit).items():
                if (name, key) not in seen:
                    seen.add((name, key))
                    lines = (band_lines, mask_lines) if module is kernels else (set(), set())
                    found.append(count(name, case, compiled, *lines))
                    print(f"compiled {SHORT[name]} ({case}), {found[-1]['config_name']}", file=sys.stderr, flush=True)
        return found

    def call(case: str, seed: int) -> None:
        kind, dropout = CASES[case]
        queries, keys = (1, DECODING_KEYS) if kind == "decoding" else (TOKENS, TOKENS)
        # `[batch, heads, length, d]` views of `[batch, length, heads, d]`, as the model's projections; a cache's
        # keys and values `[batch, heads, length, d]` as transformers' caches hold them
        query = torch.zeros(BATCH, queries, HEADS, HEAD_SIZE, dtype=torch.bfloat16).transpose(1, 2)
        key, value = (torch.zeros(BATCH, keys, HEADS, HEAD_SIZE, dtype=torch.bfloat16).transpose(1, 2)
                      if kind != "decoding" else torch.zeros(BATCH, HEADS, keys, HEAD_SIZE, dtype=torch.bfloat16)
                      for _ in range(2))
        problem = AttentionProblem(_mask(kind, keys), HEAD_SIZE**-0.5, dropout, torch.tensor(seed))
        output, lse = triton_attention.triton_forward(query, key, value, table, problem)
        if kind != "decoding":
            triton_attention.triton_backward(output.transpose(1, 2), query, key, value, table, problem,
                                             output.transpose(1, 2), lse)

    with gpu_fake_driver.fake_hopper() as gpu, contextlib.ExitStack() as patches:
        for name in NEZHA_KERNELS:
            kernel = getattr(kernels, name)
            if only and SHORT[name] not in only:
                patches.enter_context(mock.patch.object(kernels, name, _NoLaunch(kernel)))
            elif name in planted:
                patches.enter_context(mock.patch.multiple(kernel, configs=kernel.configs,
                                                          early_config_prune=kernel.early_config_prune))
                _planted(kernel, [triton.Config({"BLOCK_M": c["BLOCK_M"], "BLOCK_N": c["BLOCK_N"]},
                                                num_warps=c["num_warps"], num_stages=c["num_stages"],
                                                maxnreg=c.get("maxnreg")) for c in planted[name]])
        names = [name for name in NEZHA_KERNELS if not only or SHORT[name] in only]
        for case in cases:
            seed = int(torch.randint(0, 1 << 62, (), generator=generator)) | 1  # a real seed, not a multiple of 16
            before = gpu.launches()
            call(case, seed)
            if gpu.launches() == before:
                failures.append(f"{case}: no kernel launch reached the driver")
            rows += new_rows(case, kernels, names)
            if CASES[case][1]:
                for other in OTHER_SEEDS:
                    call(case, other)
                    variants = new_rows(f"{case}, seed {other}", kernels, names)
                    failures += [f"{SHORT[row['kernel']]} ({case}): a seed of {other} compiled a kernel of its own "
                                 f"({row['config_name']})" for row in variants]
        measured = {}  # yardstick kernel -> configurations of the NEZHA rows it is compared with
        for row in rows:
            if row["kernel"] in YARDSTICK_OF and row["case"] not in REPORTED_ONLY:
                configs = measured.setdefault(YARDSTICK_OF[row["kernel"]], [])
                configs += [row["config"]] if row["config"] not in configs else []
        tensors = [torch.zeros(BATCH, HEADS, TOKENS, HEAD_SIZE, dtype=torch.bfloat16) for _ in range(3)]
        scale = HEAD_SIZE**-0.5
        for config in measured.get("yardstick_forward_kernel", []):
            triton_yardstick.yardstick_forward(*tensors, scale, config["BLOCK_M"], config["BLOCK_N"],
                                               config["num_warps"], config["num_stages"], config.get("maxnreg"))
        output, lse = torch.zeros_like(tensors[0]), torch.zeros(BATCH, HEADS, TOKENS)
        key_value, query = (measured.get(name, []) for name in ("yardstick_key_value_grad_kernel",
                                                                "yardstick_query_grad_kernel"))
        for at in range(max(len(key_value), len(query))):  # a backward launches both: each configuration once
            blocks = {name: (c["BLOCK_M"], c["BLOCK_N"], c["num_warps"], c["num_stages"])
                      for name, configs in (("key_blocks", key_value), ("query_blocks", query)) if configs
                      for c in [configs[at % len(configs)]]}
            triton_yardstick.yardstick_backward(output, *tensors, output, lse, scale, **blocks)
        rows += new_rows(YARDSTICK, triton_yardstick, list(YARDSTICK_OF.values()))
    return {"triton": triton.__version__, "rows": rows, "failures": failures}


# --- counting a compiled kernel (Triton only) --------------------------------------------------------------------


def _tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def config_dict(config) -> dict:
    """A `triton.Config` as the counts hold it: its keyword arguments, `num_warps`, `num_stages`, and `maxnreg` where
    capped."""
    return {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages,
            **({"maxnreg": config.maxnreg} if config.maxnreg else {})}


def config_name(config: dict) -> str:
    """A configuration (`BLOCK_M`, `BLOCK_N` where the kernel has one, `num_warps`, `num_stages`, and `maxnreg`
    where capped) in words, as the counts and the GPU check's rows name it: `128x64, 8 warps, 3 stages, 128
    registers`."""
    block = f"{config['BLOCK_M']}x{config['BLOCK_N']}" if "BLOCK_N" in config else f"{config['BLOCK_M']} rows"
    name = f"{block}, {config['num_warps']} warps, {config['num_stages']} stages"
    return name + (f", {config['maxnreg']} registers" if config.get("maxnreg") else "")


def _helper_lines(module, helpers: tuple[str, ...]) -> set[int]:
    """The source lines of `helpers` of `module` (those it has)."""
    import inspect

    lines = set()
    for name in helpers:
        helper = getattr(module, name, None)
        if helper is not None:
            source, first = inspect.getsourcelines(getattr(helper, "fn", helper))
            lines.update(range(first, first + len(source)))
    return lines


def sass_loops(sass: str, source_file: str, band_lines: set[int], mask_lines: set[int] = frozenset()) -> list[dict]:
    """The innermost loops of an `nvdisasm -c -gi` listing, in program order: `{"class": "band", "masked" or "tail",
    "instructions", "spills"}` (`LDL`/`STL`), a loop being the code from a label to a branch back to it; a loop is
    the band's where it holds a line of `band_lines`, else masked where it holds one of `mask_lines`."""
    entries, labels = [], {}  # (instruction, its source lines: the inlined function's and each caller's); label
    lines, chain = set(), False  # consecutive comments name one instruction's inlining chain, one call each
    for text in sass.splitlines():
        if text.lstrip().startswith("//## File"):
            named = {int(line) for file, line in re.findall(r'"([^"]*)", line (\d+)', text) if file == source_file}
            lines, chain = (lines | named if chain else named), True
            continue
        chain = False
        if re.match(r"^\.L_x_\d+:", text):
            labels[text[:-1]] = len(entries)
        elif re.match(r"\s*/\*[0-9a-f]{4,}\*/", text):
            entries.append((text, lines))
    loops = []
    for end, (text, _) in enumerate(entries):
        branch = re.search(r"\bBRA\b.*`\((\.L_x_\d+)\)", text)
        if branch and labels.get(branch.group(1), end) < end:
            loops.append((labels[branch.group(1)], end))
    innermost = [(a, b) for a, b in loops if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in loops)]
    result = []
    for start, end in sorted(innermost):
        body = entries[start:end + 1]
        kind = ("band" if any(lines & band_lines for _, lines in body) else
                "masked" if any(lines & mask_lines for _, lines in body) else "tail")
        result.append({"class": kind, "instructions": len(body),
                       "spills": sum(bool(re.search(r"\b(LDL|STL)\b", text)) for text, _ in body)})
    return result


def duplicated_products(ttgir: str) -> list[str]:
    """Products of a TTGIR listing whose rows are fewer than its warps cover (16 rows per warp along the rows): the
    warps beyond compute the same rows again (a 64-row block on 8 warps). Each as `MxN on [a, b] warps`."""
    layouts = {name: [int(w) for w in warps.split(",")]
               for name, warps in re.findall(r"^(#\w+) = #ttg\.nvidia_mma<\{.*?warpsPerCTA = \[([\d, ]+)\]", ttgir,
                                             re.M)}
    found = []
    for rows, columns, layout in re.findall(r"(?:tt\.dot|ttng\.warp_group_dot) .*?-> tensor<(\d+)x(\d+)xf32, (#\w+)>",
                                            ttgir):
        warps = layouts.get(layout)
        if warps and int(rows) < 16 * warps[0]:
            found.append(f"{rows}x{columns} on {warps} warps")
    return found


def _compiled_config(compiled) -> dict:
    """The configuration a kernel was compiled with: its `BLOCK_M` and `BLOCK_N` (constants of the call), warps,
    stages and register cap (the compiler's options)."""
    names = compiled.src.fn.arg_names
    constants = {names[path[0]] if isinstance(path, tuple) else path: value
                 for path, value in compiled.src.constants.items()}
    config = {name: int(constants[name]) for name in ("BLOCK_M", "BLOCK_N") if name in constants}
    config.update(num_warps=compiled.metadata.num_warps, num_stages=compiled.metadata.num_stages)
    if getattr(compiled.metadata, "maxnreg", None):
        config["maxnreg"] = compiled.metadata.maxnreg
    return config


def count(name: str, case: str, compiled, band_lines: set[int], mask_lines: set[int]) -> dict:
    """The counts of one compiled kernel (the module docstring's)."""
    config = _compiled_config(compiled)
    with tempfile.TemporaryDirectory() as scratch:
        cubin = Path(scratch) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", str(cubin)], capture_output=True,
                               text=True, check=True).stdout
        sass = subprocess.run([_tool("nvdisasm"), "-c", "-gi", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    shared = compiled.metadata.shared
    warps = config["num_warps"]
    per_warp = -(-registers * 32 // 256) * 256  # registers are allocated per warp in units of 256
    blocks = min(SM_REGISTERS // (per_warp * warps), SM_SHARED // (shared + BLOCK_RESERVED_SHARED),
                 SM_WARPS // warps, SM_BLOCKS)
    pairs = config["BLOCK_M"] * config.get("BLOCK_N", 1)
    loops = sass_loops(sass, str(Path(compiled.src.fn.fn.__code__.co_filename).resolve()), band_lines, mask_lines)
    for loop in loops:
        loop["per_pair"] = loop["instructions"] * warps / pairs
    return {"kernel": name, "case": case, "config": config, "config_name": config_name(config),
            "registers": registers, "stack": stack, "shared": shared, "blocks_per_sm": blocks,
            "wgmma": len(re.findall(r"\bHGMMA\b", sass)), "mma_sync": len(re.findall(r"\bHMMA\b", sass)),
            "loops": loops, "duplicated_products": duplicated_products(compiled.asm["ttgir"])}


# --- the gates ---------------------------------------------------------------------------------------------------


def _tail(row: dict) -> dict | None:
    """The costliest tail loop of a row."""
    tails = [loop for loop in row["loops"] if loop["class"] == "tail"]
    return max(tails, key=lambda loop: loop["instructions"]) if tails else None


def _band(row: dict) -> dict | None:
    bands = [loop for loop in row["loops"] if loop["class"] == "band"]
    return max(bands, key=lambda loop: loop["instructions"]) if bands else None


def _masked(row: dict) -> dict | None:
    """The costliest masked tail loop of a row (`MASK_HELPERS`)."""
    masked = [loop for loop in row["loops"] if loop["class"] == "masked"]
    return max(masked, key=lambda loop: loop["instructions"]) if masked else None


def gated(row: dict) -> bool:
    """Whether the gates hold a row to them: the forward, dK/dV and dQ kernels of every case but the reported ones."""
    return row["kernel"] in YARDSTICK_OF and row["case"] in CASES and row["case"] not in REPORTED_ONLY


def gate_failures(rows: list[dict]) -> list[str]:
    """Each gate a row misses, in words (the module docstring lists the gates)."""
    failures = []
    key = {(row["kernel"], row["case"], row["config_name"]): row for row in rows}
    cases_of = {}  # the cases counted per kernel (`--case` may leave some out)
    for row in rows:
        cases_of.setdefault(row["kernel"], set()).add(row["case"])
    for row in filter(gated, rows):
        name = f"{SHORT[row['kernel']]} ({row['case']}), {row['config_name']}"
        if row["mma_sync"]:
            failures.append(f"{name}: {row['mma_sync']} mma.sync (HMMA) instructions, every bfloat16 product must be "
                            "a wgmma")
        if row["duplicated_products"]:
            failures.append(f"{name}: products computed twice ({', '.join(row['duplicated_products'])}): a block of "
                            "fewer rows than its warps cover")
        tail, band, masked = _tail(row), _band(row), _masked(row)
        for what, found in (("tail", tail), ("band", band)):
            if not found:  # a gate of a loop not found would pass unchecked
                failures.append(f"{name}: no {what} loop found in its SASS to count")
            elif found["spills"]:
                failures.append(f"{name}: {found['spills']} spill loads/stores in a {what} loop")
        if masked and masked["spills"]:
            failures.append(f"{name}: {masked['spills']} spill loads/stores in a masked tail loop")
        if row["kernel"] == "nezha_forward_kernel" and row["blocks_per_sm"] < FORWARD_BLOCKS_PER_SM:
            failures.append(f"{name}: {row['blocks_per_sm']} block(s) per multiprocessor, the forward needs "
                            f"{FORWARD_BLOCKS_PER_SM}")
        plain_case = WITHOUT_DROPOUT.get(row["case"])
        yardstick = key.get((YARDSTICK_OF[row["kernel"]], YARDSTICK, row["config_name"]))
        plain = key.get((row["kernel"], plain_case, row["config_name"]))
        missing = [what for what, counted, needed in (
            ("the yardstick", yardstick, plain_case is None),
            ("the case without dropout", plain, plain_case in cases_of[row["kernel"]]))  # unless `--case` left it out
            if needed and not (counted and _tail(counted))]
        if missing:  # a gate that compares with nothing would pass unchecked
            failures.append(f"{name}: no counts of {' or '.join(missing)} at this configuration to compare with")
        if plain_case is None and tail and yardstick and _tail(yardstick):
            ratio = tail["per_pair"] / _tail(yardstick)["per_pair"]
            if ratio > TAIL_PER_PAIR_LIMIT:
                failures.append(f"{name}: tail loop {tail['per_pair']:.3f} instructions per pair, {ratio:.2f}x the "
                                f"yardstick's (at most {TAIL_PER_PAIR_LIMIT}x)")
        if tail and band and band["instructions"] > BAND_TILE_LIMIT * tail["instructions"]:
            failures.append(f"{name}: a band tile is {band['instructions'] / tail['instructions']:.2f} tail tiles "
                            f"(at most {BAND_TILE_LIMIT})")
        if plain_case is not None and tail and plain and _tail(plain):
            added = tail["per_pair"] - _tail(plain)["per_pair"]
            if added > DROPOUT_PER_PAIR_LIMIT:
                failures.append(f"{name}: dropout adds {added:.3f} instructions per pair to the tail loop (at most "
                                f"{DROPOUT_PER_PAIR_LIMIT})")
    return failures


def table(rows: list[dict]) -> str:
    """The counts as a Markdown table."""
    lines = ["| kernel | case | block, warps, stages | registers | stack (spills, bytes) | shared KB | blocks/SM | "
             "wgmma / mma.sync | tail loop: instructions (per pair) | band loop: instructions (tail tiles) | "
             "masked tail loop |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        tail, band, masked = _tail(row), _band(row), _masked(row)
        tail_text = f"{tail['instructions']} ({tail['per_pair']:.2f})" if tail else "-"
        if tail and tail["spills"]:
            tail_text += f", {tail['spills']} LDL/STL"
        band_text = "-"
        if band:
            band_text = f"{band['instructions']}" + (f" ({band['instructions'] / tail['instructions']:.2f})"
                                                      if tail else "")
            band_text += f", {band['spills']} LDL/STL" if band["spills"] else ""
        masked_text = "-" if not masked else f"{masked['instructions']}" + (
            f", {masked['spills']} LDL/STL" if masked["spills"] else "")
        lines.append(f"| {SHORT[row['kernel']]} | {row['case']} | {row['config_name']} | {row['registers']} | "
                     f"{row['stack']} | {row['shared'] / 1024:.0f} | {row['blocks_per_sm']} | "
                     f"{row['wgmma']} / {row['mma_sync']} | {tail_text} | {band_text} | {masked_text} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--triton-python", help="count under this Python's Triton (default: this one's)")
    parser.add_argument("--output", type=Path, help="write every count as JSON here")
    parser.add_argument(gpu_fake_driver.PACKAGES, help=argparse.SUPPRESS)  # under --triton-python: where PyTorch is
    parser.add_argument("--plant", action="append", default=[], metavar="KERNEL:M,N,WARPS,STAGES[,REGISTERS]",
                        help="add a configuration to a NEZHA kernel's tuned ones (to see a gate fail, or to try one; "
                             "REGISTERS caps a thread's, Triton's maxnreg), compiled for every case, even one whose "
                             "tuning would not take it, e.g. nezha_forward_kernel:64,64,8,3")
    parser.add_argument("--only", nargs="+", choices=[SHORT[name] for name in YARDSTICK_OF],
                        help="compile these kernels only (and their yardsticks); the others' launches do nothing")
    parser.add_argument("--case", nargs="+", choices=list(CASES), help="compile these cases only")
    args = parser.parse_args(argv)
    if args.triton_python and not args.packages:  # the whole count in that Python, this one's packages after its own
        return gpu_fake_driver.run_under(args.triton_python, __file__, sys.argv[1:] if argv is None else argv)
    gpu_fake_driver.append_packages(args.packages)
    planted = {}
    for text in args.plant:
        kernel, numbers = text.split(":")
        m, n, warps, stages, *registers = (int(x) for x in numbers.split(","))
        planted.setdefault(kernel, []).append({"BLOCK_M": m, "BLOCK_N": n, "num_warps": warps, "num_stages": stages,
                                               **({"maxnreg": registers[0]} if registers else {})})
    counts = compile_calls(args.case or list(CASES), args.only, planted)
    failures = counts.pop("failures") + gate_failures(counts["rows"])
    if args.output:
        command = [str(Path(__file__).relative_to(ROOT)), *(arg for arg in (sys.argv[1:] if argv is None else argv))]
        if args.packages:
            command = command[:command.index(gpu_fake_driver.PACKAGES)]
        made = {"command": "python " + " ".join(command),
                "machine": f"{platform.machine()} CPU ({os.cpu_count()} cores), no GPU: compiled for sm_90"}
        args.output.write_text(json.dumps({**made, **counts, "failures": failures}, indent=1) + "\n")
    print(f"What NEZHA's Triton launchers launch, and the FlashAttention-2 yardstick, compiled for sm_90 (an H100) on "
          f"the CPU by Triton {counts['triton']} through its autotuner and JIT against a fake H100: bfloat16 calls of "
          f"batch {BATCH} x {HEADS} heads x {TOKENS} tokens (a decoding step: 1 query, {DECODING_KEYS} keys) x head "
          f"size {HEAD_SIZE}, K = {K}; instructions are SASS per warp per loop iteration (one tile), per (query, key) "
          "pair in brackets.")
    print(table(counts["rows"]))
    print(f"\n{len(failures)} gate(s) missed" + (":" if failures else "."))
    for failure in failures:
        print(f"- {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
