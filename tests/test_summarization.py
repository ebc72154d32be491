"""The extractor on synthetic CAIL2020 data whose right sentences are known by construction."""

import json
import random

import pytest
import torch
from helpers import VOCAB, synthetic_judgment, tiny_config, write_jsonl

from nezha_hf import NezhaForSentenceExtraction
from nezha_hf.cail import read_judgments
from nezha_hf.summarization import (
    ExtractionCollator,
    encode_document,
    select_sentences,
    sentence_probabilities,
)


def test_extractor_learns_the_key_sentences(tokenizer, tmp_path):
    torch.manual_seed(0)
    rng = random.Random(2)
    model = NezhaForSentenceExtraction(tiny_config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                                   max_relative_position=16))
    collator = ExtractionCollator(tokenizer)
    train = [synthetic_judgment(rng, i) for i in range(64)]
    encoded = [{**encode_document(tokenizer, [t["sentence"] for t in r["text"]]),
                "labels": [t["label"] for t in r["text"]]} for r in train]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    for step in range(150):
        batch = collator(encoded[(step * 8) % 64 : (step * 8) % 64 + 8])
        loss = model(**batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    held_out = read_judgments([write_jsonl(tmp_path / "judgments.jsonl", [synthetic_judgment(rng, 100 + i) for i in range(10)])])
    probabilities = sentence_probabilities(model, tokenizer, held_out, batch_size=4)
    correct = [select_sentences(p, j.sentences, threshold=0.5) == [i for i, k in enumerate(j.labels) if k]
               for p, j in zip(probabilities, held_out)]
    assert sum(correct) >= 9, correct


def test_documents_over_10000_characters_are_read_whole(tokenizer, tmp_path):
    rng = random.Random(3)
    record = synthetic_judgment(rng, 0, sentences=900, key=20, sentence_length=(10, 14))
    judgment = read_judgments([write_jsonl(tmp_path / "judgments.jsonl", [record])])[0]
    assert len(judgment.text) > 10_000
    encoded = encode_document(tokenizer, judgment.sentences)
    assert max(encoded["sentence_ids"]) == len(judgment.sentences) - 1  # the last sentence is in view
    model = NezhaForSentenceExtraction(tiny_config(vocab_size=VOCAB)).eval()
    probabilities = sentence_probabilities(model, tokenizer, [judgment])[0]
    assert len(probabilities) == 900 and all(0 < p < 1 for p in probabilities)


def test_select_sentences_threshold_and_budget(tokenizer):
    sentences = ["原告。", "被告被告被告。", "法院。", "判决。"]
    assert select_sentences([0.9, 0.1, 0.6, 0.2], sentences, threshold=0.5) == [0, 2]
    assert select_sentences([0.1, 0.2, 0.3, 0.4], sentences, threshold=0.5) == [3]  # at least the best one
    budgeted = select_sentences([0.9, 0.8, 0.7, 0.1], sentences, tokenizer, threshold=0.5, token_budget=6)
    assert budgeted == [0]  # 原告。 (3 tokens) fits; 被告被告被告。 (7) would exceed 6


def test_the_extractor_starts_from_an_encoder_without_a_load_table(tmp_path, caplog):
    """A masked-LM base: its head left over and the sentence scorer missing are what is expected, not a warning;
    anything else missing is named."""
    from safetensors.torch import load_file, save_file
    from transformers.utils import logging as hf_logging

    from nezha_hf import NezhaForMaskedLM
    from nezha_hf.summarization import extractor_from

    torch.manual_seed(0)
    NezhaForMaskedLM(tiny_config()).save_pretrained(tmp_path / "base")
    hf_logging.enable_propagation()
    try:
        with caplog.at_level("WARNING"):
            extractor_from(tmp_path / "base")
        assert not caplog.text  # neither transformers' LOAD REPORT nor a warning of ours
        weights = load_file(tmp_path / "base" / "model.safetensors")
        del weights["nezha.embeddings.token_type_embeddings.weight"]
        save_file(weights, tmp_path / "base" / "model.safetensors", metadata={"format": "pt"})
        with caplog.at_level("WARNING"):
            extractor_from(tmp_path / "base")
    finally:
        hf_logging.disable_propagation()
    assert "missing (random) ['nezha.embeddings.token_type_embeddings.weight']" in caplog.text


def test_validation_split_never_silently_holds_out_what_it_cannot(caplog):
    from nezha_hf.summarization import validation_split

    assert validation_split(100, 0.1) == 10
    assert validation_split(20, 0.0) == 0
    with caplog.at_level("WARNING"):
        assert validation_split(4, 0.1) == 0
    assert "No validation" in caplog.text
    with pytest.raises(ValueError, match="leaves none to train on"):
        validation_split(2, 0.9)


@pytest.mark.slow
def test_the_summarisation_module_alone_loads_a_trained_and_an_exported_summariser(tokenizer, tmp_path):
    """The summariser's runtime has one home: `summarization.load_summarizer` loads the folder `train-summarizer`
    writes and its ONNX export (telling them apart by the folder), in a process that never imports `nezha_hf.export`,
    and the two write the same greedy summaries."""
    import subprocess
    import sys

    from nezha_hf import NezhaForUniLM
    from nezha_hf.export import export_summarizer
    from nezha_hf.summarization import Summarizer

    torch.manual_seed(0)
    config = tiny_config(vocab_size=VOCAB)
    generator = NezhaForUniLM(config)
    generator.generation_config.eos_token_id = tokenizer.sep_token_id
    generator.generation_config.pad_token_id = tokenizer.pad_token_id
    Summarizer(NezhaForSentenceExtraction(config), generator, tokenizer, num_beams=1).save_pretrained(
        tmp_path / "trained")
    export_summarizer(tmp_path / "trained", tmp_path / "exported")
    write_jsonl(tmp_path / "j.jsonl", [synthetic_judgment(random.Random(0), 0)])
    code = (
        "import sys\n"
        "from nezha_hf import NezhaForUniLM\n"
        "from nezha_hf.cail import read_judgments\n"
        "from nezha_hf.summarization import ExportedGenerator, Summarizer, load_summarizer\n"
        "judgments = read_judgments([sys.argv[3]])\n"
        "trained, exported = load_summarizer(sys.argv[1]), load_summarizer(sys.argv[2])\n"
        "assert isinstance(trained, Summarizer) and isinstance(trained.generator, NezhaForUniLM)\n"
        "assert isinstance(exported.generator, ExportedGenerator)\n"
        "assert trained.summarize(judgments, max_new_tokens=8) == exported.summarize(judgments, max_new_tokens=8)\n"
        "print('nezha_hf.export' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "trained"), str(tmp_path / "exported"),
                           str(tmp_path / "j.jsonl")], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "False"


def tiny_summarizer(tokenizer, seed=0):
    from nezha_hf import NezhaForUniLM
    from nezha_hf.summarization import Summarizer

    torch.manual_seed(seed)
    extractor = NezhaForSentenceExtraction(tiny_config(vocab_size=VOCAB)).eval()
    generator = NezhaForUniLM(tiny_config(vocab_size=VOCAB)).eval()
    generator.generation_config.eos_token_id = tokenizer.sep_token_id
    generator.generation_config.pad_token_id = tokenizer.pad_token_id
    return Summarizer(extractor, generator, tokenizer, num_beams=3)


def test_each_summary_is_generated_from_its_own_judgment(tokenizer, tmp_path):
    """Issue 54 item 4: a generator whose generation_config.json asks for two sequences per source returned two texts
    per judgment, zipped onto the judgments in order (judgment 2 got judgment 1's second sequence). Each summary is
    the one generated for its judgment alone, whatever the generation config says."""
    from nezha_hf.cail import Judgment

    summarizer = tiny_summarizer(tokenizer)
    judgments = [Judgment(id=f"j{i}", sentences=[text]) for i, text in
                 enumerate(["原告被告。", "法院判决了原告。", "被告不服上诉。", "本院认为事实清楚。"])]
    settings = {"max_new_tokens": 6, "min_new_tokens": 6, "batch_size": 4}
    alone = [summarizer.summarize([j], **settings)[0] for j in judgments]
    summarizer.generator.generation_config.update(num_beams=3, num_return_sequences=2)  # as a generation_config.json
    together = summarizer.summarize(judgments, **settings)
    assert [r["id"] for r in together] == [j.id for j in judgments]
    assert together == alone


def test_generate_text_gives_one_text_per_source_or_refuses(tokenizer):
    """`generate_text` ties each text to its source: a generation config's `num_return_sequences` does not change
    how many texts come back, and asking for several in the call is refused rather than zipped by position."""
    from nezha_hf import NezhaForUniLM
    from nezha_hf.unilm import generate_text

    torch.manual_seed(0)
    model = NezhaForUniLM(tiny_config(vocab_size=VOCAB)).eval()
    sources = ["原告被告", "法院判决了原告", "被告不服"]
    expected = [generate_text(model, tokenizer, [s], max_new_tokens=5, num_beams=2)[0] for s in sources]
    model.generation_config.update(num_beams=2, num_return_sequences=2)
    assert generate_text(model, tokenizer, sources, max_new_tokens=5, num_beams=2) == expected
    with pytest.raises(ValueError, match="num_return_sequences"):
        generate_text(model, tokenizer, sources, max_new_tokens=5, num_beams=2, num_return_sequences=2)


def recording_progress(monkeypatch):
    """`run_batches`' progress bar, recorded: the count after each update, and each stage text set."""
    from tqdm.auto import tqdm

    import nezha_hf.distributed

    counts, stages = [], []

    class Recorded(tqdm):
        def update(self, n=1):
            shown = super().update(n)
            counts.append(self.n)
            return shown

        def set_postfix_str(self, s="", refresh=True):
            stages.append(s)
            return super().set_postfix_str(s, refresh)

    monkeypatch.setattr(nezha_hf.distributed, "tqdm", Recorded)
    return counts, stages


@pytest.mark.parametrize("extract_only", [False, True], ids=["generated", "extracted"])
def test_summarize_progress_counts_each_judgment_and_says_the_stage(tokenizer, tmp_path, monkeypatch, extract_only):
    """Issue 57: `summarize` of a few long judgments showed one bar frozen for minutes: it moved a batch at a time
    (three judgments in one batch: 0 of 3, then 3 of 3), and said nothing of the stage in between. It counts each
    judgment and says which is being extracted and, while generating, each decoding step."""
    from test_reuse_and_damage import judgments_file, summarizer_folder

    from nezha_hf.summarization import summarize_files

    counts, stages = recording_progress(monkeypatch)
    model = summarizer_folder(tmp_path / "s", tokenizer)
    data = judgments_file(tmp_path / "j.jsonl", "j", 3)
    done = summarize_files(model, [data], tmp_path / "out.jsonl", batch_size=4, max_new_tokens=3,
                           extract_only=extract_only)
    assert len(done.results) == 3
    assert counts == [1, 2, 3], counts
    assert [s for s in stages if s.startswith("extracting")] == [f"extracting {n} of 3" for n in (1, 2, 3)], stages
    generating = [s for s in stages if s.startswith("generating")]
    assert (generating == []) if extract_only else ("generating 3 summaries: token 1 of at most 3" in generating)


# Where `str.splitlines` splits a line: each, in a summary, shifted every later line of a `.txt` output.
SPLITLINES_SEPARATORS = ["\n", "\r", "\r\n", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"]


def judgments_with_breaks(path):
    """A judgment per separator, whose one sentence (so its extract-only summary) holds it, then one without."""
    sentences = [f"原告{separator}胜诉。" for separator in SPLITLINES_SEPARATORS] + ["被告败诉。"]
    records = [{"id": f"j{i}", "text": [{"sentence": sentence, "label": 1}]} for i, sentence in enumerate(sentences)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")  # escaped: a record a line
    return path, sentences


@pytest.mark.parametrize("name", ["out.txt", "out.jsonl"])
def test_summaries_with_line_breaks_keep_one_line_each(tokenizer, tmp_path, caplog, name):
    """Issue 54's leftover: a summary holding a line break (any that `str.splitlines` splits at) was written as it is
    into a `.txt` output, shifting every later line onto another judgment, silently; in JSONL, U+0085, U+2028 and
    U+2029 were written raw (JSON allows them), so a reader splitting lines that way shifted too. Text: each break
    is a space, said once with the count; JSONL: escaped, the summaries exact."""
    from test_reuse_and_damage import summarizer_folder

    from nezha_hf.summarization import summarize_files

    data, sentences = judgments_with_breaks(tmp_path / "j.jsonl")
    ids = [f"j{i}" for i in range(len(sentences))]
    model = summarizer_folder(tmp_path / "s", tokenizer)
    summarize_files(model, [data], tmp_path / name, extract_only=True, show_progress=False)
    lines = (tmp_path / name).read_bytes().decode("utf-8").splitlines()
    if name.endswith(".txt"):
        assert lines[::3] == ids and set(lines[2::3]) == {""} and len(lines) == 3 * len(ids) - 1, lines
        assert lines[1::3] == ["原告 胜诉。"] * len(SPLITLINES_SEPARATORS) + ["被告败诉。"]
        assert caplog.text.count("line breaks") == 1
        assert f"{len(SPLITLINES_SEPARATORS)} of {len(ids)} summaries held line breaks" in caplog.text
    else:
        assert [json.loads(line) for line in lines] == [{"id": i, "extracted": [0], "summary": s}
                                                        for i, s in zip(ids, sentences, strict=True)]


def test_a_summaries_file_is_put_in_place_only_with_a_line_per_summary(tokenizer, tmp_path, monkeypatch):
    """The line count is checked before the output is renamed into place: a text whose summaries would shift its
    lines (as written before line breaks were replaced) is refused, nothing written."""
    from test_reuse_and_damage import summarizer_folder

    import nezha_hf.summarization
    from nezha_hf.summarization import summarize_files

    def unreplaced(results, text=False):
        return "\n\n".join(f"{r['id']}\n{r['summary']}" for r in results) + "\n"

    monkeypatch.setattr(nezha_hf.summarization, "summaries_text", unreplaced)
    data, _ = judgments_with_breaks(tmp_path / "j.jsonl")
    model = summarizer_folder(tmp_path / "s", tokenizer)
    with pytest.raises(RuntimeError, match="nothing written"):
        summarize_files(model, [data], tmp_path / "out.txt", extract_only=True, show_progress=False)
    assert not (tmp_path / "out.txt").exists()
