"""The GPU gates, checked on the CPU: NEZHA's Triton kernels compiled for an H100 (sm_90) and counted.

    python benchmarks/gpu/gpu_gates.py [--triton-python PYTHON] [--output FILE.json]     (`make gpu-gates`)

Every tuned configuration of every NEZHA kernel a 2,048-token bfloat16 call launches (batch 4 x 12 heads x head size
64, K = 64, no mask; with and without attention dropout), and the plain FlashAttention-2 yardstick
(`benchmarks/gpu/triton_yardstick.py`) with the same blocks, warps and stages, are compiled for sm_90 without a GPU,
exactly as Triton's JIT specialises those launches: the real launchers (`triton_attention.triton_forward`,
`triton_backward`) run on CPU tensors with the kernels replaced by recorders, and each recorded launch goes through
the JIT's own binder (`create_function_from_signature`, `JITFunction._pack_args`: which integers are multiples of 16,
which are 1, which pointers are aligned) into `triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))`.
Of each compiled kernel it reports registers (`cuobjdump --dump-resource-usage`), its stack frame (spilled registers),
shared memory, blocks per H100 multiprocessor (65,536 registers, 228 KB of shared memory of which 1 KB per block is
reserved, 64 warps), HGMMA (wgmma) and HMMA (mma.sync) instructions, and for each loop of the SASS (a backward branch;
`nvdisasm`) its instructions per warp per tile, per (query, key) pair (times the warps, over the tile's pairs) and its
local-memory loads and stores (`LDL`/`STL`: spills). A loop is the band's when an instruction of it comes from a band
helper's source lines (`BAND_HELPERS`), a tail's otherwise.

The gates (`gate_failures`); the script exits 1 when one fails, naming each failure:
- every bfloat16 product is a wgmma (no HMMA);
- no 64-row block on 8 warps: no product has fewer rows than its warps cover (16 per warp along the rows), which
  would compute the same rows twice;
- no spills in tail loops;
- the forward at 2 blocks per multiprocessor or more;
- tail-loop instructions per pair at most 1.1x the yardstick's (forward, dK/dV, dQ; same configuration);
- a band tile at most 2.5 tail tiles (instructions per loop iteration);
- dropout adds at most 0.25 instructions per pair to each kernel's tail loop.

Triton's wheel carries ptxas, cuobjdump and nvdisasm. `--triton-python` compiles with another Python's Triton (e.g.
a venv with the GPU machine's Triton 3.6, which needs no PyTorch to compile: `python3 -m venv /tmp/triton36 &&
/tmp/triton36/bin/pip install triton==3.6.0`); the launches are recorded here, with PyTorch. The table names the
Triton that compiled. These are counts from a compiler, not timings: they say where time can go on a GPU.
"""

import argparse
import contextlib
import importlib.util
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
KERNELS_FILE = ROOT / "nezha_hf" / "triton_kernels.py"
YARDSTICK_FILE = ROOT / "benchmarks" / "gpu" / "triton_yardstick.py"

# The call the gates compile for (the H100 run's case): batch x heads x tokens x head size, the table's K.
BATCH, HEADS, TOKENS, HEAD_SIZE, K = 4, 12, 2048, 64, 64
DROPOUT = 0.1
# NEZHA's kernels and the yardstick kernel each is measured against.
YARDSTICK_OF = {"nezha_forward_kernel": "yardstick_forward_kernel",
                "nezha_key_value_grad_kernel": "yardstick_key_value_grad_kernel",
                "nezha_query_grad_kernel": "yardstick_query_grad_kernel"}
SHORT = {"nezha_forward_kernel": "forward", "nezha_key_value_grad_kernel": "dK/dV", "nezha_query_grad_kernel": "dQ",
         "yardstick_forward_kernel": "yardstick forward", "yardstick_key_value_grad_kernel": "yardstick dK/dV",
         "yardstick_query_grad_kernel": "yardstick dQ"}
# The helpers of `triton_kernels.py` that only band tiles run: a loop holding their lines is the band's.
BAND_HELPERS = ("_by_pair", "_add_times_window", "_rotated_band_tile", "_rotated_key_value_tile",
                "_rotated_query_tile")

# An H100's multiprocessor (../shared/docs/gpu-measuring.md).
SM_REGISTERS, SM_SHARED, BLOCK_RESERVED_SHARED, SM_WARPS, SM_BLOCKS = 65536, 228 * 1024, 1024, 64, 32

