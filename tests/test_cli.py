"""The console script: help, and the summariser commands end to end."""

import json
import random
import subprocess
import sys

import pytest
import torch
from helpers import VOCAB, synthetic_judgment, tiny_config, write_jsonl

from nezha_hf import NezhaForMaskedLM


def test_console_script_help():
    result = subprocess.run([sys.executable, "-m", "nezha_hf.cli", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "demo" in result.stdout and "convert" in result.stdout


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
