"""The console script: help, and the summariser commands end to end."""

import argparse
import json
import random
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch
import transformers
from helpers import VOCAB, synthetic_judgment, tiny_config, write_jsonl

import nezha_hf
import nezha_hf_cli
from nezha_hf import NezhaForMaskedLM


def test_console_script_help_and_version():
    result = subprocess.run(["nezha-hf", "--help"], capture_output=True, text=True,
                            env={**__import__("os").environ, "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"})
    assert result.returncode == 0 and "demo" in result.stdout and "convert" in result.stdout
    version = subprocess.run([sys.executable, "-m", "nezha_hf", "--version"], capture_output=True, text=True)
    assert version.stdout.strip() == f"nezha-hf {nezha_hf.__version__}" == f"nezha-hf {metadata.version('nezha_hf')}"


def test_help_loads_neither_pytorch_nor_transformers():
    """`--help` answers at once: the parser is built without the heavy libraries (a command imports them)."""
    probe = ("import sys, contextlib, io, nezha_hf_cli\n"
             "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
             "    nezha_hf_cli.main(['pretrain', '--help'])\n"
             "print(sorted(m for m in ('torch', 'transformers', 'nezha_hf') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.stdout.strip() == "[]", done.stderr


def subcommands(parser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield name, child
                yield from subcommands(child)


def test_every_option_has_help_and_every_command_an_example():
    from nezha_hf.documents import TXT_SPLITS

    parser = nezha_hf_cli.build_parser()
    for name, command in subcommands(parser):
        assert command.epilog and command.epilog.startswith("example:"), name
        for action in command._actions:
            assert action.help, f"{name} {action.option_strings or action.dest}"
    pretrain = dict(subcommands(parser))["pretrain"]
    txt_split = next(a for a in pretrain._actions if "--txt-split" in a.option_strings)
    assert all(split in txt_split.help for split in TXT_SPLITS)  # the help names every value the reader accepts
    assert "(default: 1024)" in pretrain.format_help()


@pytest.mark.slow
def test_cli_trains_summarizes_and_evaluates_end_to_end(tmp_path, tokenizer):
    rng = random.Random(4)
    data = write_jsonl(tmp_path / "train.jsonl", [synthetic_judgment(rng, i) for i in range(12)])
    base = tmp_path / "base"
    torch.manual_seed(0)
    NezhaForMaskedLM(tiny_config(vocab_size=VOCAB, max_relative_position=16)).save_pretrained(base)
    tokenizer.save_pretrained(base)

    def cli(*args):
        done = subprocess.run([sys.executable, "-m", "nezha_hf", *map(str, args)], capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return done

    cli("train-summarizer", data, "--base", base, "--output", tmp_path / "model", "--extractor-steps", 30,
        "--generator-steps", 30, "--learning-rate", 3e-3, "--max-length", 256, "--copy")
    generator_config = json.loads((tmp_path / "model" / "generator" / "config.json").read_text())
    assert generator_config["unilm_copy_tags"] is True  # the SPACES copy head was trained and is used below
    # A rerun into the finished folder is refused (nothing is lost); with --overwrite it resumes from the kept
    # checkpoints (no step is trained again) and replaces the folder whole.
    trained = (tmp_path / "model" / "extractor" / "model.safetensors").read_bytes()
    refused = subprocess.run([sys.executable, "-m", "nezha_hf", "train-summarizer", str(data), "--base", str(base),
                              "--output", str(tmp_path / "model")], capture_output=True, text=True, timeout=600)
    assert refused.returncode == 2 and "--overwrite" in refused.stderr
    assert (tmp_path / "model" / "extractor" / "model.safetensors").read_bytes() == trained
    cli("train-summarizer", data, "--base", base, "--output", tmp_path / "model", "--extractor-steps", 30,
        "--generator-steps", 30, "--learning-rate", 3e-3, "--max-length", 256, "--copy", "--overwrite")
    assert (tmp_path / "model" / "extractor" / "model.safetensors").read_bytes() == trained
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    (inputs / "a.txt").write_text("原告起诉被告。判决被告还钱。", encoding="utf-8")
    (inputs / "b.txt").write_text("被告答辩。法院认为。", encoding="utf-8")
    # and a judgment with nothing in it: reported, the others still summarised
    blank = json.dumps({"id": "blank", "text": [{"sentence": "\u3000", "label": 0}]})
    more = write_jsonl(tmp_path / "more.jsonl", [synthetic_judgment(rng, 50)], extra_lines=["{oops", blank])
    done = cli("summarize", tmp_path / "model", inputs, more, "--output", tmp_path / "out.jsonl", "--max-new-tokens", 20)
    assert "more.jsonl:2" in done.stderr and "more.jsonl:3" in done.stderr and "blank" in done.stderr
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


# --- bad input: one line, exit 2, before any work (issue: nothing lost, nothing silent) -----------------------


def one_line_failure(done, *needles):
    assert done.returncode == 2, (done.returncode, done.stdout[-500:], done.stderr[-2000:])
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_summarize_checks_its_arguments_and_output_before_any_work(tmp_path, run_cli):
    fake = tmp_path / "summarizer"  # enough to pass the first check; loading it would fail differently
    fake.mkdir()
    (fake / "summarizer.json").write_text("{}")
    data = write_jsonl(tmp_path / "data.jsonl", [synthetic_judgment(random.Random(0), 0)])
    one_line_failure(run_cli("summarize", fake, data, "--batch-size", "-1"), "--batch-size", "at least 1")
    one_line_failure(run_cli("summarize", fake, data, "--num-beams", "0"), "--num-beams")
    (tmp_path / "results").mkdir()
    one_line_failure(run_cli("summarize", fake, data, "--output", tmp_path / "results"), "is a folder")
    one_line_failure(run_cli("summarize", fake, data, "--output", tmp_path / "missing" / "out.jsonl"), "does not exist")
    one_line_failure(run_cli("summarize", tmp_path / "nowhere", data), "No such folder")
    (tmp_path / "kept.jsonl").write_text("old results\n")
    one_line_failure(run_cli("summarize", fake, data, "--output", tmp_path / "kept.jsonl"), "--overwrite")
    assert (tmp_path / "kept.jsonl").read_text() == "old results\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.jsonl", "kept.jsonl", "results", "summarizer"]


def test_debug_shows_the_traceback(tmp_path, run_cli):
    """Before the command as after it (before, it was reset by the command's own parser)."""
    for arguments in (["summarize", tmp_path / "nowhere", "x.jsonl", "--debug"],
                      ["--debug", "summarize", tmp_path / "nowhere", "x.jsonl"]):
        with pytest.raises(FileNotFoundError, match="No such folder"):
            run_cli(*arguments)
    done = subprocess.run([sys.executable, "-m", "nezha_hf", "summarize", str(tmp_path / "nowhere"), "x.jsonl",
                           "--debug"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "Traceback" in done.stderr and "FileNotFoundError" in done.stderr


def test_evaluate_long_predictions_long_leads_bad_lines_and_no_references(tmp_path, run_cli):
    rng = random.Random(1)
    records = [synthetic_judgment(rng, i, sentences=60) for i in range(2)]
    data = write_jsonl(tmp_path / "data.jsonl", records)
    long_prediction = "".join(item["sentence"] for item in records[0]["text"])[:1481]
    predictions = tmp_path / "predictions.jsonl"
    predictions.write_bytes(
        json.dumps({"id": "doc0", "summary": long_prediction}, ensure_ascii=False).encode() + b"\n"
        + json.dumps({"id": "doc1", "summary": "判决"}, ensure_ascii=False).encode() + b"\n")
    done = run_cli("evaluate", data, "--predictions", predictions, "--lead", "40", "--output", tmp_path / "scores.json")
    assert done.returncode == 0, done.stderr[-2000:]  # the rouge package's recursion failed on both
    scores = json.loads((tmp_path / "scores.json").read_text())
    assert set(scores["systems"]) == {"lead-40", "oracle", "labelled", "predictions"}
    # A line that is not UTF-8 refuses the whole file (it was skipped, and the rest scored as if whole: issue 46).
    predictions.write_bytes(predictions.read_bytes() + b'{"id": "doc1", "summary": "\xff"}\n')
    one_line_failure(run_cli("evaluate", data, "--predictions", predictions), "predictions.jsonl", "not UTF-8", "line 3")
    no_summaries = write_jsonl(tmp_path / "plain.jsonl", [{"id": "a", "text": "原告起诉。被告答辩。"}])
    one_line_failure(run_cli("evaluate", no_summaries), "reference summary")


# --- what a new user meets first (issue 37) ---------------------------------------------------------------------


def test_bare_command_prints_usage_and_fails():
    done = subprocess.run([sys.executable, "-m", "nezha_hf"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.startswith("usage: nezha-hf") and "train-summarizer" in done.stderr


def test_a_hub_id_is_named_as_not_fetched(tmp_path, run_cli, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = one_line_failure(run_cli("convert", "bert", "bert-base-chinese", "out"), "No such folder")
    assert "fetches nothing from the model hub" in line and "hf download bert-base-chinese" in line
    line = one_line_failure(run_cli("convert", "bert", tmp_path / "missing" / "bert", "out"), "No such folder")
    assert "model hub" not in line  # an absolute path is no hub id
    assert not (tmp_path / "out").exists()


def test_convert_scripts_name_themselves_in_their_usage():
    root = Path(__file__).resolve().parents[1]
    for script in sorted((root / "convert").glob("convert_*.py")):
        done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(f"usage: python {script}"), done.stdout[:200]


def test_accelerate_config_prints_an_installed_config(run_cli):
    import yaml

    for name in nezha_hf_cli.LAUNCH_CONFIGS:
        done = run_cli("accelerate-config", name)
        path = Path(done.stdout.strip())
        assert done.returncode == 0 and path.is_file() and path.parent.name == "launch_configs"
        assert yaml.safe_load(path.read_text())["distributed_type"]
    one_line_failure(run_cli("accelerate-config", "three-machines"), "invalid choice")


def test_a_missing_extra_is_one_line_naming_the_install(tmp_path, run_cli, monkeypatch):
    """As on an install without `[onnx]`: the export says which extra to install, before it writes anything."""
    import importlib.util

    from nezha_hf import extras

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(extras.importlib.util, "find_spec",
                        lambda name, *rest: None if name == "onnxscript" else real_find_spec(name, *rest))
    model = tmp_path / "model"
    NezhaForMaskedLM(tiny_config(vocab_size=VOCAB)).save_pretrained(model)
    one_line_failure(run_cli("export", "onnx", model, tmp_path / "model.onnx"), "onnxscript",
                     'pip install "nezha_hf[onnx]"')
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_an_interrupted_writer_failing_again_at_exit_stays_one_line():
    """As when Ctrl-C lands mid-save in PyTorch's distributed checkpoint: its writer's finalizer fails again as the
    interpreter exits ("Exception ignored in ..."), after the one line that already said the command was stopped."""
    probe = ("import sys, nezha_hf_cli\n"
             "class Writer:\n"
             "    def __del__(self):\n"
             "        raise ValueError('flush of closed file')\n"
             "def command(args):\n"
             "    global writer\n"
             "    writer = Writer()\n"
             "    raise KeyboardInterrupt\n"
             "nezha_hf_cli.COMMANDS['evaluate'] = command\n"
             "code = nezha_hf_cli.main(['evaluate', 'x.jsonl'])\n"
             "del writer\n"
             "sys.exit(code)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 130 and done.stderr.strip() == (
        "nezha-hf evaluate: interrupted; outputs not yet in place were removed"), done.stderr


@pytest.mark.parametrize("command", ["convert", "pretrain", "export", "train-summarizer"])
def test_a_folder_output_whose_parent_does_not_exist_is_refused_in_one_line(tmp_path, run_cli, command):
    """A mistyped `--output /mnt/bakcup/x` was created, parents and all; now the parent must exist, as for files."""
    from helpers import make_tokenizer
    from test_nothing_lost import one_line_failure

    model = tmp_path / "model"
    NezhaForMaskedLM(tiny_config(vocab_size=VOCAB)).save_pretrained(model, model_card=False)
    make_tokenizer(model)
    summarizer = tmp_path / "summarizer"  # enough for the checks that come before loading one
    summarizer.mkdir()
    (summarizer / "summarizer.json").write_text("{}")
    data = write_jsonl(tmp_path / "data.jsonl", [synthetic_judgment(random.Random(0), i) for i in range(4)])
    (tmp_path / "corpus.txt").write_text("原告诉称。被告辩称。\n\n本院认为。\n", encoding="utf-8")
    output = tmp_path / "bakcup" / "deeper" / "out"
    args = {"convert": ["convert", "nezha", model, output],
            "pretrain": ["pretrain", model, tmp_path / "corpus.txt", "--output", output],
            "export": ["export", "onnx", summarizer, output],
            "train-summarizer": ["train-summarizer", data, "--base", model, "--output", output]}[command]
    one_line_failure(run_cli(*args), "bakcup", "does not exist")
    assert not (tmp_path / "bakcup").exists()


def _bert_with(folder, weights):
    """A BERT folder (config, tokenizer) whose `pytorch_model.bin` is `weights(state)` written by `torch.save`."""
    from helpers import make_tokenizer, small_bert

    bert = small_bert(transformers.BertForMaskedLM)
    folder.mkdir()
    bert.config.save_pretrained(folder)
    make_tokenizer(folder)
    state, options = weights(dict(bert.state_dict()))
    torch.save(state, folder / "pytorch_model.bin", **options)
    return folder


MALFORMED_WEIGHTS = {
    "a key that is no name": lambda state: ({**state, 7: torch.zeros(2)}, {}),
    "float8 in the legacy format": lambda state: ({**state, "x": torch.zeros(2, dtype=torch.float8_e4m3fn)},
                                                  {"_use_new_zipfile_serialization": False}),
    "an index naming a number": None,
}


@pytest.mark.parametrize("case", MALFORMED_WEIGHTS)
def test_a_malformed_converter_input_is_one_line_naming_the_file(tmp_path, run_cli, case):
    """They ended in `'<' not supported between instances of 'str' and 'int'` or an error of torch's naming no file."""
    from test_nothing_lost import one_line_failure

    if case == "an index naming a number":
        folder = _bert_with(tmp_path / "bert", lambda state: (state, {}))
        (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {"a": "pytorch_model.bin",
                                                                                        "b": 3}}))
        named = "pytorch_model.bin.index.json"
    else:
        folder = _bert_with(tmp_path / "bert", MALFORMED_WEIGHTS[case])
        named = "pytorch_model.bin"
    line = one_line_failure(run_cli("convert", "bert", folder, tmp_path / "out"), named)
    assert "not supported between" not in line and not (tmp_path / "out").exists(), line