# The gates' limits.
TAIL_PER_PAIR_LIMIT = 1.1  # times the yardstick's
BAND_TILE_LIMIT = 2.5  # tail tiles
DROPOUT_PER_PAIR_LIMIT = 0.25  # instructions per pair
FORWARD_BLOCKS_PER_SM = 2


# --- recording the launches (PyTorch and nezha_hf) ---------------------------------------------------------------


def _argument(value):
    """A launch argument as JSON: a tensor by its dtype and whether its address is a multiple of 16."""
    import torch

    if isinstance(value, torch.Tensor):
        return {"tensor": str(value.dtype), "aligned": value.data_ptr() % 16 == 0}
    return value


def _jit(kernel):
    """The JIT function of a kernel, autotuned or not."""
    import triton

    return kernel.fn if isinstance(kernel, triton.runtime.Autotuner) else kernel


class _Recorder:
    """Stands for a kernel: `kernel[grid](...)` records the launch's arguments by name."""

    def __init__(self, module: str, kernel, launches: list, case: str):
        self.module, self.kernel, self.launches, self.case = module, kernel, launches, case

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            jit = _jit(self.kernel)
            named = {**dict(zip(jit.arg_names, args)), **kwargs}
            self.launches.append({"module": self.module, "kernel": jit.__name__, "case": self.case,
                                  "arguments": {name: _argument(value) for name, value in named.items()}})

        return launch


def record_launches() -> list[dict]:
    """The launches of a `TOKENS`-token bfloat16 forward and backward, without and with dropout, by NEZHA's launchers
    and the yardstick's, on CPU tensors (nothing runs)."""
    os.environ.pop("TRITON_INTERPRET", None)
    import torch

    sys.path.insert(0, str(ROOT))
    from benchmarks.gpu import triton_yardstick
    from nezha_hf import relative_attention, triton_attention
    from nezha_hf import triton_kernels as kernels
    from nezha_hf.attention_ops import AttentionProblem, RelativeAttentionMask

    assert not kernels.INTERPRETING, "Triton was imported under TRITON_INTERPRET"
    launches = []
    table = relative_attention.sinusoid_relative_table(K, HEAD_SIZE).to(torch.bfloat16)

    def projections():  # `[batch, heads, tokens, d]` views of `[batch, tokens, heads, d]`, as the model's
        return [torch.zeros(BATCH, TOKENS, HEADS, HEAD_SIZE, dtype=torch.bfloat16).transpose(1, 2) for _ in range(3)]

    names = ("nezha_forward_kernel", "nezha_merge_kernel", "nezha_row_statistics_kernel", "nezha_key_value_grad_kernel",
             "nezha_query_grad_kernel")
    for case, dropout in (("bfloat16", 0.0), ("bfloat16, dropout", DROPOUT)):
        with contextlib.ExitStack() as patches:
            for name in names:
                original = getattr(kernels, name)
                setattr(kernels, name, _Recorder("nezha", original, launches, case))
                patches.callback(setattr, kernels, name, original)
            query, key, value = projections()
            problem = AttentionProblem(RelativeAttentionMask(), HEAD_SIZE**-0.5, dropout, torch.tensor(1))
            output, lse = triton_attention.triton_forward(query, key, value, table, problem)
            triton_attention.triton_backward(output.transpose(1, 2), query, key, value, table, problem,
                                             output.transpose(1, 2), lse)
    with contextlib.ExitStack() as patches:
        for name in YARDSTICK_OF.values():
            original = getattr(triton_yardstick, name)
            setattr(triton_yardstick, name, _Recorder("yardstick", original, launches, "bfloat16"))
            patches.callback(setattr, triton_yardstick, name, original)
        query, key, value = (torch.zeros(BATCH, HEADS, TOKENS, HEAD_SIZE, dtype=torch.bfloat16) for _ in range(3))
        output, lse = triton_yardstick.yardstick_forward(query, key, value, HEAD_SIZE**-0.5)
        triton_yardstick.yardstick_backward(output, query, key, value, output, lse, HEAD_SIZE**-0.5)
    return launches


# --- compiling and counting (Triton only) ------------------------------------------------------------------------


