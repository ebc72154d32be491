"""Nothing lost, round three: what is reused (a journal, a checkpoint) is the same work; outputs others can read;
damage is met with one line that names the file and a way out; inputs far beyond any judgment are refused.

Each test names the finding it reproduces. The replays kill real processes (SIGKILL mid-run) and rerun them."""

import json
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import time

import pytest
import torch
from helpers import VOCAB, snapshot, synthetic_judgment, tiny_config, write_jsonl
from safetensors.torch import load_file
from test_nothing_lost import CLI, PRETRAIN, base_model, corpus, one_line_failure, pretrain

from nezha_hf import NezhaForSentenceExtraction, NezhaForUniLM
from nezha_hf.checkpoints import RunRecord, checkpoint_problem, fingerprint, last_complete_checkpoint, resumed_settings
from nezha_hf.summarization import Summarizer

SUMMARIZE = ["--batch-size", "2", "--max-new-tokens", "40"]


def summarizer_folder(directory, tokenizer):
    torch.manual_seed(0)
    config = tiny_config(vocab_size=VOCAB)
    Summarizer(NezhaForSentenceExtraction(config), NezhaForUniLM(config), tokenizer).save_pretrained(directory)
    return directory


def judgments_file(path, prefix, count, seed=0):
    rng = random.Random(seed)
    return write_jsonl(path, [{**synthetic_judgment(rng, i), "id": f"{prefix}{i}"} for i in range(count)])


def summarize(model, inputs, output, *extra, timeout=600):
    done = subprocess.run([*CLI, "summarize", str(model), *map(str, inputs), "--output", str(output), *SUMMARIZE,
                           *extra], capture_output=True, text=True, timeout=timeout)
    return done


