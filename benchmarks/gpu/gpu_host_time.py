"""Whether NEZHA's Triton op is host-bound on a GPU: host time per call against wall time, beside SDPA's, and where
the host's time goes (cProfile).

    python3 benchmarks/gpu/gpu_host_time.py             # on the GPU machine (a step of benchmarks/gpu/gpu_check.py)
    python3 benchmarks/gpu/gpu_host_time.py --rehearse  # on the CPU: Triton's interpreter, tiny sizes

The calls users make, bfloat16, head size 64, K = 64 (`CALLS`): a forward and a training step (forward and backward)
at batch 4 x 12 heads x 2,048 tokens, no mask (the attention op's case); a fine-tuning training step, batch 16 x 12
heads x 512 tokens, padded, dropout 0.1; a decoding step, batch 4 x 12 heads, one query against 8,192 keys of a
static cache (its mask, the offset a tensor on the GPU). Beside each, SDPA (FlashAttention where it takes the call,
else the backend SDPA picks: the padded call's boolean mask and the static cache's go to another) on the same
tensors. After 5 warm-up calls (compiling and autotuning): `--calls` calls timed on the host without waiting for the
GPU (`host`) and with a synchronisation at the end (`wall`), milliseconds per call; `host` close to `wall` means the
GPU waits for the host. Then NEZHA's training step under cProfile, sorted by cumulative time (the .md has it).
Writes `gpu-host-time.md` and `.json` to `--results` (default benchmarks/results/gpu/).
"""

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.gpu.gpu_script import rehearsing, write_staged  # noqa: E402

rehearsing(sys.argv)  # before anything imports Triton

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.gpu import gpu_ops  # noqa: E402
from benchmarks.machine import describe, results_directory, summary  # noqa: E402
from nezha_hf.attention_ops import RelativeAttentionMask  # noqa: E402

K, HEAD_SIZE, HEADS, DROPOUT = 64, 64, 12, 0.1
# Each call: (step, batch, queries, keys, mask: "none", "padding" or "static", dropout); rehearsing, (batch, length).
CALLS = {"forward, 2,048 tokens": ("forward", 4, 2048, 2048, "none", 0.0),
         "training step, 2,048 tokens": ("training", 4, 2048, 2048, "none", 0.0),
         "training step, 512 tokens, padded, dropout 0.1": ("training", 16, 512, 512, "padding", DROPOUT),
         "decoding step, 8,192 cached tokens, static cache": ("decoding", 4, 1, 8192, "static", 0.0)}
REHEARSAL_SIZES = {"forward": (1, 32, 32), "training": (1, 32, 32), "decoding": (1, 1, 64)}


