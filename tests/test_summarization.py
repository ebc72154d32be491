"""The legal summariser on synthetic CAIL2020 data whose right sentences are known by construction."""

import json
import random
import subprocess
import sys

import pytest
import torch
from conftest import CHARACTERS, SPECIAL_TOKENS, tiny_config

from nezha_hf import NezhaForMaskedLM, NezhaForSentenceExtraction
from nezha_hf.cail import cail_score, oracle_labels, read_judgments, rouge_scores, split_sentences
from nezha_hf.summarization import ExtractionCollator, encode_document, sentence_probabilities, select_sentences

VOCAB = len(SPECIAL_TOKENS) + len(CHARACTERS)
MARKER = "判决"
FILLER = [c for c in CHARACTERS if c not in "判决。"]


def synthetic_judgment(rng, index, sentences=12, key=3, sentence_length=(6, 12)):
    """A judgment whose key sentences start with 判决; the summary is those sentences, in order."""
    key_positions = set(rng.sample(range(sentences), key))
    text = []
    for position in range(sentences):
        body = "".join(rng.choice(FILLER) for _ in range(rng.randint(*sentence_length)))
        text.append({"sentence": (MARKER + body if position in key_positions else body) + "。",
                     "label": int(position in key_positions)})
    summary = "".join(item["sentence"] for item in text if item["label"])
    return {"id": f"doc{index}", "summary": summary, "text": text}


def write_jsonl(path, records, extra_lines=()):
    lines = [json.dumps(r, ensure_ascii=False) for r in records] + list(extra_lines)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_sentence_splitter_on_legal_text():
    text = "原告诉称：被告欠款。被告辩称；已还清！法院认为？\n本院认为“合同有效。”判决如下"
    assert split_sentences(text) == ["原告诉称：被告欠款。", "被告辩称；", "已还清！", "法院认为？", "本院认为“合同有效。”",
                                     "判决如下"]


def test_metric_matches_a_hand_computed_example():
    # Characters: unigrams 3/4 shared; bigrams {原告} of 3; LCS 原告诉 = 3 of 4.
    scores = rouge_scores("原告胜诉", "原告败诉", unit="char")
    assert scores["rouge-1"] == pytest.approx(0.75, abs=1e-6)
    assert scores["rouge-2"] == pytest.approx(1 / 3, abs=1e-6)
    assert scores["rouge-l"] == pytest.approx(0.75, abs=1e-6)
    assert scores["cail"] == pytest.approx(0.2 * 0.75 + 0.4 / 3 + 0.4 * 0.75, abs=1e-6)
    assert cail_score({"rouge-1": 1, "rouge-2": 0, "rouge-l": 0}) == pytest.approx(0.2)
    assert rouge_scores("", "原告", unit="word")["cail"] == 0


def test_oracle_recovers_the_key_sentences():
    rng = random.Random(0)
    for index in range(5):
        record = synthetic_judgment(rng, index)
        sentences = [item["sentence"] for item in record["text"]]
        assert oracle_labels(sentences, record["summary"]) == [item["label"] for item in record["text"]]


def test_reader_reports_malformed_lines_and_goes_on(tmp_path):
    rng = random.Random(1)
    path = write_jsonl(tmp_path / "data.jsonl", [synthetic_judgment(rng, 0)],
                       extra_lines=["{not json", json.dumps({"id": "x", "text": [{"label": 1}]}),
                                    json.dumps({"id": "y", "text": "原告起诉。被告答辩。"})])
    problems = []
    judgments = read_judgments([path], problems)
    assert [j.id for j in judgments] == ["doc0", "y"]
    assert [(p.line, "data.jsonl" in p.path) for p in problems] == [(2, True), (3, True)]
    assert judgments[1].sentences == ["原告起诉。", "被告答辩。"] and judgments[1].labels is None


def test_extractor_learns_the_key_sentences(tokenizer):
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
    held_out = read_judgments([write_jsonl_tmp([synthetic_judgment(rng, 100 + i) for i in range(10)])])
    probabilities = sentence_probabilities(model, tokenizer, held_out, batch_size=4)
    correct = [select_sentences(p, j.sentences, threshold=0.5) == [i for i, k in enumerate(j.labels) if k]
               for p, j in zip(probabilities, held_out)]
    assert sum(correct) >= 9, correct


def write_jsonl_tmp(records):
    import tempfile
    from pathlib import Path

    return write_jsonl(Path(tempfile.mkdtemp()) / "held_out.jsonl", records)


def test_documents_over_10000_characters_are_read_whole(tokenizer):
    rng = random.Random(3)
    record = synthetic_judgment(rng, 0, sentences=900, key=20, sentence_length=(10, 14))
    judgment = read_judgments([write_jsonl_tmp([record])])[0]
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


@pytest.mark.slow
def test_cli_trains_summarizes_and_evaluates_end_to_end(tmp_path, tokenizer):
    rng = random.Random(4)
    data = write_jsonl(tmp_path / "train.jsonl", [synthetic_judgment(rng, i) for i in range(12)])
    base = tmp_path / "base"
    torch.manual_seed(0)
    NezhaForMaskedLM(tiny_config(vocab_size=VOCAB, max_relative_position=16)).save_pretrained(base)
    tokenizer.save_pretrained(base)

    def cli(*args):
        done = subprocess.run([sys.executable, "-m", "nezha_hf.cli", *map(str, args)], capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return done

    cli("train-summarizer", data, "--base", base, "--output", tmp_path / "model", "--extractor-steps", 30,
        "--generator-steps", 30, "--learning-rate", 3e-3, "--max-length", 256, "--copy")
    generator_config = json.loads((tmp_path / "model" / "generator" / "config.json").read_text())
    assert generator_config["unilm_copy_tags"] is True  # the SPACES copy head was trained and is used below
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    (inputs / "a.txt").write_text("原告起诉被告。判决被告还钱。", encoding="utf-8")
    (inputs / "b.txt").write_text("被告答辩。法院认为。", encoding="utf-8")
    more = write_jsonl(tmp_path / "more.jsonl", [synthetic_judgment(rng, 50)], extra_lines=["{oops"])
    done = cli("summarize", tmp_path / "model", inputs, more, "--output", tmp_path / "out.jsonl", "--max-new-tokens", 20)
    assert "more.jsonl:2" in done.stderr
    results = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [r["id"] for r in results] == ["a", "b", "doc50"] and all(isinstance(r["summary"], str) for r in results)
    extracted = cli("summarize", tmp_path / "model", more, "--extract-only")
    assert json.loads(extracted.stdout.splitlines()[0])["summary"]

    (tmp_path / "predictions.jsonl").write_text(
        json.dumps({"id": "doc50", "summary": results[2]["summary"]}, ensure_ascii=False) + "\n", encoding="utf-8")
    done = cli("evaluate", more, "--predictions", tmp_path / "predictions.jsonl", "--output", tmp_path / "scores.json")
    scores = json.loads((tmp_path / "scores.json").read_text())
    assert set(scores["systems"]) == {"lead-3", "oracle", "labelled", "predictions"}
    assert scores["systems"]["oracle"]["char"]["cail"] == pytest.approx(1.0, abs=1e-6)
    assert "| oracle | word |" in done.stdout