def killed_summarize(model, inputs, output, batches=1):
    """Start `summarize`, SIGKILL it once `batches` batches are in its journal; the journal is left as a kill
    leaves it."""
    journal = output.with_name(f".{output.name}.progress")
    process = subprocess.Popen([*CLI, "summarize", str(model), *map(str, inputs), "--output", str(output), *SUMMARIZE],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while sum(len(p.read_bytes().splitlines()) for p in journal.glob("done-*.jsonl")) < 2 * batches:
        assert process.poll() is None and time.monotonic() < deadline, "the run ended before it could be killed"
        time.sleep(0.01)
    process.kill()
    process.wait()
    assert not output.exists() and journal.is_dir()
    return journal


def ids(path):
    return [json.loads(line)["id"] for line in path.read_text(encoding="utf-8").splitlines()]


# --- a journal is reused only for the same work -------------------------------------------------------------


@pytest.mark.slow
def test_a_rerun_with_the_inputs_in_another_order_does_not_mix_their_results(tmp_path, tokenizer):
    """Killed `summarize a b`, rerun as `summarize b a`: the journal was reused by position, the output held a's
    judgments twice and b's not at all, and it said "wrote 8 summaries". (Round four: the journal of the other order
    is refused, not discarded; --no-resume starts over.)"""
    model = summarizer_folder(tmp_path / "s", tokenizer)
    a, b = judgments_file(tmp_path / "a.jsonl", "a", 40), judgments_file(tmp_path / "b.jsonl", "b", 40, seed=1)
    output = tmp_path / "o.jsonl"
    journal = killed_summarize(model, [a, b], output)
    (tmp_path / ".o.jsonl.lock").unlink(missing_ok=True)  # the killed run's; the next run removes it
    before = snapshot(journal)
    one_line_failure(summarize(model, [b, a], output), str(journal), "another order", "--no-resume")
    assert snapshot(journal) == before and not output.exists()
    done = summarize(model, [b, a], output, "--no-resume")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "already done" not in done.stderr
    reference = summarize(model, [b, a], tmp_path / "reference.jsonl")
    assert ids(output) == [f"b{i}" for i in range(40)] + [f"a{i}" for i in range(40)]
    assert output.read_bytes() == (tmp_path / "reference.jsonl").read_bytes()
    assert reference.returncode == 0


@pytest.mark.slow
def test_a_changed_generation_config_is_not_the_same_work(tmp_path, tokenizer):
    """The run record fingerprinted the weights and config.json only: after `generator/generation_config.json`
    changed, the journal's summaries (of the old settings) came back in the output. (Round four: refused, not
    discarded.)"""
    model = summarizer_folder(tmp_path / "s", tokenizer)
    data = judgments_file(tmp_path / "d.jsonl", "d", 80)
    output = tmp_path / "o.jsonl"
    journal = killed_summarize(model, [data], output)
    settings_file = model / "generator" / "generation_config.json"
    settings = json.loads(settings_file.read_text())
    settings_file.write_text(json.dumps({**settings, "repetition_penalty": 5.0}))
    # Changed on purpose: the summariser's manifest would refuse the changed file (tests/test_fault_matrix.py), so it
    # goes, as its message says to do then.
    (model / "nezha_manifest.json").unlink()
    before = snapshot(journal)
    one_line_failure(summarize(model, [data], output), str(journal), "base model differs", "--no-resume")
    assert snapshot(journal) == before
    done = summarize(model, [data], output, "--no-resume")
    assert done.returncode == 0, done.stderr[-2000:]
    summarize(model, [data], tmp_path / "reference.jsonl")
    assert output.read_bytes() == (tmp_path / "reference.jsonl").read_bytes()


@pytest.mark.slow
def test_a_rerun_with_one_setting_changed_keeps_the_journal(tmp_path, tokenizer):
    """Round four: a rerun with one setting changed deleted the earlier run's journal of finished batches, with a
    warning only. It is now refused with one line naming the setting, and the journal is left byte for byte."""
    model = summarizer_folder(tmp_path / "s", tokenizer)
    data = judgments_file(tmp_path / "d.jsonl", "d", 80)
    output = tmp_path / "o.jsonl"
    journal = killed_summarize(model, [data], output)
    (tmp_path / ".o.jsonl.lock").unlink(missing_ok=True)
    before = snapshot(journal)
    one_line_failure(summarize(model, [data], output, "--max-new-tokens", "30"), str(journal),
                     "max_new_tokens 40 then, 30 now", "--no-resume")
    assert snapshot(journal) == before and not output.exists()
    done = summarize(model, [data], output)  # as the killed run was: goes on from its batches
    assert done.returncode == 0 and "already done" in done.stderr, done.stderr[-2000:]


@pytest.mark.slow
def test_a_damaged_journal_line_is_named_with_the_way_out(tmp_path, tokenizer):
    """A damaged journal was reported as "Unterminated string ...", "'index'" or a codec error."""
    model = summarizer_folder(tmp_path / "s", tokenizer)
    data = judgments_file(tmp_path / "d.jsonl", "d", 80)
    output = tmp_path / "o.jsonl"
    journal = killed_summarize(model, [data], output, batches=2)
    part = journal / "done-0.jsonl"
    lines = part.read_bytes().splitlines(keepends=True)
    part.write_bytes(lines[0] + b'{"index": 1, "resu\n' + b"".join(lines[2:]))
    (tmp_path / ".o.jsonl.lock").unlink(missing_ok=True)  # the killed run's; the next run removes it
    before = snapshot(tmp_path)
    line = one_line_failure(summarize(model, [data], output), f"{part}", "line 2", f"delete {journal}")
    assert snapshot(tmp_path) == before, line
    shutil.rmtree(journal)
    assert summarize(model, [data], output).returncode == 0


def test_a_journal_that_is_a_link_or_holds_other_files_is_refused_untouched(tmp_path, tokenizer, run_cli):
    """A symlinked journal failed with "Cannot call rmtree on a symbolic link" after the output was written; a
    `.NAME.progress/` folder holding files the tool did not write was deleted."""
    model = summarizer_folder(tmp_path / "s", tokenizer)
    data = judgments_file(tmp_path / "d.jsonl", "d", 2)
    output = tmp_path / "o.jsonl"
    journal = tmp_path / ".o.jsonl.progress"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "record.json").write_text("{}")
    journal.symlink_to(elsewhere)
    before = snapshot(tmp_path)
    one_line_failure(run_cli("summarize", model, data, "--output", output, *SUMMARIZE), str(journal), "link")
    assert snapshot(tmp_path) == before and not output.exists()
    journal.unlink()
    journal.mkdir()
    (journal / "notes.txt").write_text("mine")
    one_line_failure(run_cli("summarize", model, data, "--output", output, *SUMMARIZE), str(journal), "notes.txt")
    assert (journal / "notes.txt").read_text() == "mine" and not output.exists()


