"""Export: ONNX files checked with onnxruntime and written only once verified; every head through transformers' own
exporters; generation through `export_for_generation` (torch.export and ONNX, dynamic and static caches), its exported
decoding loop giving `generate()`'s tokens; a summariser exported whole."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import tiny_config

import nezha_hf
from nezha_hf import (
    NezhaForMaskedLM,
    NezhaForSequenceClassification,
    NezhaForUniLM,
    NezhaModel,
)
from nezha_hf.export import export_onnx
from nezha_hf.relative_attention import Engine, recorded_attention_calls

onnxruntime = pytest.importorskip("onnxruntime", reason="the [onnx] extra is not installed")


def padded_batch(length, rows=3, seed=0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 99, (rows, length), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, length // 2 :] = 0
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.randint(0, 2, ids.shape, generator=generator)}


@pytest.mark.parametrize("cls", [NezhaModel, NezhaForMaskedLM, NezhaForSequenceClassification], ids=lambda c: c.__name__)
@pytest.mark.slow
def test_onnx_matches_pytorch_at_any_length_with_padding(cls, tmp_path):
    torch.manual_seed(0)
    model = cls(tiny_config(num_labels=3)).eval()  # the default attention; the ONNX graph has the gather formulation
    model.save_pretrained(tmp_path / "model")
    report = export_onnx(tmp_path / "model", tmp_path / "model.onnx")
    assert report.max_difference <= 1e-4 and sorted(p.name for p in tmp_path.iterdir()) == ["model", "model.onnx"]
    session = onnxruntime.InferenceSession(str(tmp_path / "model.onnx"))
    assert [i.name for i in session.get_inputs()] == ["input_ids", "attention_mask", "token_type_ids"]
    for length in (16, 600, 3000):
        inputs = padded_batch(length, seed=length)
        with torch.no_grad():
            expected = model(**inputs)
        got = session.run(None, {name: value.numpy() for name, value in inputs.items()})
        for name, value in zip(report.outputs, got):
            np.testing.assert_allclose(value, expected[name].numpy(), atol=1e-4, rtol=0, err_msg=f"{name} at {length}")


@pytest.mark.slow
def test_exporting_a_model_object_leaves_its_attention_alone(tmp_path):
    """The caller's model keeps its linear-memory attention after an export (an earlier version shared the config
    of an eager copy, so the model was silently switched to the L x L gather path)."""
    model = NezhaForSequenceClassification(tiny_config()).eval()
    export_onnx(model, tmp_path / "model.onnx")
    with torch.no_grad(), recorded_attention_calls() as calls:
        model(**padded_batch(40))
    assert model.config._attn_implementation == Engine.FUSED.value
    assert {call.ran for call in calls} == {Engine.FUSED}, calls


def test_export_refuses_what_it_cannot_do_and_writes_nothing(tmp_path):
    torch.manual_seed(0)
    NezhaForUniLM(tiny_config()).save_pretrained(tmp_path / "unilm")
    with pytest.raises(ValueError, match="not exported"):
        export_onnx(tmp_path / "unilm", tmp_path / "unilm.onnx")
    (tmp_path / "old.onnx").write_bytes(b"keep me")
    NezhaModel(tiny_config()).save_pretrained(tmp_path / "model")
    with pytest.raises(FileExistsError, match="overwrite"):
        export_onnx(tmp_path / "model", tmp_path / "old.onnx")
    with pytest.raises(FileNotFoundError, match="No such folder"):
        export_onnx(tmp_path / "nowhere", tmp_path / "x.onnx")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        export_onnx(tmp_path / "empty", tmp_path / "x.onnx")
    saved = sorted(p.name for p in (tmp_path / "model").iterdir())
    with pytest.raises(ValueError, match="source"):  # never written into its source
        export_onnx(tmp_path / "model", tmp_path / "model" / "model.onnx")
    assert sorted(p.name for p in (tmp_path / "model").iterdir()) == saved
    assert (tmp_path / "old.onnx").read_bytes() == b"keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "model", "old.onnx", "unilm"]


@pytest.mark.slow
def test_cli_exports_and_says_it_verified(tmp_path):
    torch.manual_seed(0)
    NezhaForSequenceClassification(tiny_config(num_labels=2)).save_pretrained(tmp_path / "model")
    done = subprocess.run([sys.executable, "-m", "nezha_hf", "export", "onnx", str(tmp_path / "model"),
                           str(tmp_path / "model.onnx")], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "onnxruntime matches PyTorch to" in done.stdout and (tmp_path / "model.onnx").is_file()


# --- transformers' own exporters --------------------------------------------------------------------------------

EXPORTERS = {"dynamo": ("DynamoExporter", "DynamoConfig"), "onnx": ("OnnxExporter", "OnnxConfig")}


def exporter(backend):
    import transformers.exporters as exporters

    exporter_name, config_name = EXPORTERS[backend]
    return getattr(exporters, exporter_name)(), getattr(exporters, config_name)


def head_inputs(cls, length, seed):
    """Inputs (no labels) for head `cls`: a batch of 2 with padding, sentence ids for the extractor."""
    from helpers import head_batch

    batch = {k: v for k, v in head_batch(cls, rows=2, length=length, seed=seed).items()
             if k in ("input_ids", "attention_mask", "token_type_ids")}
    batch["attention_mask"][..., 1, -3:] = 0 if cls is nezha_hf.NezhaForMultipleChoice else 1
    batch["attention_mask"][1, -3:] = 0
    if cls is nezha_hf.NezhaForSentenceExtraction:
        batch["sentence_ids"] = (torch.arange(length)[None].expand(2, -1) // (3 + seed % 4)).clone()
        batch["sentence_ids"][:, 0] = -1
    return batch


@pytest.mark.slow
@pytest.mark.parametrize("cls", [head.model_class for head in nezha_hf.NEZHA_HEADS], ids=lambda c: c.__name__)
def test_transformers_onnx_exporter_exports_every_head(cls):
    """transformers' OnnxExporter stopped at `No ONNX function found for nezha_hf.kernel_forward`: NEZHA's attention ops
    now decompose into standard ops on their own. Exported with dynamic shapes at 12 tokens, run at 23 against PyTorch:
    eager's named outputs (a cache's included) and values. Static shapes: transformers_common's `test_onnx_export`."""
    from helpers import VOCAB
    from transformers.exporters.utils import get_leaf_tensors

    onnx_exporter, config = exporter("onnx")
    torch.manual_seed(0)
    model = cls(tiny_config(vocab_size=VOCAB, num_labels=3)).eval()
    exported = onnx_exporter.export(model, head_inputs(cls, 12, seed=0), config(dynamic=True))
    inputs = head_inputs(cls, 23, seed=1)
    with torch.no_grad():
        expected = get_leaf_tensors(model(**inputs))
    got = get_leaf_tensors(exported(**inputs))
    assert set(got) == set(expected), cls.__name__
    for name, value in expected.items():
        torch.testing.assert_close(torch.as_tensor(got[name]), value, atol=1e-4, rtol=0, msg=f"{cls.__name__}.{name}")


