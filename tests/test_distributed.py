"""More than one process (2 CPU processes, gloo): transformers 5's `DistributedConfig` plans (FSDP2, tensor parallel),
saving and distributed checkpoints across process counts, and the commands under `accelerate launch` / `torchrun`.

The multi-process side runs in `distributed_worker.py` (model-level scenarios) or the `nezha-hf` commands; the
single-process side, the reference, runs here.
"""

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from distributed_worker import STEPS, train, training_batch
from helpers import VOCAB, synthetic_judgment, tiny_config, write_jsonl
from safetensors.torch import load_file
from test_pretraining import pretraining_start

from nezha_hf import NezhaForMaskedLM, NezhaForSentenceExtraction, NezhaForUniLM, NezhaModel
from nezha_hf.summarization import Summarizer

pytestmark = pytest.mark.slow
WORKER = Path(__file__).with_name("distributed_worker.py")
ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
ACCELERATE = [str(Path(sys.executable).with_name("accelerate")), "launch", "--config_file",
              str(ROOT / "nezha_hf" / "launch_configs" / "one-machine.yaml"), "--num_processes", "2"]
ENGINES = ["eager", "nezha_fused", "nezha_chunked", "nezha_three_regions"]


def launch(command, timeout=600, **kwargs):
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, **kwargs)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def kill_everything(process: subprocess.Popen) -> None:
    """SIGKILL a launcher and every process it started (its workers run in sessions of their own), as when the
    machine or the job dies."""
    import psutil

    launcher = psutil.Process(process.pid)
    for member in [*launcher.children(recursive=True), launcher]:
        member.kill()
    process.wait()


def tiny_model(directory: Path) -> Path:
    torch.manual_seed(0)
    NezhaForMaskedLM(tiny_config(num_hidden_layers=3)).save_pretrained(directory)
    return directory


def assert_same_weights(got: dict, expected: dict, atol=1e-5):
    assert got.keys() >= {k for k in expected if not k.startswith("cls.predictions.decoder")}
    for name, value in expected.items():
        if name in got:
            torch.testing.assert_close(got[name], value, atol=atol, rtol=0, msg=name)


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    """Two processes, FSDP2: 3 AdamW steps, each process on half of the batch; saved three ways."""
    folder = tmp_path_factory.mktemp("fsdp")
    model = tiny_model(folder / "start")
    (folder / "out").mkdir()
    launch([*TORCHRUN, str(WORKER), "fsdp-train", str(model), str(folder / "out")])
    return model, folder / "out"


def one_process(model_dir, steps):
    model = NezhaForMaskedLM.from_pretrained(model_dir)
    return model, train(model, training_batch(), steps)


def test_fsdp_makes_every_layer_a_unit_and_trains_as_one_process(fsdp_run):
    start, out = fsdp_run
    units = json.loads((out / "units.json").read_text())
    # Every encoder layer is its own unit; embeddings and the tied decoder share the root's (one parameter).
    assert units == ["", "nezha.encoder.layer.0", "nezha.encoder.layer.1", "nezha.encoder.layer.2"]
    expected, _ = one_process(start, STEPS)
    saved = NezhaForMaskedLM.from_pretrained(out / "model")  # save_pretrained from the sharded model
    assert_same_weights(saved.state_dict(), expected.state_dict())
    # push_to_hub from every process: one upload, of the whole model, with its card.
    assert sorted(p.name for p in out.glob("pushed-by-*")) == ["pushed-by-0"]
    pushed = out / "pushed-by-0"
    assert "user/tiny" in (pushed / "README.md").read_text()
    assert_same_weights(NezhaForMaskedLM.from_pretrained(pushed).state_dict(), expected.state_dict())
    # One process reads the two processes' distributed checkpoint.
    assert_same_weights(NezhaForMaskedLM.from_pretrained(out / "dcp").state_dict(), expected.state_dict())


def test_a_distributed_checkpoint_of_two_processes_resumes_on_one(fsdp_run):
    from transformers.distributed.checkpoint import load_optimizer_distributed

    start, out = fsdp_run
    expected, _ = one_process(start, STEPS + 1)
    model = NezhaForMaskedLM.from_pretrained(out / "dcp")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    load_optimizer_distributed(model, optimizer, str(out / "optimizer"))
    train(model, training_batch(), 1, optimizer)
    assert_same_weights(model.state_dict(), expected.state_dict())