def test_a_journal_cut_in_its_record_is_refused_until_no_resume(tmp_path, tokenizer, run_cli):
    """Round three started over, deleting such a journal; round four: results whose record cannot be read may be any
    run's, so they are refused (one line, nothing touched) until --no-resume says to start over."""
    model = summarizer_folder(tmp_path / "s", tokenizer)
    data = judgments_file(tmp_path / "d.jsonl", "d", 2)
    output = tmp_path / "o.jsonl"
    journal = tmp_path / ".o.jsonl.progress"
    journal.mkdir()
    (journal / "record.json").write_bytes(b'{"command": "summ')
    (journal / "done-0.jsonl").write_bytes(b"\xff\xfe not the results of this run\n")
    before = snapshot(journal)
    one_line_failure(run_cli("summarize", model, data, "--output", output, *SUMMARIZE), str(journal),
                     "unreadable", "--no-resume")
    assert snapshot(journal) == before and not output.exists()
    done = run_cli("summarize", model, data, "--output", output, *SUMMARIZE, "--no-resume")
    assert done.returncode == 0, done.stderr
    assert ids(output) == ["d0", "d1"] and not journal.exists()


def test_a_journal_without_results_is_reused_whatever_its_record(tmp_path, tokenizer, run_cli):
    """Nothing to lose: a journal a kill left before its first batch (a record, no results) does not stop a rerun
    with other settings."""
    model = summarizer_folder(tmp_path / "s", tokenizer)
    data = judgments_file(tmp_path / "d.jsonl", "d", 2)
    output = tmp_path / "o.jsonl"
    journal = tmp_path / ".o.jsonl.progress"
    journal.mkdir()
    (journal / "record.json").write_text('{"command": "summarize"}')
    (journal / "done-0.jsonl").write_bytes(b"")
    done = run_cli("summarize", model, data, "--output", output, *SUMMARIZE)
    assert done.returncode == 0, done.stderr
    assert ids(output) == ["d0", "d1"] and not journal.exists()


# --- checkpoints: every input that decides the result, in order, and whole -------------------------------------


def test_the_fingerprint_covers_every_file_of_a_model_folder_and_the_order_of_inputs(tmp_path):
    """Only `*.safetensors`, `*.bin` and `config.json` counted, and paths were sorted."""
    model = tmp_path / "model"
    (model / "generator").mkdir(parents=True)
    for name in ("model.safetensors", "tokenizer.json", "generator/generation_config.json"):
        (model / name).write_text(name)
    first = fingerprint([model])
    for name in ("tokenizer.json", "generator/generation_config.json"):
        changed = (model / name).read_text()
        (model / name).write_text(changed + " changed")
        assert fingerprint([model]) != first, name
        (model / name).write_text(changed)
    (model / ".lock").write_text("held")  # a lock beside the files is not part of the model
    assert fingerprint([model]) == first
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("one")
    b.write_text("two")
    assert fingerprint([a, b]) != fingerprint([b, a])
    one, other = (RunRecord.create("pretrain", model, files, {}) for files in ([a, b], [b, a]))
    assert "another order" in one.difference(other)


@pytest.mark.slow
def test_pretrain_does_not_resume_with_its_corpus_in_another_order(tmp_path, tokenizer):
    """Resumed with its corpus files in another order, pretrain went on (weights 1.2e-4 off both uninterrupted
    runs)."""
    base = base_model(tmp_path / "base", tokenizer)
    first, second = corpus(tmp_path / "one"), corpus(tmp_path / "two")
    (second / next(second.iterdir()).name).write_text("另一个法院的判决。" * 40, encoding="utf-8")
    output = tmp_path / "out"
    done = pretrain(base, first, second, "--output", output, "--max-steps", "4", *PRETRAIN)
    assert done.returncode == 0, done.stderr[-2000:]
    shutil.rmtree(output)  # as if killed before writing the result
    before = snapshot(tmp_path)
    one_line_failure(pretrain(base, second, first, "--output", output, "--max-steps", "8", *PRETRAIN),
                     "another order", "--no-resume")
    assert snapshot(tmp_path) == before


def test_the_global_batch_not_the_batch_per_process_decides_a_resume():
    """Resumed on 2 processes with the same --batch-size, pretrain doubled the global batch and skipped examples
    it never trained on: the record kept the batch per process."""
    def record(batch, processes, **more):
        return RunRecord("pretrain", "base", "x", [], "y", resumed_settings(
            {"per_device_train_batch_size": batch, **more}, processes))

    assert "global_batch" in record(4, 2).difference(record(4, 1))
    assert record(4, 2).difference(record(8, 1)) is None
    assert record(4, 2).difference(record(2, 2, gradient_accumulation_steps=2)) is None
    assert "bf16" in record(8, 1, bf16=True).difference(record(8, 1))


@pytest.mark.parametrize("damage", ["no optimizer", "optimizer piece cut", "optimizer metadata missing",
                                    "no scheduler"])