def left_padded(lengths, seed=0):
    from helpers import left_padded_prompts

    _, input_ids, attention_mask = left_padded_prompts(lengths, seed=seed)
    return input_ids, attention_mask


@pytest.mark.slow
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("backend", ["dynamo", "onnx"])
def test_exported_generation_gives_generate_tokens(backend, cache):
    """export_for_generation stopped at the source-mask gather (decoding passed token types one token wide while the
    query was several); for ONNX at the attention op. Exported once on 16-token prompts, the exported prefill and
    decoding step give generate()'s greedy tokens for sources of 16, 600 and 3,000 tokens."""
    from transformers import GenerationConfig

    from nezha_hf.summarization import generate_exported

    backend_exporter, config = exporter(backend)
    torch.manual_seed(0)
    model = NezhaForUniLM(tiny_config()).eval()
    settings = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    static = dict(cache_implementation="static", max_cache_len=3040) if cache == "static" else {}
    input_ids, attention_mask = left_padded([14, 9])
    exported = backend_exporter.export_for_generation(
        model, {"input_ids": input_ids, "attention_mask": attention_mask}, config(dynamic=True),
        generation_config=GenerationConfig(max_new_tokens=4, **settings, **static), multi_token_decode=cache == "dynamic")
    for length in (16, 600, 3000):
        input_ids, attention_mask = left_padded([length - 2, length // 2], seed=length)
        with torch.no_grad():
            expected = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=8, **settings)
        got = generate_exported(exported, input_ids, attention_mask, 8, None, 0)
        assert torch.equal(got, expected), (length, got[:, -8:], expected[:, -8:])


@pytest.mark.slow
def test_a_summariser_exports_whole_and_runs_on_onnxruntime(tmp_path, run_cli):
    """`nezha-hf export onnx SUMMARISER OUT`: extractor and generator, verified against PyTorch on real judgments
    before the folder is put in place; loaded back, it summarises as the PyTorch summariser does (greedily). Issue
    57: the export, in a process of its own, prints its own summary line only (the model exporters' noise, `W1127 ...
    torch/onnx`, torchvision, `TReal`, PyTorch's own warnings, is held back)."""
    from test_newcomer import exporter_noise

    from nezha_hf.cail import read_judgments
    from nezha_hf.demo import EXAMPLES, summarizer_pipeline
    from nezha_hf.summarization import load_exported_summarizer
    from nezha_hf.summarization import Summarizer

    summarizer_pipeline(tmp_path, quick=True)
    # It decodes with 3 beams; exported, it would decode greedily: refused before any work unless --greedy says so.
    refused = run_cli("export", "onnx", tmp_path / "toy-summarizer", tmp_path / "onnx")
    assert refused.returncode == 2 and "3 beams" in refused.stderr and "--greedy" in refused.stderr, refused.stderr
    assert not (tmp_path / "onnx").exists()
    done = subprocess.run([sys.executable, "-m", "nezha_hf", "export", "onnx", tmp_path / "toy-summarizer",
                           tmp_path / "onnx", "--greedy"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "greedy summaries" in done.stdout
    noise, lines = exporter_noise(done)
    assert not noise, noise
    # Besides its summary, transformers' bars loading the two models (as every command that loads them shows).
    others = [line for line in lines if not line.startswith(("Exported the summariser", "Loading weights:"))]
    assert not others, others  # were `[torch.onnx] Run decompositions...`, `[transformers] ... experimental`, ...
    judgments = read_judgments([EXAMPLES])
    exported = load_exported_summarizer(tmp_path / "onnx")
    expected = Summarizer.from_pretrained(tmp_path / "toy-summarizer").summarize(judgments, num_beams=1, max_new_tokens=30)
    assert exported.summarize(judgments, max_new_tokens=30) == expected
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    # `summarize` takes the exported folder as it takes a trained one (it said it "needs extractor/ and generator/
    # model folders", which it has)
    beams = run_cli("summarize", tmp_path / "onnx", EXAMPLES, "--max-new-tokens", "30", "--num-beams", "3")
    assert beams.returncode == 2 and "greedily" in beams.stderr, beams.stderr  # before any judgment is read
    done = run_cli("summarize", tmp_path / "onnx", EXAMPLES, "--max-new-tokens", "30")
    assert done.returncode == 0, done.stderr[-2000:]
    assert [json.loads(line)["summary"] for line in done.stdout.splitlines()] == [r["summary"] for r in expected]
    assert_long_judgment_is_summarised(tmp_path, run_cli)
    assert_damage_is_named(tmp_path / "onnx", run_cli)
    assert_foreign_manifests_are_refused(tmp_path / "onnx", run_cli)


def assert_long_judgment_is_summarised(tmp_path, run_cli):
    """Issue 71: `summarize` on the exported folder reads a judgment of 16,384 tokens whole (the exported extractor's
    attention in chunks, linear memory) and writes what the PyTorch summariser writes; its extraction probabilities
    match PyTorch's."""
    from nezha_hf.cail import read_judgments
    from nezha_hf.demo import EXAMPLES
    from nezha_hf.summarization import Summarizer, encode_document, load_exported_summarizer

    bundled = [json.loads(line) for line in EXAMPLES.read_text(encoding="utf-8").splitlines() if line]
    sentences = [sentence for record in bundled for sentence in record["text"]]
    summarizer = Summarizer.from_pretrained(tmp_path / "toy-summarizer", num_beams=1)
    text, tokens = [], 0
    while tokens < 16384:  # the bundled judgments' sentences over and over, to 16,384 tokens
        sentence = sentences[len(text) % len(sentences)]
        text.append(sentence)
        tokens = len(encode_document(summarizer.tokenizer, [s["sentence"] for s in text])["input_ids"])
    text.pop()
    (tmp_path / "long.jsonl").write_text(json.dumps({"id": "long", "summary": "", "text": text}, ensure_ascii=False)
                                         + "\n", encoding="utf-8")
    long_judgment = read_judgments([tmp_path / "long.jsonl"])
    assert len(encode_document(summarizer.tokenizer, long_judgment[0].sentences)["input_ids"]) > 16000
    exported = load_exported_summarizer(tmp_path / "onnx")
    expected, got = (s.extract_probabilities(long_judgment)[0] for s in (summarizer, exported))
    assert max(abs(a - b) for a, b in zip(expected, got, strict=True)) < 1e-4
    done = run_cli("summarize", tmp_path / "onnx", tmp_path / "long.jsonl", "--max-new-tokens", "30")
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["summary"] == summarizer.summarize(long_judgment, max_new_tokens=30)[0]["summary"]


def assert_foreign_manifests_are_refused(exported, run_cli):
    """Round four: an exported folder's `export.json` is data from whoever made it; one naming a program outside the
    folder, or a format whose loading runs code, is one line naming the manifest, before anything is read."""
    from nezha_hf.demo import EXAMPLES

    manifest = json.loads((exported / "generator" / "export.json").read_text())
    component = next(iter(manifest["components"]))
    outside = exported.parent / "outside.onnx"
    shutil.copy(exported / "generator" / manifest["components"][component]["file"], outside)
    changes = {"outside": {"components": {**manifest["components"], component: {
                   **manifest["components"][component], "file": f"../../{outside.name}"}}},
               "absolute": {"components": {**manifest["components"], component: {
                   **manifest["components"][component], "file": str(outside)}}},
               "format": {"export_format": "dynamo"}}
    for name, change in changes.items():
        damaged = exported.with_name("damaged")
        shutil.copytree(exported, damaged)
        (damaged / "generator" / "export.json").write_text(json.dumps({**manifest, **change}))
        done = run_cli("summarize", damaged, EXAMPLES, "--max-new-tokens", "4")
        assert done.returncode == 2 and "export.json" in done.stderr.strip().splitlines()[-1], (name, done.stderr)
        shutil.rmtree(damaged)


def assert_damage_is_named(exported, run_cli):
    """A missing `.onnx.data` or `export.json` said "Checkout 'https://huggingface.co//<the folder>/...'"; without
    `generator/config.json` summarising failed with `AttributeError`. Each is one line naming the file."""
    from nezha_hf.demo import EXAMPLES

    pieces = ["generator/export.json", "extractor/config.json", "generator/config.json", "summarizer.json",
              *[str(p.relative_to(exported)) for p in exported.rglob("*.onnx*")]]
    for piece in pieces:
        damaged = exported.with_name("damaged")
        shutil.copytree(exported, damaged)
        (damaged / piece).unlink()
        done = run_cli("summarize", damaged, EXAMPLES, "--max-new-tokens", "4")
        assert done.returncode == 2 and "Traceback" not in done.stderr, (piece, done.stderr[-2000:])
        line = done.stderr.strip().splitlines()[-1]
        assert line.startswith("nezha-hf summarize: error:") and piece.split("/")[-1] in line, (piece, line)
        assert "huggingface.co" not in line, line
        shutil.rmtree(damaged)


# --- every output and every cache tensor as eager (issue 56) -----------------------------------------------------


def assert_exported_equals_eager(backend, model, inputs, dynamic, label):
    """`inputs` (a forward's kwargs) through `model` and through its export by transformers' `backend` exporter: the
    same named outputs, caches included (flattened the way transformers' exporter checks flatten them), each within
    1e-5."""
    import copy

    from transformers.exporters.utils import get_leaf_tensors

    backend_exporter, config = exporter(backend)
    # Read before the forward: a static cache gets its key and value tensors during the first one.
    input_leaves = set(get_leaf_tensors(copy.deepcopy(inputs)))
    with torch.no_grad():
        expected = get_leaf_tensors(model(**copy.deepcopy(inputs)))
    exported = backend_exporter.export(model, copy.deepcopy(inputs), config(dynamic=dynamic))
    got = get_leaf_tensors(exported(**copy.deepcopy(inputs)))
    assert set(got) == set(expected), (label, sorted(set(got) ^ set(expected)))
    assert any(name.startswith("cache.") for name in expected), (label, sorted(expected))
    if backend == "onnx":
        # The names onnxruntime shows: eager's, in its order; transformers prefixes `output.` to a cache tensor the
        # step also takes as an input (it writes the updated one), as it does for BERT.
        graph_outputs = [value.name for value in exported.program.graph.outputs]
        assert graph_outputs == [f"output.{name}" if name in input_leaves else name for name in expected], (
            label, graph_outputs)
    for name, value in expected.items():
        torch.testing.assert_close(torch.as_tensor(got[name]), value, atol=1e-5, rtol=0, msg=f"{label}: {name}")


def generation_parts(cache, engine=None, eos_token_id=-1):
    """`decompose_for_generation` of a tiny NezhaForUniLM on two left-padded prompts: `{"prefill": (model, inputs),
    "decode": (model, inputs)}`, captured by a greedy `generate` with a `cache` ("static" or "dynamic") cache."""
    from transformers import GenerationConfig
    from transformers.exporters.utils import decompose_for_generation

    torch.manual_seed(0)
    model = NezhaForUniLM(tiny_config(**({"attn_implementation": engine.value} if engine else {}))).eval()
    static = dict(cache_implementation="static", max_cache_len=32) if cache == "static" else {}
    settings = GenerationConfig(do_sample=False, use_cache=True, eos_token_id=eos_token_id, pad_token_id=0, **static)
    input_ids, attention_mask = left_padded([6, 9])
    return decompose_for_generation(model, {"input_ids": input_ids, "attention_mask": attention_mask},
                                    generation_config=settings)


# The default engine with static shapes runs in the fast set; the other engines and dynamic shapes are slow.
STATIC_CACHE_EXPORTS = [pytest.param(None, False, id="default-static-shapes"),
                        pytest.param(None, True, id="default-dynamic-shapes", marks=pytest.mark.slow)] + [
    pytest.param(engine, dynamic, id=f"{engine.value}-{'dynamic' if dynamic else 'static'}-shapes",
                 marks=pytest.mark.slow) for engine in Engine for dynamic in (False, True)]


@pytest.mark.parametrize("engine,dynamic", STATIC_CACHE_EXPORTS)
def test_exported_static_cache_decoding_step_equals_eager(engine, dynamic):
    """The decoding step exported with a static cache placed its queries one token too far: the cache reports its
    length as the tensor its layers then advance in place, so read after layer 0's update it was one more (logits
    off by 2e-3, layer 1's cache by 2e-3; the prefill, with an empty cache, matched). Prefill and decoding step
    through `decompose_for_generation` + `DynamoExporter`, every output and cache tensor against eager at 1e-5, for
    every engine (on a CPU the Triton one is traced as its fallback)."""
    for part, (model, inputs) in generation_parts("static", engine).items():
        assert_exported_equals_eager("dynamo", model, inputs, dynamic, f"{part}, {engine}, dynamic={dynamic}")


@pytest.mark.slow
@pytest.mark.parametrize("dynamic", [False, True], ids=["static-shapes", "dynamic-shapes"])
def test_onnx_export_of_the_decoder_returns_eager_outputs_caches_included(dynamic):
    """`OnnxExporter` on NezhaForUniLM (a batch with padding and both token types, as transformers' exporter checks
    give it), and on the prefill and decoding step of static-cache and growing-cache generation: the eager model's
    named outputs, `cache.layers.N.keys` / `.values` included, with its values, and the ONNX graph's own output
    names as transformers gives them for BERT's decoder."""
    torch.manual_seed(0)
    model = NezhaForUniLM(tiny_config()).eval()
    inputs = padded_batch(7, rows=3)
    assert_exported_equals_eager("onnx", model, inputs, dynamic, f"decoder, dynamic={dynamic}")
    for cache in ("static", "dynamic"):
        for part, (model, inputs) in generation_parts(cache).items():
            assert_exported_equals_eager("onnx", model, inputs, dynamic, f"{cache}-cache {part}, dynamic={dynamic}")
