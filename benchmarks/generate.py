"""Cached generation speed of NezhaForUniLM against a same-size BertLMHeadModel (SDPA, KV cache), in one run.

    python benchmarks/generate.py                        # sources of 512, 2,048 and 8,192 tokens
    python benchmarks/generate.py --lengths 512 --new-tokens 16

Base width (12 layers unless `--layers`, hidden 768, 12 heads, vocabulary 21,128; NEZHA with K = 64), float32,
batch 1, greedy decoding forced to produce exactly `--new-tokens` tokens. Each `generate` call is timed in two parts:
the prefill (from the call to the end of the model's first forward pass, which reads the source) and the decoding
(from there to the end of the call: N - 1 cached steps, so the speed is `(N - 1) / decoding time`). Timing both
inside one call matters at long sources: a prefill of 8,192 tokens varies by more from call to call than all the
decoding takes, so subtracting a separate prefill-only call's time does not measure decoding. NEZHA and BERT
alternate; each number is the median of `--repeats` runs. BERT gets absolute position embeddings long enough for
the longest input. Writes `benchmarks/results/<machine kind>/generate.md` and `.json`
(`machine.results_directory`).
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import BertConfig, BertLMHeadModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.attention import BASE  # noqa: E402
from benchmarks.machine import describe, results_directory, summary  # noqa: E402
from nezha_hf import NezhaConfig, NezhaForUniLM  # noqa: E402

SEP = 102


def build(kind: str, max_length: int, layers: int = 12):
    torch.manual_seed(0)
    sizes = {**BASE, "num_hidden_layers": layers}
    if kind == "bert":
        config = BertConfig(**sizes, max_position_embeddings=max_length, is_decoder=True)
        return BertLMHeadModel._from_config(config, attn_implementation="sdpa").eval()
    return NezhaForUniLM._from_config(NezhaConfig(**sizes, max_relative_position=64)).eval()


def time_generate(model, input_ids, new_tokens: int) -> tuple[float, float]:
    """`(prefill seconds, decoding seconds)` of one `generate` call: up to the end of the first forward pass, and
    from there to the end."""
    ends = []
    hook = model.register_forward_hook(lambda module, args, output: ends.append(time.perf_counter()))
    start = time.perf_counter()
    try:
        with torch.no_grad():
            out = model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                min_new_tokens=new_tokens, do_sample=False, eos_token_id=SEP, pad_token_id=0, use_cache=True,
            )
    finally:
        hook.remove()
    end = time.perf_counter()
    assert out.shape[1] == input_ids.shape[1] + new_tokens and len(ends) == new_tokens
    return ends[0] - start, end - ends[0]


def measure(length: int, new_tokens: int, repeats: int, layers: int = 12) -> dict:
    models = {kind: build(kind, length + new_tokens, layers) for kind in ("nezha", "bert")}
    input_ids = torch.randint(1000, 21128, (1, length))
    input_ids[0, 0], input_ids[0, -1] = 101, SEP
    for model in models.values():  # warm-up
        time_generate(model, input_ids[:, :64], 2)
    samples = {kind: {"prefill": [], "decode": []} for kind in models}
    for _ in range(repeats):
        for kind, model in models.items():
            prefill, decode = time_generate(model, input_ids, new_tokens)
            samples[kind]["prefill"].append(prefill)
            samples[kind]["decode"].append(decode)
    row = {"source_tokens": length, "new_tokens": new_tokens, "layers": layers}
    for kind, times in samples.items():
        prefill, decode = statistics.median(times["prefill"]), statistics.median(times["decode"])
        row[f"{kind}_prefill_s"] = prefill
        row[f"{kind}_decode_tokens_per_s"] = (new_tokens - 1) / decode
        row[f"{kind}_overall_tokens_per_s"] = new_tokens / (prefill + decode)
    row["decode_speed_ratio"] = row["nezha_decode_tokens_per_s"] / row["bert_decode_tokens_per_s"]
    row["prefill_time_ratio"] = row["nezha_prefill_s"] / row["bert_prefill_s"]
    return row


def markdown(rows, command: str, machine: dict) -> str:
    lines = [
        f"Command: `{command}`",
        "",
        summary(machine),
        "",
        f"{rows[0]['layers']} layers, float32, batch 1, greedy, "
        f"{rows[0]['new_tokens']} new tokens.",
        "",
        "| source tokens | NEZHA prefill (s) | BERT prefill (s) | prefill ratio | NEZHA decode (tok/s) | "
        "BERT decode (tok/s) | decode speed NEZHA/BERT | NEZHA overall (tok/s) | BERT overall (tok/s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['source_tokens']} | {r['nezha_prefill_s']:.2f} | {r['bert_prefill_s']:.2f} | "
            f"{r['prefill_time_ratio']:.2f} | {r['nezha_decode_tokens_per_s']:.1f} | "
            f"{r['bert_decode_tokens_per_s']:.1f} | {r['decode_speed_ratio']:.2f} | "
            f"{r['nezha_overall_tokens_per_s']:.2f} | {r['bert_overall_tokens_per_s']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--layers", type=int, default=12, help="layers of both models")
    args = parser.parse_args(argv)
    machine = describe(torch.float32)
    print(summary(machine), flush=True)
    rows = []
    for length in args.lengths:
        rows.append(measure(length, args.new_tokens, args.repeats, args.layers))
        print(json.dumps(rows[-1]), flush=True)
    command = "python benchmarks/generate.py " + " ".join(sys.argv[1:] if argv is None else argv)
    table = markdown(rows, command.strip(), machine)
    print(table)
    results = results_directory(machine)
    (results / "generate.md").write_text(table)
    (results / "generate.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