@pytest.mark.slow
def test_an_incomplete_checkpoint_falls_back_to_the_newest_whole_one(damage, tmp_path, tokenizer):
    """A checkpoint without (or with cut) optimizer state or scheduler was resumed from with a fresh optimizer and
    schedule without a word, or failed on every rerun with torch's traceback in one line."""
    base, data = base_model(tmp_path / "base", tokenizer), corpus(tmp_path / "corpus")
    done = pretrain(base, data, "--output", tmp_path / "uninterrupted", "--max-steps", "8", *PRETRAIN)
    assert done.returncode == 0, done.stderr[-2000:]
    shutil.copytree(tmp_path / "uninterrupted.checkpoints", tmp_path / "out.checkpoints")
    latest = tmp_path / "out.checkpoints" / "checkpoint-8"
    optimizer = latest / "optimizer"
    assert checkpoint_problem(latest) is None and optimizer.is_dir()
    if damage == "no optimizer":
        shutil.rmtree(optimizer)
    elif damage == "optimizer piece cut":
        piece = max((p for p in optimizer.iterdir() if p.name.endswith(".distcp")), key=lambda p: p.stat().st_size)
        piece.write_bytes(piece.read_bytes()[: piece.stat().st_size // 2])
    elif damage == "optimizer metadata missing":
        (optimizer / ".metadata").unlink()
    else:
        (latest / "scheduler.pt").unlink()
    assert checkpoint_problem(latest) is not None
    assert last_complete_checkpoint(tmp_path / "out.checkpoints").name == "checkpoint-4"
    done = pretrain(base, data, "--output", tmp_path / "out", "--max-steps", "8", *PRETRAIN)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sum("Skipping the checkpoint" in line for line in done.stderr.splitlines()) == 1
    assert "checkpoint-4" in done.stderr.split("Resuming from")[1].splitlines()[0]
    got, expected = load_file(tmp_path / "out" / "model.safetensors"), load_file(
        tmp_path / "uninterrupted" / "model.safetensors")
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-5, rtol=0)


# --- a tokenizer that is not the model's own -----------------------------------------------------------------


def small_tokenizer(directory):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\n", encoding="utf-8")
    from transformers import BertTokenizerFast

    return BertTokenizerFast.from_pretrained(directory)


def test_summarize_refuses_a_tokenizer_that_does_not_fit_its_models(tmp_path, tokenizer, run_cli):
    """A 5-token vocabulary for a 731-token model: empty summaries, exit 0."""
    torch.manual_seed(0)
    config = tiny_config(vocab_size=731)
    Summarizer(NezhaForSentenceExtraction(config), NezhaForUniLM(config),
               small_tokenizer(tmp_path / "small")).save_pretrained(tmp_path / "s")
    data = judgments_file(tmp_path / "d.jsonl", "d", 2)
    one_line_failure(run_cli("summarize", tmp_path / "s", data, *SUMMARIZE), "5 tokens", "731",
                     str(tmp_path / "s" / "extractor"))


def test_train_summarizer_and_pretrain_refuse_a_tokenizer_that_does_not_fit_the_base(tmp_path, run_cli):
    base = tmp_path / "base"
    torch.manual_seed(0)
    from nezha_hf import NezhaForMaskedLM

    NezhaForMaskedLM(tiny_config(vocab_size=731)).save_pretrained(base)
    small_tokenizer(base).save_pretrained(base)
    data = judgments_file(tmp_path / "d.jsonl", "d", 4)
    before = snapshot(tmp_path)
    one_line_failure(run_cli("train-summarizer", data, "--base", base, "--output", tmp_path / "out"), "5 tokens", "731")
    one_line_failure(run_cli("pretrain", base, data, "--output", tmp_path / "out"), "5 tokens", "731")
    assert snapshot(tmp_path) == before


def test_a_tokenizer_without_a_mask_token_cannot_pretrain(tmp_path, tokenizer, run_cli):
    base = base_model(tmp_path / "base", tokenizer)
    config = json.loads((base / "tokenizer_config.json").read_text())
    (base / "tokenizer_config.json").write_text(json.dumps({**config, "mask_token": None}))
    one_line_failure(run_cli("pretrain", base, corpus(tmp_path / "corpus"), "--output", tmp_path / "out"),
                     "mask_token")


# --- ids: never merged -----------------------------------------------------------------------------------------


def test_txt_judgments_with_one_name_in_two_folders_keep_distinct_ids(tmp_path):
    """`2019/001.txt` and `2020/001.txt` both got the id `001`, and `evaluate` scored by the merged id."""
    from nezha_hf.cail import read_judgments

    for year in ("2019", "2020"):
        (tmp_path / "judgments" / year).mkdir(parents=True)
        (tmp_path / "judgments" / year / "001.txt").write_text(f"{year}年的判决。原告胜诉。", encoding="utf-8")
    assert [j.id for j in read_judgments([tmp_path / "judgments"])] == ["2019/001", "2020/001"]
    with pytest.raises(ValueError, match="2019.001.txt.*2020.001.txt"):
        read_judgments([tmp_path / "judgments" / "2019", tmp_path / "judgments" / "2020"])
    with pytest.raises(ValueError, match="'001'"):
        read_judgments([tmp_path / "judgments" / "2019" / "001.txt", tmp_path / "judgments" / "2020" / "001.txt"])


def test_a_null_id_is_the_line_not_none_and_a_bom_is_not_text(tmp_path):
    from nezha_hf.cail import read_judgments

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"id": None, "text": "原告胜诉。"}, ensure_ascii=False) + "\n", encoding="utf-8")
    (tmp_path / "bom.txt").write_text("\ufeff原告胜诉。被告败诉。", encoding="utf-8")
    judgments = read_judgments([data, tmp_path / "bom.txt"])
    assert judgments[0].id == f"{data}:1"
    assert judgments[1].sentences[0] == "原告胜诉。"