def _load(name: str, path: Path):
    """A module from its file, without importing its package (the compiling Python may have no PyTorch)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class _Pointer:
    """What Triton's JIT specialises a tensor argument on: its dtype and its address's alignment."""

    def __init__(self, dtype: str, aligned: bool):
        self.dtype = dtype
        self.address = (1 << 20) + (0 if aligned else 2)

    def data_ptr(self) -> int:
        return self.address


def _tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def config_dict(config) -> dict:
    """A `triton.Config` as the counts hold it: its keyword arguments, `num_warps`, `num_stages`, and `maxnreg` where
    capped."""
    return {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages,
            **({"maxnreg": config.maxnreg} if config.maxnreg else {})}


def config_name(config: dict) -> str:
    """A configuration (`BLOCK_M`, `BLOCK_N`, `num_warps`, `num_stages`, and `maxnreg` where capped) in words, as the
    counts and the GPU check's rows name it: `128x64, 8 warps, 3 stages, 128 registers`."""
    name = f"{config['BLOCK_M']}x{config['BLOCK_N']}, {config['num_warps']} warps, {config['num_stages']} stages"
    return name + (f", {config['maxnreg']} registers" if config.get("maxnreg") else "")


def _band_lines(module) -> set[int]:
    """The source lines of the band helpers of `module` (`BAND_HELPERS` that it has)."""
    import inspect

    lines = set()
    for name in BAND_HELPERS:
        helper = getattr(module, name, None)
        if helper is not None:
            source, first = inspect.getsourcelines(getattr(helper, "fn", helper))
            lines.update(range(first, first + len(source)))
    return lines