def _steps(name: str, device: str, rehearse: bool) -> dict:
    """`{"NEZHA": step, "SDPA": step}` running call `name` once on `device`."""
    step, batch, queries, keys, mask_kind, dropout = CALLS[name]
    if rehearse:
        batch, queries, keys = REHEARSAL_SIZES[step]
    heads = 2 if rehearse else HEADS
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(batch, queries, heads, HEAD_SIZE, generator=generator).to(device, torch.bfloat16)
    query = query.transpose(1, 2)  # `[batch, heads, queries, d]`, a view of the projections' layout, as the model's
    key, value = (torch.randn(batch, heads, keys, HEAD_SIZE, generator=generator).to(device, torch.bfloat16)
                  for _ in range(2))
    valid = (torch.arange(keys)[None, :] < keys - torch.arange(batch)[:, None] * (keys // (2 * batch))).to(device)
    mask = {"none": RelativeAttentionMask(), "padding": RelativeAttentionMask(key_is_valid=valid),
            "static": RelativeAttentionMask(key_is_valid=valid, causal=True,
                                            query_offset=torch.tensor(keys - 1, device=device))}[mask_kind]
    sdpa_mask = None if mask_kind == "none" else valid[:, None, None, :]
    table = gpu_ops.relative_table(K, HEAD_SIZE, torch.bfloat16, device)
    problem = gpu_ops.problem_for(mask, HEAD_SIZE, dropout, seed=0x1234_5678_9ABC)
    engines = {"NEZHA": gpu_ops.nezha(table, problem),
               "SDPA": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask,
                                                                      dropout_p=dropout).transpose(1, 2)}
    inputs = [query, key, value]
    if step != "training":
        return {engine: gpu_ops.forward_step(attend, inputs) for engine, attend in engines.items()}
    for tensor in inputs:
        tensor.requires_grad_(True)
    grad_output = torch.randn(batch, queries, heads, HEAD_SIZE, generator=generator).to(device, torch.bfloat16)
    return {engine: gpu_ops.training_step(attend, inputs, grad_output) for engine, attend in engines.items()}


def per_call_ms(step, device: str, calls: int) -> tuple[float, float]:
    """`(host, wall)` milliseconds per call of `calls` calls of `step`."""
    gpu_ops.synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        step()
    host = time.perf_counter()
    gpu_ops.synchronize(device)
    return 1e3 * (host - start) / calls, 1e3 * (time.perf_counter() - start) / calls


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rehearse", action="store_true", help="on the CPU under Triton's interpreter, tiny sizes")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--results", type=Path, help="folder to write to (default: the machine's results folder)")
    args = parser.parse_args(argv)
    if not args.rehearse and not torch.cuda.is_available():
        print("gpu_host_time.py: no CUDA GPU is visible to PyTorch (run with --rehearse to rehearse on the CPU)",
              file=sys.stderr)
        return 1
    device = "cpu" if args.rehearse else "cuda"
    calls = 2 if args.rehearse else args.calls
    machine = describe(torch.bfloat16, device)
    output = (args.results or results_directory(machine)) / "gpu-host-time"
    output.parent.mkdir(parents=True, exist_ok=True)
    rows, profiled = [], None
    for name in CALLS:
        steps = _steps(name, device, args.rehearse)
        row = {"call": name}
        for engine, step in steps.items():
            for _ in range(2 if args.rehearse else 5):
                step()
            row[f"{engine}_host_ms"], row[f"{engine}_wall_ms"] = per_call_ms(step, device, calls)
        rows.append(row)
        print(f"{name}: NEZHA host {row['NEZHA_host_ms']:.3f} / wall {row['NEZHA_wall_ms']:.3f} ms, SDPA host "
              f"{row['SDPA_host_ms']:.3f} / wall {row['SDPA_wall_ms']:.3f} ms", flush=True)
        if name == "training step, 2,048 tokens":
            profiler = cProfile.Profile()
            profiler.enable()
            per_call_ms(steps["NEZHA"], device, calls)
            profiler.disable()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(40)
            profiled = text.getvalue()
    command = "python3 benchmarks/gpu/gpu_host_time.py " + " ".join(sys.argv[1:] if argv is None else argv)
    lines = [f"Command: `{command.strip()}`", "", summary(machine), "",
             f"Milliseconds per call ({calls} calls after warm-up): host = issuing them, wall = until the GPU is "
             "done; bfloat16, head size 64, K = 64.", "",
             "| call | NEZHA host | NEZHA wall | SDPA host | SDPA wall | NEZHA / SDPA host |", "|---|---|---|---|---|---|"]
    lines += [f"| {row['call']} | {row['NEZHA_host_ms']:.3f} | {row['NEZHA_wall_ms']:.3f} | {row['SDPA_host_ms']:.3f} | "
              f"{row['SDPA_wall_ms']:.3f} | {row['NEZHA_host_ms'] / row['SDPA_host_ms']:.2f} |" for row in rows]
    if profiled:
        lines += ["", "NEZHA's training step at 2,048 tokens under cProfile:", "", "```", profiled.strip(), "```"]
    write_staged(output.with_suffix(".md"), "\n".join(lines) + "\n")
    write_staged(output.with_suffix(".json"), json.dumps({"command": command.strip(), "machine": machine,
                                                          "rows": rows}, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