def test_each_skipped_line_is_reported_once(tmp_path, tokenizer, run_cli, caplog):
    model = summarizer_folder(tmp_path / "s", tokenizer)
    data = write_jsonl(tmp_path / "d.jsonl", [synthetic_judgment(random.Random(0), 0)], extra_lines=["{not json"])
    done = run_cli("summarize", model, data, "--extract-only", *SUMMARIZE)
    assert done.returncode == 0, done.stderr
    assert (done.stderr + caplog.text).count("d.jsonl:2") == 1


# --- inputs far beyond any judgment; signals at any length -------------------------------------------------------


def test_an_input_far_beyond_any_judgment_is_refused_before_any_work(tmp_path, tokenizer, run_cli):
    """A 5 MB single-line "judgment" ran for hours without a word of what it would cost."""
    model, base = summarizer_folder(tmp_path / "s", tokenizer), base_model(tmp_path / "base", tokenizer)
    data = tmp_path / "huge.jsonl"
    data.write_text(json.dumps({"id": "huge", "text": "原告胜诉。" * 40_000}, ensure_ascii=False) + "\n",
                    encoding="utf-8")
    start = time.monotonic()
    line = one_line_failure(run_cli("summarize", model, data, "--output", tmp_path / "o.jsonl"), "200,000",
                            "100,000", "--max-characters", "huge")
    assert time.monotonic() - start < 5, line
    for command in (["evaluate", data, data], ["train-summarizer", data, "--base", base, "--output", tmp_path / "t"]):
        one_line_failure(run_cli(*command), "--max-characters")
    from nezha_hf.cail import read_judgments

    assert len(read_judgments([data], max_characters=200_000)[0].text) == 200_000


# Python keeps an ignored SIGINT ignored (a job started with `&` by a shell without job control inherits it), so the
# process sets the handler it would have had, whatever ran the tests.
SIGNALLED = """
import signal, sys, time, torch
from nezha_hf import attention_ops, fused_attention
signal.signal(signal.SIGINT, signal.default_int_handler)
assert fused_attention.fused_kernel() is not None
q = torch.randn(1, 12, 32768, 64)
problem = attention_ops.AttentionProblem(attention_ops.RelativeAttentionMask(), 0.125)
table = attention_ops.sinusoid_relative_table(64, 64)
print("started", flush=True)
try:
    fused_attention.fused_attention(q, q, q, table, problem)
    print("finished", flush=True)
except KeyboardInterrupt:
    print("interrupted", time.monotonic(), flush=True)
"""


def test_ctrl_c_ends_a_long_attention_call_within_two_seconds(tmp_path):
    """SIGINT and SIGTERM waited until the current attention call ended: over 9 minutes at 41k tokens."""
    process = subprocess.Popen([sys.executable, "-c", SIGNALLED], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    assert process.stdout.readline().strip() == "started", process.stderr.read()
    time.sleep(2)  # well inside the call: it takes tens of seconds
    sent = time.monotonic()
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=120)
    assert stdout.split()[0] == "interrupted", (stdout, stderr[-2000:])
    assert float(stdout.split()[1]) - sent < 2.0


# --- outputs others can read ---------------------------------------------------------------------------------------


@pytest.fixture
def umask_022():
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def mode(path):
    return stat.S_IMODE(path.stat().st_mode)