def sass_loops(sass: str, source_file: str, band_lines: set[int]) -> list[dict]:
    """The innermost loops of an `nvdisasm -c -gi` listing, in program order: `{"class": "band" or "tail",
    "instructions", "spills"}` (`LDL`/`STL`), a loop being the code from a label to a branch back to it."""
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
        band = any(lines & band_lines for _, lines in body)
        result.append({"class": "band" if band else "tail", "instructions": len(body),
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


def compile_and_count(launch: dict, config: dict, module, band_lines: set[int]) -> dict:
    """Compile one launch with one configuration for sm_90 as the JIT would, and count."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    jit = _jit(getattr(module, launch["kernel"]))
    target = GPUTarget("cuda", 90, 32)  # an H100; a CUDA warp is 32 threads
    backend = make_backend(target)
    arguments = {name: _Pointer(value["tensor"], value["aligned"]) if isinstance(value, dict) else value
                 for name, value in launch["arguments"].items()}
    arguments.update(config)
    binder = create_function_from_signature(jit.signature, jit.params, backend)
    bound, specialization, options = binder(**arguments)
    options, signature, constexprs, attributes = jit._pack_args(backend, arguments, bound, specialization, options)
    compiled = triton.compile(ASTSource(jit, signature, constexprs, attributes), target=target,
                              options=options.__dict__)
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
    pairs = config["BLOCK_M"] * config["BLOCK_N"]
    loops = sass_loops(sass, str(Path(module.__file__).resolve()), band_lines)
    for loop in loops:
        loop["per_pair"] = loop["instructions"] * warps / pairs
    return {"kernel": launch["kernel"], "case": launch["case"], "config": config,
            "config_name": config_name(config), "registers": registers, "stack": stack, "shared": shared,
            "blocks_per_sm": blocks, "wgmma": len(re.findall(r"\bHGMMA\b", sass)),
            "mma_sync": len(re.findall(r"\bHMMA\b", sass)), "loops": loops,
            "duplicated_products": duplicated_products(compiled.asm["ttgir"])}


def _configs(module, launch: dict) -> list[dict]:
    """The configurations the autotuner tries for this launch (after its pruning), as keyword arguments."""
    kernel = getattr(module, launch["kernel"])
    prune = getattr(kernel, "early_config_prune", None)
    arguments = {name: value for name, value in launch["arguments"].items()}
    configs = prune(kernel.configs, {}, **arguments) if prune else kernel.configs
    return [config_dict(config) for config in configs]


def compile_launches(launches: list[dict], extra_configs: dict | None = None) -> dict:
    """Every NEZHA launch with each of its tuned configurations (plus `extra_configs[kernel]`, a planted one), and
    the yardstick with each configuration of the NEZHA kernel it is measured against. Compiled afresh, in a cache of
    their own: Triton's cache keys kernels by their source, so a cached kernel of another checkout would name that
    checkout's file in its SASS, and no loop would be told a band's."""
    os.environ.pop("TRITON_INTERPRET", None)
    with tempfile.TemporaryDirectory() as cache, mock.patch.dict(os.environ, TRITON_CACHE_DIR=cache):
        return _compile_launches(launches, extra_configs)


def _compile_launches(launches: list[dict], extra_configs: dict | None) -> dict:
    import triton

    modules = {"nezha": _load("nezha_gates_kernels", KERNELS_FILE),
               "yardstick": _load("nezha_gates_yardstick", YARDSTICK_FILE)}
    band_lines = _band_lines(modules["nezha"])
    rows, configs_of = [], {}
    for launch in launches:
        if launch["module"] != "nezha" or launch["kernel"] not in YARDSTICK_OF:
            continue  # the decoding step's merge kernel is not launched by this call
        configs = _configs(modules["nezha"], launch) + list((extra_configs or {}).get(launch["kernel"], []))
        measured = configs_of.setdefault(YARDSTICK_OF[launch["kernel"]], [])  # every case's (dropout tunes fewer)
        measured += [config for config in configs if config not in measured]
        for config in configs:
            rows.append(compile_and_count(launch, config, modules["nezha"], band_lines))
            print(f"compiled {SHORT[launch['kernel']]} ({launch['case']}), {config_name(config)}", file=sys.stderr,
                  flush=True)
    for launch in launches:
        if launch["module"] == "yardstick":
            for config in configs_of.get(launch["kernel"], []):
                rows.append(compile_and_count(launch, config, modules["yardstick"], set()))
    return {"triton": triton.__version__, "rows": rows}


# --- the gates ---------------------------------------------------------------------------------------------------


def _tail(row: dict) -> dict | None:
    """The costliest tail loop of a row."""
    tails = [loop for loop in row["loops"] if loop["class"] == "tail"]
    return max(tails, key=lambda loop: loop["instructions"]) if tails else None


def _band(row: dict) -> dict | None:
    bands = [loop for loop in row["loops"] if loop["class"] == "band"]
    return max(bands, key=lambda loop: loop["instructions"]) if bands else None


def gate_failures(rows: list[dict]) -> list[str]:
    """Each gate a row misses, in words (the module docstring lists the gates)."""
    failures = []
    key = {(row["kernel"], row["case"], row["config_name"]): row for row in rows}
    plain_kernels = {row["kernel"] for row in rows if row["case"] == "bfloat16"}
    for row in rows:
        name = f"{SHORT[row['kernel']]} ({row['case']}), {row['config_name']}"
        if row["kernel"].startswith("yardstick"):
            continue
        if row["mma_sync"]:
            failures.append(f"{name}: {row['mma_sync']} mma.sync (HMMA) instructions, every bfloat16 product must be "
                            "a wgmma")
        if row["duplicated_products"]:
            failures.append(f"{name}: products computed twice ({', '.join(row['duplicated_products'])}): a block of "
                            "fewer rows than its warps cover")
        tail, band = _tail(row), _band(row)
        for what, found in (("tail", tail), ("band", band)):
            if not found:  # a gate of a loop not found would pass unchecked
                failures.append(f"{name}: no {what} loop found in its SASS to count")
        if tail and tail["spills"]:
            failures.append(f"{name}: {tail['spills']} spill loads/stores in a tail loop")
        if row["kernel"] == "nezha_forward_kernel" and row["blocks_per_sm"] < FORWARD_BLOCKS_PER_SM:
            failures.append(f"{name}: {row['blocks_per_sm']} block(s) per multiprocessor, the forward needs "
                            f"{FORWARD_BLOCKS_PER_SM}")
        yardstick = key.get((YARDSTICK_OF[row["kernel"]], "bfloat16", row["config_name"]))
        plain = key.get((row["kernel"], "bfloat16", row["config_name"]))
        missing = [what for what, counted, needed in (
            ("the yardstick", yardstick, True),
            ("the case without dropout", plain, row["kernel"] in plain_kernels))  # unless `--case` left it out
            if needed and not (counted and _tail(counted))]
        if missing:  # a gate that compares with nothing would pass unchecked
            failures.append(f"{name}: no counts of {' or '.join(missing)} at this configuration to compare with")
        if row["case"] == "bfloat16" and tail and yardstick and _tail(yardstick):
            ratio = tail["per_pair"] / _tail(yardstick)["per_pair"]
            if ratio > TAIL_PER_PAIR_LIMIT:
                failures.append(f"{name}: tail loop {tail['per_pair']:.3f} instructions per pair, {ratio:.2f}x the "
                                f"yardstick's (at most {TAIL_PER_PAIR_LIMIT}x)")
        if tail and band and band["instructions"] > BAND_TILE_LIMIT * tail["instructions"]:
            failures.append(f"{name}: a band tile is {band['instructions'] / tail['instructions']:.2f} tail tiles "
                            f"(at most {BAND_TILE_LIMIT})")
        if row["case"] != "bfloat16" and tail and plain and _tail(plain):
            added = tail["per_pair"] - _tail(plain)["per_pair"]
            if added > DROPOUT_PER_PAIR_LIMIT:
                failures.append(f"{name}: dropout adds {added:.3f} instructions per pair to the tail loop (at most "
                                f"{DROPOUT_PER_PAIR_LIMIT})")
    return failures


def table(rows: list[dict]) -> str:
    """The counts as a Markdown table."""
    lines = ["| kernel | case | block, warps, stages | registers | stack (spills, bytes) | shared KB | blocks/SM | "
             "wgmma / mma.sync | tail loop: instructions (per pair) | band loop: instructions (tail tiles) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        tail, band = _tail(row), _band(row)
        tail_text = f"{tail['instructions']} ({tail['per_pair']:.2f})" if tail else "-"
        if tail and tail["spills"]:
            tail_text += f", {tail['spills']} LDL/STL"
        band_text = f"{band['instructions']} ({band['instructions'] / tail['instructions']:.2f})" if band and tail else "-"
        lines.append(f"| {SHORT[row['kernel']]} | {row['case']} | {row['config_name']} | {row['registers']} | "
                     f"{row['stack']} | {row['shared'] / 1024:.0f} | {row['blocks_per_sm']} | "
                     f"{row['wgmma']} / {row['mma_sync']} | {tail_text} | {band_text} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--triton-python", help="compile with this Python's Triton (default: this one's)")
    parser.add_argument("--output", type=Path, help="write every count as JSON here")
    parser.add_argument("--compile-only", type=Path, help=argparse.SUPPRESS)  # a --triton-python worker's input
    parser.add_argument("--plant", action="append", default=[], metavar="KERNEL:M,N,WARPS,STAGES[,REGISTERS]",
                        help="add a configuration to a NEZHA kernel's tuned ones (to see a gate fail, or to try one; "
                             "REGISTERS caps a thread's, Triton's maxnreg), compiled for every case, even one whose "
                             "tuning would not take it, e.g. nezha_forward_kernel:64,64,8,3")
    parser.add_argument("--only", nargs="+", choices=[SHORT[name] for name in YARDSTICK_OF],
                        help="compile these kernels only (and their yardsticks)")
    parser.add_argument("--case", choices=["bfloat16", "bfloat16, dropout"], help="compile this case only")
    args = parser.parse_args(argv)
    planted = {}
    for text in args.plant:
        kernel, numbers = text.split(":")
        m, n, warps, stages, *registers = (int(x) for x in numbers.split(","))
        planted.setdefault(kernel, []).append({"BLOCK_M": m, "BLOCK_N": n, "num_warps": warps, "num_stages": stages,
                                               **({"maxnreg": registers[0]} if registers else {})})
    if args.compile_only:
        job = json.loads(args.compile_only.read_text())
        print(json.dumps(compile_launches(job["launches"], job["planted"])))
        return 0
    launches = [launch for launch in record_launches()
                if (not args.only or SHORT.get(launch["kernel"], "").removeprefix("yardstick ") in args.only)
                and (not args.case or launch["module"] == "yardstick" or launch["case"] == args.case)]
    if args.triton_python:
        with tempfile.NamedTemporaryFile("w", suffix=".json") as job:
            json.dump({"launches": launches, "planted": planted}, job)
            job.flush()
            environment = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
            done = subprocess.run([args.triton_python, __file__, "--compile-only", job.name], stdout=subprocess.PIPE,
                                  env=environment, text=True, check=True)
        counts = json.loads(done.stdout)
    else:
        counts = compile_launches(launches, planted)
    failures = gate_failures(counts["rows"])
    if args.output:
        made = {"command": "python " + " ".join([str(Path(__file__).relative_to(ROOT)), *sys.argv[1:]]),
                "machine": f"{platform.machine()} CPU ({os.cpu_count()} cores), no GPU: compiled for sm_90"}
        args.output.write_text(json.dumps({**made, **counts, "failures": failures}, indent=1) + "\n")
    print(f"NEZHA's Triton kernels and the FlashAttention-2 yardstick compiled for sm_90 (an H100) on the CPU by Triton "
          f"{counts['triton']}: a {TOKENS}-token bfloat16 call, batch {BATCH} x {HEADS} heads x head size {HEAD_SIZE}, "
          f"K = {K}; instructions are SASS per warp per loop iteration (one tile), per (query, key) pair in brackets.")
    print(table(counts["rows"]))
    print(f"\n{len(failures)} gate(s) missed" + (":" if failures else "."))
    for failure in failures:
        print(f"- {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
