"""nezha_hf.cail: the reader, the sentence splitter, ROUGE / CAIL scores and the oracle."""

import json
import random

import pytest
from helpers import synthetic_judgment, write_jsonl

from nezha_hf.cail import (
    cail_score,
    oracle_labels,
    read_judgments,
    rouge_scores,
    split_sentences,
)


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