def test_outputs_get_the_permissions_of_an_ordinary_write(tmp_path, umask_022, run_cli):
    """Every output was 0600 / 0700 whatever the umask (staging used mkstemp/mkdtemp); `--overwrite` turned a 0644
    file into 0600: a colleague could not load the model you trained."""
    from helpers import save_layout, small_bert

    save_layout(small_bert(), tmp_path / "bert", "safetensors")
    done = run_cli("convert", "bert", tmp_path / "bert", tmp_path / "nezha")
    assert done.returncode == 0, done.stderr
    assert mode(tmp_path / "nezha") == 0o755
    assert {mode(p) for p in (tmp_path / "nezha").rglob("*") if p.is_file()} == {0o644}
    from safetensors.torch import save_file

    from nezha_hf.safe_output import staged_file, write_text_atomically

    with staged_file(tmp_path / "weights.safetensors") as staging:
        save_file({"w": torch.zeros(2)}, str(staging))  # safetensors alone makes it 0600
    assert mode(tmp_path / "weights.safetensors") == 0o644
    target = tmp_path / "scores.json"
    write_text_atomically(target, "{}")
    assert mode(target) == 0o644
    target.chmod(0o640)
    write_text_atomically(target, "{} ", overwrite=True)
    assert mode(target) == 0o640 and target.read_text() == "{} "
    (tmp_path / "nezha").chmod(0o750)
    done = run_cli("convert", "bert", tmp_path / "bert", tmp_path / "nezha", "--overwrite")
    assert done.returncode == 0, done.stderr
    assert mode(tmp_path / "nezha") == 0o750


# --- run state: written as outputs are, named when damaged, each checkpoint of its own run (issue 54) ---------------


def a_run_folder(folder) -> RunRecord:
    """A run's checkpoints folder as `prepare_checkpoints` leaves it; returns the run's record."""
    from nezha_hf.checkpoints import prepare_checkpoints

    record = RunRecord("pretrain", "base", "x", ["data"], "y", {"global_batch": 8, "bf16": False})
    assert prepare_checkpoints(folder, record) is None
    return record


@pytest.mark.parametrize(("saved", "named"), [
    ("", "not valid JSON"), ("[]", "must be a JSON object"), ('{"x": 1}', "x: is not a key"),
    ('{"command": "pretrain"}', "base: is missing"),
    ('{"command": "pretrain", "base": "b", "base_content": "x", "data": {"a": 1}, "data_content": "y", '
     '"settings": {}}', "data: must be a list"),
    ('{"command": "pretrain", "base": "b", "base_content": "x", "data": [], "data_content": "y", "settings": []}',
     "settings: must be a JSON object")])
def test_a_damaged_run_record_is_named_and_no_resume_always_starts_over(tmp_path, saved, named):
    """Issue 54 item 9: an empty `nezha_run.json` (a full disk) failed every rerun, --no-resume included, with
    "Expecting value: line 1 column 1 (char 0)"; damaged ones with `RunRecord.__init__() got an unexpected keyword
    argument 'x'` or "'list' object has no attribute 'items'", naming no file."""
    from nezha_hf.checkpoints import prepare_checkpoints

    folder = tmp_path / "out.checkpoints"
    record = a_run_folder(folder)
    (folder / "checkpoint-4").mkdir()
    (folder / RunRecord.FILE).write_text(saved)
    with pytest.raises(ValueError) as refused:
        prepare_checkpoints(folder, record)
    message = str(refused.value)
    assert f"{folder / RunRecord.FILE}" in message and named in message and "--no-resume" in message, message
    assert "\n" not in message
    assert prepare_checkpoints(folder, record, resume=False) is None
    assert sorted(p.name for p in folder.iterdir()) == [RunRecord.FILE]
    assert prepare_checkpoints(folder, record) is None  # the new record is whole: the same run resumes


def test_the_run_record_is_staged_a_full_disk_leaves_the_old_one(tmp_path, monkeypatch):
    """Issue 54 item 9: `nezha_run.json` was written in place; a write that fails (a full disk) left it empty."""
    import errno
    import pathlib

    from nezha_hf.checkpoints import prepare_checkpoints

    folder = tmp_path / "out.checkpoints"
    record = a_run_folder(folder)
    before = (folder / RunRecord.FILE).read_bytes()
    real_open = pathlib.Path.open

    def full_disk(self, mode="r", *args, **kwargs):
        handle = real_open(self, mode, *args, **kwargs)
        if "w" in mode and RunRecord.FILE in self.name:
            handle.close()
            raise OSError(errno.ENOSPC, "No space left on device")
        return handle

    monkeypatch.setattr(pathlib.Path, "open", full_disk)
    with pytest.raises(OSError, match="No space left"):
        prepare_checkpoints(folder, record)
    monkeypatch.undo()
    assert (folder / RunRecord.FILE).read_bytes() == before
    assert sorted(p.name for p in folder.iterdir()) == [RunRecord.FILE]  # no staging file left beside it
    assert prepare_checkpoints(folder, record) is None


