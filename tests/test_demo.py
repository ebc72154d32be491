"""`nezha-hf demo`: converts a real BERT, runs long inputs, and runs the summariser end to end."""

import re

import pytest

import nezha_hf_cli as cli


@pytest.mark.slow
def test_demo_converts_a_real_bert_and_runs_long_inputs(capsys, tmp_path):
    assert cli.main(["demo", "--tokens", "700", "--workdir", str(tmp_path), "--quick"]) == 0
    out = capsys.readouterr().out
    # The steps are numbered as the README numbers them.
    assert re.findall(r"^\[(\d)\]", out, flags=re.MULTILINE) == ["1", "2", "3"]
    assert "embeddings.position_embeddings.weight" in out  # the one tensor a BERT loses
    refusal = next(line for line in out.splitlines() if "BERT refuses it" in line)
    assert refusal.endswith("non-singleton dimension 1)")  # the whole message, not cut
    assert "NEZHA reads it whole" in out and (tmp_path / "minilm-nezha" / "conversion_report.json").exists()
    assert "every weight loaded, none left over" in out
    assert "700 tokens" in out and "peak resident memory" in out
    difference = float(out.split("logits differ by at most ")[1].split()[0])
    assert difference < 1e-4
    # Step 3: the summariser ran, its output labelled for what it is, beside the extraction and the reference.
    assert "A toy" in out and "extracted (sentences" in out and "reference summary:" in out
    assert (tmp_path / "summaries.jsonl").exists() and "| oracle | char |" in out and "| predictions | word |" in out
    # What the README's examples read, written where it says (they run offline from these).
    assert f"The demo wrote into {tmp_path}/" in out
    assert (tmp_path / "minilm-bert" / "config.json").is_file() and len(list((tmp_path / "judgments").glob("*.txt"))) == 3
    train, test = (tmp_path / "cail2020-train.jsonl"), (tmp_path / "cail2020-test.jsonl")
    assert len(train.read_text().splitlines()) == 2 and len(test.read_text().splitlines()) == 1
    assert " …" in out  # long texts are shown cut at a sentence end, and say so
    # A second run reuses the trained summariser and converts again into its own folder.
    assert cli.main(["demo", "--tokens", "600", "--workdir", str(tmp_path), "--quick"]) == 0
    assert "reusing the summariser" in capsys.readouterr().out


def test_shortened_texts_end_at_a_sentence_and_say_they_were_cut():
    from nezha_hf.demo import shortened

    assert shortened("短。") == "短。"
    text = "原告起诉要求被告还款。" * 10 + "被告未到庭"
    assert shortened(text, limit=50) == "原告起诉要求被告还款。" * 4 + " …"
    assert shortened("无标点" * 40, limit=50) == ("无标点" * 40)[:50] + " …"
