"""nezha_hf.cail: the reader, the sentence splitter, ROUGE / CAIL scores and the oracle."""

import json
import random
import subprocess
import sys

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


def test_word_scores_and_whole_word_masking_keep_jieba_quiet():
    """jieba announces loading its dictionary on standard error; word-level ROUGE and the pretraining word ids (both
    through `documents.jieba_words`) print nothing, and segment as jieba does."""
    done = subprocess.run([sys.executable, "-c", "import jieba\n"
                           "from nezha_hf.cail import rouge_scores\n"
                           "from nezha_hf.pretraining import jieba_word_ids\n"
                           "text = '原告要求被告支付加班工资'\n"
                           "print(rouge_scores(text, text, 'word')['rouge-1'])\n"
                           "print(jieba_word_ids(text, [(i, i + 1) for i in range(len(text))]))\n"
                           "print([len(word) for word in jieba.cut(text)])"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "dictionary" not in done.stderr and "Loading model" not in done.stderr, done.stderr
    score, word_ids, lengths = done.stdout.splitlines()
    assert float(score) == pytest.approx(1.0)
    expected = [index for index, length in enumerate(json.loads(lengths)) for _ in range(length)]
    assert json.loads(word_ids) == expected


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


def test_rouge_l_is_the_rouge_packages_definition_without_its_recursion():
    from rouge import Rouge

    from nezha_hf.cail import rouge_l

    rng = random.Random(5)
    compared = 0
    for _ in range(300):
        vocabulary = [chr(0x4E00 + i) for i in range(rng.randint(2, 10))] + ["."]
        candidate = " ".join(rng.choice(vocabulary) for _ in range(rng.randint(1, 30)))
        reference = " ".join(rng.choice(vocabulary) for _ in range(rng.randint(1, 30)))
        try:
            expected = Rouge(metrics=["rouge-l"]).get_scores(candidate, reference)[0]["rouge-l"]["f"]
        except (ValueError, ZeroDivisionError):  # the package refuses texts with no sentence
            continue
        compared += 1
        assert rouge_l(candidate, reference) == pytest.approx(expected, abs=1e-12), (candidate, reference)
    assert compared > 250
    # 1,481 characters: the package's recursive backtrack fails here.
    long = "".join(rng.choice("原告被告法院判决") for _ in range(1481))
    with pytest.raises(RecursionError):
        Rouge(metrics=["rouge-l"]).get_scores(" ".join(long), " ".join(long[:300]))
    assert 0 < rouge_scores(long, long[:300])["rouge-l"] <= 1


def test_unequal_lengths_f_is_neither_recall_nor_precision():
    # Candidate 原告胜诉了 (5 characters) against 原告败诉 (4): unigrams 原 告 诉 shared: P = 3/5, R = 3/4,
    # F = 2PR / (P + R) = 2/3. Bigrams: only 原告: P = 1/4, R = 1/3, F = 2/7. LCS 原告诉: P = 3/5, R = 3/4, F = 2/3.
    scores = rouge_scores("原告胜诉了", "原告败诉", unit="char")
    assert scores["rouge-1"] == pytest.approx(2 / 3, abs=1e-6)
    assert scores["rouge-2"] == pytest.approx(2 / 7, abs=1e-6)
    assert scores["rouge-l"] == pytest.approx(2 / 3, abs=1e-6)
    assert scores["cail"] == pytest.approx(0.2 * 2 / 3 + 0.4 * 2 / 7 + 0.4 * 2 / 3, abs=1e-6)


def test_a_file_with_a_line_that_is_not_utf8_is_refused_whole(tmp_path):
    """Such a line was skipped and the rest read as if whole (issue 46): the file's encoding is one decision."""
    rng = random.Random(6)
    good = [json.dumps(synthetic_judgment(rng, i), ensure_ascii=False).encode() for i in range(2)]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "bad.jsonl").write_bytes(good[0] + b"\n" + b'{"id": "x", "text": "\xff\xfe"}\n' + good[1] + b"\n")
    (tmp_path / "data" / "good.jsonl").write_bytes(good[1] + b"\n")
    with pytest.raises(ValueError, match="bad.jsonl: not UTF-8 .*line 2"):
        read_judgments([tmp_path / "data" / "bad.jsonl"])
    problems = []
    assert [j.id for j in read_judgments([tmp_path / "data"], problems)] == ["doc1"]
    assert [(p.line, "UTF-8" in p.message, p.path.endswith("bad.jsonl")) for p in problems] == [(None, True, True)]


def test_scoring_without_any_reference_is_a_clear_error():
    from nezha_hf.cail import Judgment
    from nezha_hf.summarization import evaluate_summaries

    with pytest.raises(ValueError, match="reference summary"):
        evaluate_summaries([Judgment("a", ["原告起诉。"]), Judgment("b", ["被告答辩。"])])


def package_oracle(sentences, summary):
    """The greedy oracle scored by the `rouge` package on each candidate selection's whole text (the definition)."""
    from rouge import Rouge

    def score(selection):
        text = " ".join(c for c in "".join(sentences[i] for i in selection) if not c.isspace())
        reference = " ".join(c for c in summary if not c.isspace())
        if not text.replace(".", "").strip() or not reference.replace(".", "").strip():
            return 0.0
        result = Rouge(metrics=["rouge-1", "rouge-2"]).get_scores(text, reference)[0]
        return 0.2 * result["rouge-1"]["f"] + 0.4 * result["rouge-2"]["f"]

    chosen, best = [], 0.0
    while True:
        candidates = [(score(sorted([*chosen, i])), i) for i in range(len(sentences)) if i not in chosen]
        if not candidates or max(candidates)[0] <= best:
            return [int(i in chosen) for i in range(len(sentences))]
        best, index = max(candidates)
        chosen.append(index)


@pytest.mark.parametrize("seed", range(6))
def test_oracle_equals_the_package_scored_greedy_search(seed):
    """The oracle scores selections from per-sentence n-grams (fast); it must pick what the package would."""
    rng = random.Random(seed)
    alphabet = "原告被告法院判决本院认为支付借款利息" + (". " if seed % 2 else "")
    sentences = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12))) + "。" for _ in range(25)]
    summary = "".join(rng.sample(sentences, 3)) + "".join(rng.choice(alphabet) for _ in range(6))
    assert oracle_labels(sentences, summary) == package_oracle(sentences, summary)