def test_a_checkpoint_of_one_process_resumes_on_two(tmp_path):
    from transformers.distributed.checkpoint import save_optimizer_distributed

    start = tiny_model(tmp_path / "start")
    model, optimizer = one_process(start, STEPS)
    model.save_pretrained(tmp_path / "three")
    save_optimizer_distributed(model, optimizer, str(tmp_path / "optimizer"))
    launch([*TORCHRUN, str(WORKER), "fsdp-resume", str(tmp_path / "three"), str(tmp_path)])
    expected, _ = one_process(start, STEPS + 1)
    assert_same_weights(NezhaForMaskedLM.from_pretrained(tmp_path / "resumed").state_dict(), expected.state_dict())


def test_fsdp_loads_a_checkpoint_without_an_mlm_head(tmp_path):
    """`pretrain --fsdp` from a converted BertModel (no `cls.*`): the MLM bias stayed on the meta device ("FSDP
    parameters should be materialized from meta device before training")."""
    torch.manual_seed(0)
    NezhaModel(tiny_config(num_hidden_layers=3)).save_pretrained(tmp_path / "headless")
    launch([*TORCHRUN, str(WORKER), "fsdp-headless", str(tmp_path / "headless"), str(tmp_path)])
    assert json.loads((tmp_path / "headless.json").read_text()) == {"on_meta": [], "bias_is_zero": True,
                                                                     "bias_tied": True}


def test_fsdp2_built_on_the_meta_device_equals_the_model_loaded_whole(tmp_path):
    """Issue 54 item 7: meta device, `fully_shard`, `to_empty`, `set_model_state_dict` left the relative table (a
    non-persistent buffer, in no state dict) uninitialised: a different model, silently."""
    launch([*TORCHRUN, str(WORKER), "fsdp-meta", str(tiny_model(tmp_path / "start")), str(tmp_path)])
    assert json.loads((tmp_path / "meta.json").read_text())["difference"] < 1e-6


@pytest.mark.parametrize("attention", ENGINES)
def test_tensor_parallel_matches_one_process(tmp_path, attention):
    start = tiny_model(tmp_path / "start")
    launch([*TORCHRUN, str(WORKER), "tp-train", str(start), str(tmp_path), attention])
    shapes = json.loads((tmp_path / "shapes.json").read_text())
    # Each process holds half of the heads, of the feed-forward and of the vocabulary (embeddings and decoder tied).
    assert shapes["nezha.encoder.layer.0.attention.self.query.weight"] == [16, 32]
    assert shapes["nezha.encoder.layer.0.attention.output.dense.weight"] == [32, 16]
    assert shapes["nezha.encoder.layer.0.output.dense.weight"] == [32, 19]
    assert shapes["nezha.embeddings.word_embeddings.weight"] == [50, 32]
    model = NezhaForMaskedLM.from_pretrained(start, attn_implementation=attention)
    batch = training_batch(length=600 if attention == "nezha_three_regions" else 24)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), logits, atol=1e-5, rtol=0)
    train(model, batch, 1)
    assert_same_weights(torch.load(tmp_path / "weights.pt"), model.state_dict())


