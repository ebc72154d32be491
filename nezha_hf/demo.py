"""`make demo`: load a transformers 4.x NEZHA checkpoint with the Auto classes and run a 4,096-token input.

transformers 4.x refused anything over 512 tokens; here the only limit is memory. Prints the
load report, the time of one forward pass with each attention implementation, and the peak
resident memory of the process.
"""

import argparse
import time
from pathlib import Path

import torch
from transformers import AutoModelForMaskedLM

import nezha_hf

DEFAULT_CHECKPOINT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "nezha-v4-reference" / "mlm-long"


def peak_memory_mb() -> float:
    """Resident-set high-water mark of this process (Linux), in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT)
    parser.add_argument("--tokens", type=int, default=4096)
    args = parser.parse_args(argv)

    model, info = AutoModelForMaskedLM.from_pretrained(args.checkpoint, output_loading_info=True)
    model.eval()
    print(f"Loaded {type(model).__name__} from {args.checkpoint} (saved by transformers 4.39.3)")
    print(f"  load report: missing={info['missing_keys'] or 'none'} unexpected={info['unexpected_keys'] or 'none'}")
    print(f"  config.max_position_embeddings = {model.config.max_position_embeddings} (kept for compatibility, limits nothing)")

    torch.manual_seed(0)
    input_ids = torch.randint(5, model.config.vocab_size, (1, args.tokens))
    input_ids[0, 0] = 1
    masked_position = args.tokens - 10
    input_ids[0, masked_position] = 4
    logits = {}
    for implementation in (nezha_hf.FAST_ATTENTION, "eager"):
        model.set_attn_implementation(implementation)
        start = time.perf_counter()
        with torch.no_grad():
            logits[implementation] = model(input_ids).logits
        print(f"  {args.tokens} tokens, attn_implementation={implementation!r}: {time.perf_counter() - start:.3f} s")
    difference = (logits["eager"] - logits[nezha_hf.FAST_ATTENTION]).abs().max().item()
    print(f"  max |logit difference| between the two implementations: {difference:.2e}")
    top = logits[nezha_hf.FAST_ATTENTION][0, masked_position].topk(3)
    print(f"  top-3 token ids at masked position {masked_position}: {top.indices.tolist()}")
    print(f"  peak resident memory of this process: {peak_memory_mb():.0f} MB")


if __name__ == "__main__":
    main()
