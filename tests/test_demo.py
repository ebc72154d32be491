"""`nezha-hf demo`: converts a real BERT, runs long inputs, and runs the summariser end to end."""

import pytest

from nezha_hf import cli


@pytest.mark.slow
def test_demo_converts_a_real_bert_and_runs_long_inputs(capsys, tmp_path):
    assert cli.main(["demo", "--tokens", "700", "--workdir", str(tmp_path), "--quick"]) == 0
    out = capsys.readouterr().out
    assert "embeddings.position_embeddings.weight" in out  # the one tensor a BERT loses
    assert "BERT at" in out and "fails" in out
    assert "NEZHA at" in out and (tmp_path / "minilm-nezha" / "conversion_report.json").exists()
    assert "load report: missing=none unexpected=none" in out
    assert "700 tokens" in out and "peak resident memory" in out
    difference = float(out.split("implementations: ")[1].split()[0])
    assert difference < 1e-4
    # Step 3: the summariser ran from the CLI and was scored beside lead-3 and the oracle.
    assert (tmp_path / "summaries.jsonl").exists() and "| oracle | char |" in out and "| predictions | word |" in out