TRAINER_STATE_DAMAGE = {
    "a list": lambda state: [state],
    "global_step a string": lambda state: {**state, "global_step": str(state["global_step"])},
    "max_steps a string": lambda state: {**state, "max_steps": "8"},
    "log_history not a list": lambda state: {**state, "log_history": {"loss": 1}},
    "an unknown key": lambda state: {**state, "x": 1},
}


@pytest.mark.slow
def test_a_checkpoint_of_the_wrong_shape_or_with_garbage_state_is_skipped_for_the_last_intact_one(tmp_path, tokenizer,
                                                                                                 caplog):
    """Issue 54 item 10: a `trainer_state.json` that is valid JSON of the wrong shape ended pretrain with "list
    indices must be integers" or "'>=' not supported between 'str' and 'int'"; a garbage `scheduler.pt` or
    `rng_state.pth` with torch's weights-only message. Each is skipped, named, for the last intact checkpoint."""
    base, data = base_model(tmp_path / "base", tokenizer), corpus(tmp_path / "corpus")
    done = pretrain(base, data, "--output", tmp_path / "uninterrupted", "--max-steps", "8", *PRETRAIN)
    assert done.returncode == 0, done.stderr[-2000:]
    damages = {**{name: ("trainer_state.json", change) for name, change in TRAINER_STATE_DAMAGE.items()},
               "garbage scheduler": ("scheduler.pt", None), "garbage rng state": ("rng_state.pth", None)}
    for name, (file, change) in damages.items():
        copy = tmp_path / name.replace(" ", "-")
        shutil.copytree(tmp_path / "uninterrupted.checkpoints", copy)
        target = copy / "checkpoint-8" / file
        if change is None:
            target.write_bytes(b"PK\x03\x04 not a torch file" * 10)
        else:
            target.write_text(json.dumps(change(json.loads(target.read_text()))))
        problem = checkpoint_problem(copy / "checkpoint-8")
        assert problem is not None and file in problem, (name, problem)
        caplog.clear()
        with caplog.at_level("WARNING"):
            assert last_complete_checkpoint(copy).name == "checkpoint-4", name
        assert any(file in r.getMessage() and "checkpoint-8" in r.getMessage() for r in caplog.records), name
    # End to end, the case that ended pretrain with "'>=' not supported": resumed from checkpoint-4, as uninterrupted.
    shutil.copytree(tmp_path / "max_steps-a-string", tmp_path / "out.checkpoints")
    done = pretrain(base, data, "--output", tmp_path / "out", "--max-steps", "8", *PRETRAIN)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "checkpoint-4" in done.stderr.split("Resuming from")[1].splitlines()[0]
    got, expected = load_file(tmp_path / "out" / "model.safetensors"), load_file(
        tmp_path / "uninterrupted" / "model.safetensors")
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-5, rtol=0)


@pytest.mark.slow
def test_a_checkpoint_of_another_run_is_not_resumed(tmp_path, tokenizer):
    """Issue 54 item 5: the run record was checked per folder, not per checkpoint: another run's `checkpoint-4`
    (other data, another learning rate) dropped into the folder was resumed, here taken as the finished run, without
    a word. Each checkpoint now carries its run's record; one of another run is skipped, named."""
    base = base_model(tmp_path / "base", tokenizer)
    mine, theirs = corpus(tmp_path / "mine"), corpus(tmp_path / "theirs")
    (theirs / "corpus.txt").write_text("另一个法院的判决。" * 200, encoding="utf-8")
    for data, output, rate in ((mine, "mine-out", "2e-3"), (theirs, "theirs-out", "1e-3")):
        done = pretrain(base, data, "--output", tmp_path / output, "--max-steps", "4", *PRETRAIN[:-1], rate)
        assert done.returncode == 0, done.stderr[-2000:]
    reference = load_file(tmp_path / "mine-out" / "model.safetensors")
    shutil.rmtree(tmp_path / "mine-out")  # as if killed before its output was in place ...
    shutil.rmtree(tmp_path / "mine-out.checkpoints" / "checkpoint-4")  # ... and before its checkpoint
    shutil.copytree(tmp_path / "theirs-out.checkpoints" / "checkpoint-4",
                    tmp_path / "mine-out.checkpoints" / "checkpoint-4")
    done = pretrain(base, mine, "--output", tmp_path / "mine-out", "--max-steps", "4", *PRETRAIN)
    assert done.returncode == 0, done.stderr[-2000:]
    skipped = [line for line in done.stderr.splitlines() if "checkpoint-4" in line and "another run" in line]
    assert len(skipped) == 1, done.stderr[-2000:]
    assert "Resuming from" not in done.stderr and "already ends this run" not in done.stderr
    got = load_file(tmp_path / "mine-out" / "model.safetensors")
    for name in reference:
        torch.testing.assert_close(got[name], reference[name], atol=1e-5, rtol=0)