def test_pipeline_parallel_is_refused_with_a_reason(tmp_path):
    start = tiny_model(tmp_path / "start")
    script = tmp_path / "pipeline.py"
    script.write_text("from transformers.distributed import DistributedConfig\nimport nezha_hf\n"
                      f"nezha_hf.NezhaForMaskedLM.from_pretrained({str(start)!r}, "
                      "distributed_config=DistributedConfig(pp_size=2))\n")
    done = subprocess.run([*TORCHRUN, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "no pipeline-parallel plan" in done.stderr


# --- the commands under a launcher ----------------------------------------------------------------------------


PRETRAIN = ["--max-length", "64", "--save-steps", "2", "--learning-rate", "2e-3", "--seed", "3"]


def pretrain_command(start, corpus, output, *extra, launcher=ACCELERATE):
    return [*launcher, "-m", "nezha_hf", "pretrain", str(start), str(corpus), "--output", str(output), *PRETRAIN,
            *extra]


def test_pretrain_on_two_processes_reaches_the_one_process_weights(tmp_path, tokenizer):
    from nezha_hf.pretraining import continue_pretraining

    start, corpus = pretraining_start(tmp_path, tokenizer)
    # Without dropout, whose random masks differ with the number of processes.
    NezhaForMaskedLM.from_pretrained(start, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0).save_pretrained(
        start)
    # One process with the whole batch of 4, against two with 2 each (the same examples at each step).
    continue_pretraining(start, [corpus], tmp_path / "one", max_length=64, save_steps=2, learning_rate=2e-3, seed=3,
                         max_steps=20, per_device_train_batch_size=4, show_progress=False)
    expected = load_file(tmp_path / "one" / "model.safetensors")
    launch(pretrain_command(start, corpus, tmp_path / "fsdp", "--max-steps", "20", "--batch-size", "2", "--fsdp"))
    assert_same_weights(load_file(tmp_path / "fsdp" / "model.safetensors"), expected)
    launch(pretrain_command(start, corpus, tmp_path / "ddp", "--max-steps", "20", "--batch-size", "2",
                            launcher=TORCHRUN))
    assert_same_weights(load_file(tmp_path / "ddp" / "model.safetensors"), expected)


def test_pretrain_with_fsdp_killed_resumes_where_it_stopped(tmp_path, tokenizer):
    start, corpus = pretraining_start(tmp_path, tokenizer)  # with dropout: the random state is resumed too

    def command(output):
        return pretrain_command(start, corpus, output, "--max-steps", "40", "--batch-size", "2", "--fsdp")

    launch(command(tmp_path / "uninterrupted"))
    # Killed (the launcher and both processes) once a checkpoint is complete, then run again: it resumes there.
    killed = tmp_path / "killed"
    process = subprocess.Popen(command(killed), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env={**os.environ, "HF_HUB_OFFLINE": "1"})
    deadline = time.monotonic() + 300
    while not (tmp_path / "killed.checkpoints" / "checkpoint-2" / "trainer_state.json").exists():
        assert time.monotonic() < deadline and process.poll() is None
        time.sleep(0.02)
    kill_everything(process)
    assert not killed.exists()
    done = launch(command(killed))
    assert "Resuming from" in done.stderr
    assert_same_weights(load_file(killed / "model.safetensors"),
                        load_file(tmp_path / "uninterrupted" / "model.safetensors"), atol=1e-6)
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no lock or staging left


def test_summarize_on_two_processes_equals_one_and_a_rerun_after_a_kill_skips_what_is_written(tmp_path, tokenizer):
    torch.manual_seed(0)
    config = tiny_config(vocab_size=VOCAB)
    Summarizer(NezhaForSentenceExtraction(config), NezhaForUniLM(config), tokenizer).save_pretrained(tmp_path / "s")
    rng = random.Random(0)
    data = write_jsonl(tmp_path / "d.jsonl", [synthetic_judgment(rng, i) for i in range(30)])
    options = ["--batch-size", "2", "--max-new-tokens", "12"]

    def summarize(output, launcher, *extra, **kwargs):
        return [*launcher, "-m", "nezha_hf", "summarize", str(tmp_path / "s"), str(data), "--output", str(output),
                *options, *extra]

    launch(summarize(tmp_path / "one.jsonl", [sys.executable]))
    two = launch(summarize(tmp_path / "two.jsonl", TORCHRUN))
    # One progress bar (the main process's): drawn once at its start, then with its stage beside the count.
    assert two.stderr.count("0/30 [00:00<?, ?judgment/s]") == 1, two.stderr[-4000:]
    assert "extracting 1 of 2" in two.stderr and "generating 2 summaries: token " in two.stderr
    one = (tmp_path / "one.jsonl").read_text(encoding="utf-8")
    assert (tmp_path / "two.jsonl").read_text(encoding="utf-8") == one
    assert [json.loads(line)["id"] for line in one.splitlines()] == [f"doc{i}" for i in range(30)]

    killed = tmp_path / "killed.jsonl"
    journal = tmp_path / ".killed.jsonl.progress"
    process = subprocess.Popen(summarize(killed, TORCHRUN, "--max-new-tokens", "40"), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while sum(len(p.read_bytes().splitlines()) for p in journal.glob("done-*.jsonl")) < 4:
        assert time.monotonic() < deadline and process.poll() is None
        time.sleep(0.02)
    kill_everything(process)
    assert not killed.exists()
    # Another setting is refused on every process, not only where the journal is read: no process waits for the
    # main one's answer (round four's review).
    before = {p.name: p.read_bytes() for p in journal.iterdir()}
    refused = subprocess.run(summarize(killed, TORCHRUN, "--max-new-tokens", "30"), capture_output=True, text=True,
                             timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert refused.returncode != 0 and "max_new_tokens 40 then, 30 now" in refused.stderr, refused.stderr[-4000:]
    assert {p.name: p.read_bytes() for p in journal.iterdir()} == before
    done = launch(summarize(killed, [sys.executable], "--max-new-tokens", "40"))  # one process goes on from there
    skipped = int(done.stderr.split(" of 30 judgments already done")[0].split()[-1])
    assert skipped >= 4
    reference = launch(summarize(tmp_path / "reference.jsonl", [sys.executable], "--max-new-tokens", "40"))
    assert killed.read_text(encoding="utf-8") == (tmp_path / "reference.jsonl").read_text(encoding="utf-8")
    assert not journal.exists() and "already done" not in reference.stderr