def kept_journal(tmp_path, tokenizer, run_cli, monkeypatch, count=4):
    """A summariser, its inputs, and the journal of a finished `summarize` whose output could not be written."""
    from nezha_hf import summarization

    model = summarizer_folder(tmp_path / "s", tokenizer)
    data = judgments_file(tmp_path / "d.jsonl", "d", count)
    output = tmp_path / "o.jsonl"

    def cannot_write(*args, **kwargs):
        raise OSError("the output could not be written")

    with monkeypatch.context() as patched:
        patched.setattr(summarization, "write_summaries", cannot_write)
        assert run_cli("summarize", model, data, "--output", output, *SUMMARIZE).returncode == 2
    journal = tmp_path / ".o.jsonl.progress"
    assert len((journal / "done-0.jsonl").read_text().splitlines()) == count
    return model, data, output, journal


@pytest.mark.parametrize("result", ["null", "a string", "a number", "another id", "no summary", "bad extracted"])
def test_a_journal_result_must_be_the_record_of_the_judgment_it_claims(tmp_path, tokenizer, run_cli, monkeypatch,
                                                                      result):
    """Issue 54 item 6 (kept back last round): a journal result that is null, a string or a number was written as
    an output line; one whose id is another judgment's was written under that id (one judgment twice, another
    missing). Each is now refused as a damaged line, naming the file and line and the way out."""
    model, data, output, journal = kept_journal(tmp_path, tokenizer, run_cli, monkeypatch)
    part = journal / "done-0.jsonl"
    entries = [json.loads(line) for line in part.read_text().splitlines()]
    entry = entries[2]
    entry["result"] = {"null": None, "a string": "d2 summary", "a number": 3,
                       "another id": {**entry["result"], "id": "d1"},
                       "no summary": {k: v for k, v in entry["result"].items() if k != "summary"},
                       "bad extracted": {**entry["result"], "extracted": "all"}}[result]
    part.write_text("".join(json.dumps(e, ensure_ascii=False) + "\n" for e in entries))
    before = snapshot(tmp_path)
    line = one_line_failure(run_cli("summarize", model, data, "--output", output, *SUMMARIZE), str(part), "line 3",
                            "--no-resume")
    assert snapshot(tmp_path) == before and not output.exists(), line
    done = run_cli("summarize", model, data, "--output", output, *SUMMARIZE, "--no-resume")
    assert done.returncode == 0, done.stderr
    assert ids(output) == ["d0", "d1", "d2", "d3"]


@pytest.mark.slow  # a pretrain run
def test_a_checkpoint_that_cannot_be_written_is_one_short_line_naming_it(tmp_path, tokenizer):
    """Issue 54 item 10: a full disk inside a checkpoint ended pretrain with the distributed checkpoint's traceback of
    every process folded into one line (1,614 characters). Here files may not grow past 300 KB (`RLIMIT_FSIZE`, as
    a full disk refuses a write), which the optimizer state's piece (about 1 MB) does. The run is in Python's
    development mode, which prints what an object's finalizer raises, as Python 3.13 always does: there the failed
    writer's "ValueError: flush of closed file" followed the one line at exit."""
    import resource

    base, data = base_model(tmp_path / "base", tokenizer), corpus(tmp_path / "corpus")

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails (EFBIG) rather than the process being killed
        resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, 300_000))

    done = subprocess.run([*CLI, "pretrain", *map(str, [base, data, "--output", tmp_path / "out", "--max-steps", "8",
                                                      *PRETRAIN])], capture_output=True, text=True, timeout=600,
                          preexec_fn=small_files, env={**os.environ, "PYTHONDEVMODE": "1"})
    line = one_line_failure(done, "checkpoint-4", "File too large")
    assert len(line) < 400, line
    assert not (tmp_path / "out").exists()
