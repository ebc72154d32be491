"""A downloaded checkpoint is untrusted input (issue 46): nothing read from it becomes a path, a template or code, and
every value is checked where it is read (the config, `summarizer.json`, a journal, a cache handed to the model)."""

import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch
import transformers
from helpers import VOCAB, make_tokenizer, save_layout, small_bert, tiny_config
from transformers import DynamicCache

from nezha_hf import NezhaConfig, NezhaForMaskedLM, NezhaForUniLM, NezhaModel, hub
from nezha_hf.configuration_nezha import CARD_KINDS, MAX_RELATIVE_POSITION, NezhaConfigError
from nezha_hf.conversion import convert_bert, convert_bert_hierarchical, convert_legacy_nezha, convert_tf

# A template that, rendered by a Jinja2 without a sandbox, creates a file (the path filled in per test).
CODE_TEMPLATE = ("---\n{{ card_data }}\n---\n"
                 "{{ cycler.__init__.__globals__.os.system('touch %s') }}"
                 "{{ lipsum.__globals__['os'].system('touch %s') }}\n")


def hostile_checkpoint(folder: Path, evidence: Path, kind: str) -> Path:
    """A NEZHA checkpoint that ships `card.md`, a template running code, and points its card kind at it."""
    NezhaForMaskedLM(tiny_config(vocab_size=VOCAB)).save_pretrained(folder, model_card=False)
    (folder / "card.md").write_text(CODE_TEMPLATE % (evidence, evidence), encoding="utf-8")
    config = json.loads((folder / "config.json").read_text())
    config["nezha_card"] = {"kind": kind}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def kinds_pointing_at(folder: Path) -> list[str]:
    """The ways a kind can name `folder/card.md`: absolute, `../` repeated from the templates' folder, with the
    suffix spelled, with backslashes."""
    depth = len(Path(hub.__file__).resolve().parents) + 2
    relative = "../" * depth + str((folder / "card").resolve()).lstrip("/")
    return [str(folder / "card"), relative, str(folder / "card.md")[:-3], relative.replace("/", "\\")]


@pytest.mark.parametrize("index", range(4))
def test_a_checkpoint_cannot_choose_a_card_template_that_runs_code(tmp_path, index, caplog):
    evidence = tmp_path / "evidence"
    source = hostile_checkpoint(tmp_path / "hostile", evidence, kinds_pointing_at(tmp_path / "hostile")[index])
    model = NezhaForMaskedLM.from_pretrained(source)
    model.save_pretrained(tmp_path / "saved")
    assert not evidence.exists(), "the checkpoint's template ran code"
    card = (tmp_path / "saved" / "README.md").read_text(encoding="utf-8")
    assert "os.system" not in card and "NEZHA" in card  # the package's own template for the head
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert "kind" not in (saved.get("nezha_card") or {}), "the unknown kind was carried on"


def test_the_card_kind_is_a_name_from_a_fixed_set():
    assert set(CARD_KINDS) == {"converted", "continued-pretraining", "classifier", "summarizer"}
    with pytest.raises(ValueError, match="model-card template"):
        hub.build_model_card("NezhaForMaskedLM", {"kind": "../README"})
    with pytest.raises(ValueError, match="model-card template"):
        hub.build_model_card("NezhaForMaskedLM", {"kind": "/etc/passwd"})
    for kind in CARD_KINDS:
        assert "NEZHA" in str(hub.build_model_card("NezhaForMaskedLM", {"kind": kind}))


def test_card_texts_render_as_data_in_a_sandbox(tmp_path):
    """A card's texts are inserted as they are (not templates themselves), and a template can reach nothing but its
    data: the sandbox refuses attribute walks to Python internals."""
    evidence = tmp_path / "evidence"
    text = "{{ cycler.__init__.__globals__.os.system('touch %s') }}" % evidence
    card = str(hub.build_model_card("NezhaForMaskedLM", {"extra": text, "training_summary": text}))
    assert not evidence.exists() and text in card
    with pytest.raises(Exception, match="unsafe|not safely|access"):
        hub.render_card_template(CODE_TEMPLATE % (evidence, evidence), card_data="a: 1")
    assert not evidence.exists()


def test_valid_card_settings_in_a_config_are_kept(caplog):
    card = {"kind": "classifier", "license": "mit", "tags": ["law"], "language": ["zh", "en"], "datasets": "cail2020",
            "eval_results": [{"task_type": "summarization", "dataset_type": "cail", "dataset_name": "CAIL2020",
                              "metric_type": "rouge", "metric_value": 0.5}]}
    assert NezhaConfig(**tiny_config().to_dict(), nezha_card={**card, "bogus": 1}).nezha_card == card
    assert "bogus" in caplog.text


@pytest.mark.parametrize("card", [
    {"kind": 3}, {"kind": None, "license": ["x"]}, {"tags": "nezha"}, {"eval_results": [{"task_type": 1}]},
    {"unknown": "x"}, "converted", ["kind"],
])
def test_malformed_card_settings_in_a_config_are_dropped_with_a_warning(card, caplog):
    config = NezhaConfig(**tiny_config().to_dict(), nezha_card=card)
    kept = config.nezha_card
    assert isinstance(kept, dict)
    assert all(isinstance(value, (str, list)) for value in kept.values())
    assert "nezha_card" in caplog.text


# --- converters: loader-code keys and unknown keys ----------------------------------------------------------------

LOADER_CODE = {"auto_map": {"AutoModel": "evil.Model"}, "custom_pipelines": {"evil": {"impl": "evil.Pipe"}}}


def _poisoned_bert(tmp_path, layout="safetensors"):
    source = tmp_path / "source"
    save_layout(small_bert(transformers.BertForMaskedLM), source, layout)
    config = json.loads((source / "config.json").read_text())
    config.update(LOADER_CODE, made_up_setting=7, nezha_card={"kind": "../../card"})
    (source / "config.json").write_text(json.dumps(config))
    make_tokenizer(source)
    tokenizer_config = json.loads((source / "tokenizer_config.json").read_text())
    (source / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "auto_map": {
        "AutoTokenizer": ["evil.Tokenizer", None]}}))
    return source


@pytest.mark.parametrize("convert", ["bert", "nezha", "hierarchical", "bert --remote-code", "tf"])
def test_converters_carry_no_loader_code_keys_and_report_every_key_they_drop(tmp_path, convert):
    source = _poisoned_bert(tmp_path, "gamma-beta" if convert == "nezha" else "safetensors")  # an older release's
    output = tmp_path / "out"
    if convert == "hierarchical":
        report = convert_bert_hierarchical(source, output, max_length=128)
    elif convert == "nezha":
        report = convert_legacy_nezha(source, output)
    elif convert == "tf":
        pytest.importorskip("tensorflow", reason="TensorFlow is part of the dev install (`[tf]`)")
        from test_conversion import tf_variables, write_tf_checkpoint

        write_tf_checkpoint(tf_variables(small_bert(transformers.BertForMaskedLM), "bert"), tmp_path / "tf" / "ckpt")
        report = convert_tf(tmp_path / "tf" / "ckpt", output, config_file=source / "config.json",
                            vocab_file=source / "vocab.txt")
    else:
        report = convert_bert(source, output, remote_code=convert.endswith("--remote-code"))
    written = json.loads((output / "config.json").read_text())
    assert "custom_pipelines" not in written and "made_up_setting" not in written
    if convert.endswith("--remote-code"):
        assert written["auto_map"]["AutoModel"].startswith("modeling_nezha."), "only nezha_hf's own auto_map"
    else:
        assert "auto_map" not in written
    for key in ("auto_map", "custom_pipelines", "made_up_setting"):
        assert key in report.config_dropped, f"{key} not in the report"
    assert "code" in report.config_dropped["auto_map"] and "code" in report.config_dropped["custom_pipelines"]
    assert "auto_map" in report.summary() and "custom_pipelines" in report.summary()
    assert "auto_map" not in json.loads((output / "tokenizer_config.json").read_text())
    if convert != "tf":  # the TensorFlow converter writes the tokenizer anew from vocab.txt: no config to carry
        assert "code" in report.config_dropped["tokenizer_config.json: auto_map"]
    saved_report = json.loads((output / "conversion_report.json").read_text())
    assert set(saved_report["config_dropped"]) >= {"auto_map", "custom_pipelines", "made_up_setting"}


# --- config values checked where they are read ----------------------------------------------------------------------


@pytest.mark.parametrize("value", [MAX_RELATIVE_POSITION + 1, 10**6, 10**9, 2**63 - 1])
def test_max_relative_position_is_bounded(value):
    with pytest.raises(NezhaConfigError, match="max_relative_position"):
        tiny_config(max_relative_position=value)


def test_max_relative_position_at_the_bound_builds(tmp_path):
    assert tiny_config(max_relative_position=MAX_RELATIVE_POSITION).max_relative_position == MAX_RELATIVE_POSITION


def test_an_oversized_max_relative_position_in_a_config_file_is_refused_before_any_table(tmp_path):
    NezhaModel(tiny_config()).save_pretrained(tmp_path / "m", model_card=False)
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["max_relative_position"] = 10**9
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="max_relative_position"):
        NezhaModel.from_pretrained(tmp_path / "m")


@pytest.mark.parametrize("field,value", [("pad_token_id", 99), ("bos_token_id", 500), ("eos_token_id", [3, 99]),
                                         ("pad_token_id", 2.5), ("eos_token_id", [3, True])])
def test_special_token_ids_lie_inside_the_vocabulary(field, value):
    with pytest.raises(NezhaConfigError, match=field):
        tiny_config(**{field: value})


@pytest.mark.parametrize("field,value", [("pad_token_id", -1), ("eos_token_id", -2), ("eos_token_id", [3, -1])])
def test_negative_special_token_ids_mean_no_token(field, value):
    """transformers reads a negative id as "matches no token" (its own checks set them to -1); they were refused."""
    assert getattr(tiny_config(**{field: value}), field) == value


def test_convert_refuses_an_oversized_max_relative_position_before_reading_weights(tmp_path, monkeypatch):
    source = tmp_path / "source"
    save_layout(small_bert(transformers.BertForMaskedLM), source, "safetensors")
    from nezha_hf import conversion

    monkeypatch.setattr(conversion, "read_pytorch_checkpoint", lambda *a: pytest.fail("weights read first"))
    with pytest.raises(ValueError, match="max_relative_position"):
        convert_bert(source, tmp_path / "out", max_relative_position=10**9)


# Sizes no encoder has, each alone (num_hidden_layers=20,000 took 50 s and 1.8 GB to build before a refusal), and
# sizes each within sense whose product is not (16,384-wide layers of 65,536, 512 of them: 1.6 * 10^12 parameters).
OVERSIZED = [({"num_hidden_layers": 20_000}, "num_hidden_layers"), ({"num_hidden_layers": 10**6}, "num_hidden_layers"),
             ({"hidden_size": 2**20, "num_attention_heads": 4}, "hidden_size"),
             ({"intermediate_size": 10**9}, "intermediate_size"),
             ({"hidden_size": 4096, "num_attention_heads": 2048}, "num_attention_heads"),
             ({"vocab_size": 10**9}, "vocab_size"), ({"type_vocab_size": 10**7}, "type_vocab_size"),
             ({"hidden_size": 16_384, "num_attention_heads": 128, "intermediate_size": 65_536,
               "num_hidden_layers": 512}, "parameters")]


@pytest.mark.parametrize("sizes,field", OVERSIZED)
def test_sizes_no_encoder_has_are_refused_when_the_config_is_made(sizes, field):
    with pytest.raises(NezhaConfigError, match=field):
        tiny_config(**sizes)


@pytest.mark.parametrize("sizes,field", OVERSIZED)
def test_sizes_in_a_config_file_are_refused_before_any_layer_is_built(tmp_path, monkeypatch, sizes, field):
    from nezha_hf import modeling_nezha

    NezhaModel(tiny_config()).save_pretrained(tmp_path / "m", model_card=False)
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, **sizes}))
    monkeypatch.setattr(modeling_nezha.NezhaLayer, "__init__", lambda *a, **k: pytest.fail("a layer was built"))
    with pytest.raises(ValueError, match=field):
        NezhaModel.from_pretrained(tmp_path / "m")


def test_the_largest_published_encoder_sizes_are_accepted():
    """XLM-RoBERTa XXL's shape (48 layers of 4,096, 16,384 wide, 250,002 tokens): the bounds are far from real ones."""
    config = NezhaConfig(num_hidden_layers=48, hidden_size=4096, num_attention_heads=32, intermediate_size=16_384,
                         vocab_size=250_002)
    assert config.num_hidden_layers == 48


# --- caches handed to forward / generate ----------------------------------------------------------------------------


def _decoder(**overrides):
    torch.manual_seed(0)
    return NezhaModel(tiny_config(is_decoder=True, **overrides)).eval()


def _filled_cache(model, batch=2, length=5):
    ids = torch.randint(5, 90, (batch, length))
    return model(ids, use_cache=True).cache


@pytest.mark.parametrize("other,what", [
    (dict(num_attention_heads=2), "heads"),
    (dict(hidden_size=64, num_attention_heads=4), "head size"),
    (dict(num_hidden_layers=1), "layers"),
    (dict(num_hidden_layers=3), "layers"),
    ("batch", "batch"),
])
def test_a_cache_of_another_model_is_one_value_error(other, what):
    model = _decoder()
    if other == "batch":
        cache = _filled_cache(model, batch=3)
    else:
        cache = _filled_cache(_decoder(**other))
    with pytest.raises(ValueError, match=what):
        model(torch.randint(5, 90, (2, 1)), cache=cache, use_cache=True)


def test_a_cache_of_the_same_model_still_continues_exactly():
    model = _decoder()
    ids = torch.randint(5, 90, (2, 6))
    whole = model(ids).last_hidden_state
    cache = model(ids[:, :5], use_cache=True).cache
    step = model(ids[:, 5:], cache=cache, use_cache=True).last_hidden_state
    torch.testing.assert_close(step, whole[:, 5:], atol=1e-5, rtol=0)


def test_generate_with_a_foreign_cache_is_one_value_error():
    torch.manual_seed(0)
    model = NezhaForUniLM(tiny_config(vocab_size=VOCAB)).eval()
    other = NezhaForUniLM(tiny_config(vocab_size=VOCAB, num_attention_heads=2)).eval()
    ids = torch.randint(5, VOCAB, (1, 6))
    cache = other(ids, use_cache=True).cache
    with pytest.raises(ValueError, match="heads"):
        model.generate(ids, cache=cache, max_new_tokens=2)


# --- journals: results are reused only as the results of the items they claim ----------------------------------------


def _journal_run(tmp_path, settings, keys, stop_after=None, resume=True):
    """`run_batches` over 6 items in batches of 2 with a journal; the work fails after `stop_after` batches (a kill)."""
    from nezha_hf.checkpoints import RunRecord
    from nezha_hf.distributed import processes, run_batches

    data = tmp_path / "data.txt"
    data.write_text("six items")
    calls = []

    def work(start, stop):
        if stop_after is not None and len(calls) == stop_after:
            raise KeyboardInterrupt
        calls.append(start)
        return [f"result of {keys[i]}" for i in range(start, stop)]

    record = RunRecord.create("summarize", tmp_path / "model", [data], settings)
    return run_batches(processes(), 6, 2, work, tmp_path / ".out.progress", record, keys=keys, resume=resume), calls


@pytest.fixture
def interrupted_journal(tmp_path):
    (tmp_path / "model").mkdir()
    keys = [f"j{i}" for i in range(6)]
    with pytest.raises(KeyboardInterrupt):
        _journal_run(tmp_path, {"beams": 3}, keys, stop_after=2)
    return tmp_path / ".out.progress", keys


@pytest.mark.parametrize("changed", [{"beams": 1}, {"beams": 3, "threshold": 0.4}, {}])
def test_a_journal_of_other_settings_is_refused_and_kept(tmp_path, interrupted_journal, changed):
    journal, keys = interrupted_journal
    before = {p.name: p.read_bytes() for p in journal.iterdir()}
    with pytest.raises(ValueError, match="settings differ") as refused:
        _journal_run(tmp_path, changed, keys)
    assert "--no-resume" in str(refused.value)
    assert {p.name: p.read_bytes() for p in journal.iterdir()} == before
    results, calls = _journal_run(tmp_path, changed, keys, resume=False)  # starting over, on request
    assert calls == [0, 2, 4] and results == [f"result of {k}" for k in keys]


def test_the_same_run_goes_on_from_its_journal(tmp_path, interrupted_journal):
    journal, keys = interrupted_journal
    results, calls = _journal_run(tmp_path, {"beams": 3}, keys)
    assert calls == [4] and results == [f"result of {k}" for k in keys]


@pytest.mark.parametrize("damage", ["key", "index", "index-type"])
def test_a_journal_result_that_is_not_of_its_item_is_named(tmp_path, interrupted_journal, damage):
    journal, keys = interrupted_journal
    part = journal / "done-0.jsonl"
    lines = [json.loads(line) for line in part.read_text().splitlines()]
    lines[1] = {**lines[1], **{"key": {"key": "j5"}, "index": {"index": 17}, "index-type": {"index": "1"}}[damage]}
    part.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(ValueError, match=f"{part}.*line 2"):
        _journal_run(tmp_path, {"beams": 3}, keys)


# --- summarizer.json: the same rules as the options ----------------------------------------------------------------


def _summarizer_folder(tmp_path, tokenizer):
    from nezha_hf import NezhaForSentenceExtraction
    from nezha_hf.summarization import Summarizer

    torch.manual_seed(0)
    config = tiny_config(vocab_size=VOCAB)
    folder = tmp_path / "summarizer"
    Summarizer(NezhaForSentenceExtraction(config), NezhaForUniLM(config), tokenizer).save_pretrained(folder)
    return folder


BAD_SETTINGS = [("threshold", 2), ("threshold", -0.01), ("threshold", math.nan), ("threshold", math.inf),
                ("threshold", "0.5"), ("threshold", True), ("token_budget", -5), ("token_budget", 0),
                ("token_budget", 2.5), ("num_beams", 0), ("num_beams", -1), ("num_beams", 1.0), ("num_beams", None),
                ("num_beams", 65), ("num_beams", 10**6), ("beams", 3)]


@pytest.mark.parametrize("name,value", BAD_SETTINGS)
def test_summarizer_json_is_checked_where_it_is_loaded(tmp_path, tokenizer, name, value):
    from nezha_hf.export import load_summarizer

    folder = _summarizer_folder(tmp_path, tokenizer)
    settings = json.loads((folder / "summarizer.json").read_text())
    (folder / "summarizer.json").write_text(json.dumps({**settings, name: value}))
    with pytest.raises(ValueError, match=f"summarizer.json: .*{name}"):
        load_summarizer(folder)


def test_summarizer_json_refused_on_the_command_line_in_one_line(tmp_path, tokenizer, run_cli):
    from test_nothing_lost import one_line_failure

    folder = _summarizer_folder(tmp_path, tokenizer)
    (folder / "summarizer.json").write_text(json.dumps({"threshold": 0.5, "token_budget": 100, "num_beams": 0}))
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"id": "a", "text": "原告诉称。被告辩称。"}, ensure_ascii=False) + "\n")
    one_line_failure(run_cli("summarize", folder, data, "--extract-only"), "summarizer.json", "num_beams")


def test_summarizer_settings_are_checked_when_constructed(tokenizer):
    from nezha_hf import NezhaForSentenceExtraction
    from nezha_hf.summarization import Summarizer

    config = tiny_config(vocab_size=VOCAB)
    with pytest.raises(ValueError, match="threshold"):
        Summarizer(NezhaForSentenceExtraction(config), NezhaForUniLM(config), tokenizer, threshold=math.nan)


@pytest.mark.parametrize("name,value", [("eos_token_id", VOCAB), ("eos_token_id", [3, 10**6]), ("pad_token_id", 2.5),
                                        ("bos_token_id", 2**40), ("eos_token_id", [3, "4"]), ("pad_token_id", True)])
def test_generation_ids_outside_the_vocabulary_are_refused(tmp_path, name, value):
    """A generator whose generation_config.json ends summaries at an id the model can never produce ran every summary
    to the length limit."""
    torch.manual_seed(0)
    NezhaForUniLM(tiny_config(vocab_size=VOCAB)).save_pretrained(tmp_path / "g", model_card=False)
    settings = json.loads((tmp_path / "g" / "generation_config.json").read_text())
    (tmp_path / "g" / "generation_config.json").write_text(json.dumps({**settings, name: value}))
    model = NezhaForUniLM.from_pretrained(tmp_path / "g").eval()
    with pytest.raises(ValueError, match=name):
        model.generate(torch.randint(5, VOCAB, (1, 6)), max_new_tokens=2)
    with pytest.raises(ValueError, match=name):
        NezhaForUniLM(tiny_config(vocab_size=VOCAB)).eval().generate(torch.randint(5, VOCAB, (1, 6)),
                                                                      max_new_tokens=2, **{name: value})


# --- output kinds by suffix, whatever its case -----------------------------------------------------------------------


@pytest.mark.parametrize("name,text", [("s.TXT", True), ("s.Txt", True), ("s.JSONL", False), ("s.json", False)])
def test_summaries_are_written_by_suffix_whatever_its_case(tmp_path, tokenizer, run_cli, name, text):
    """`--output S.TXT` was written as JSONL: the kind of output was decided by a case-sensitive suffix."""
    folder = _summarizer_folder(tmp_path, tokenizer)
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"id": "a", "text": "原告诉称。被告辩称。"}, ensure_ascii=False) + "\n")
    done = run_cli("summarize", folder, data, "--extract-only", "--output", tmp_path / name)
    assert done.returncode == 0, done.stderr
    written = (tmp_path / name).read_text(encoding="utf-8")
    assert written.startswith("a\n") if text else json.loads(written.splitlines()[0])["id"] == "a"


@pytest.mark.parametrize("name", ["s.csv", "s", "s.onnx"])
def test_an_unknown_summary_suffix_is_refused_before_any_work(tmp_path, tokenizer, run_cli, name):
    from test_nothing_lost import one_line_failure

    folder = _summarizer_folder(tmp_path, tokenizer)
    one_line_failure(run_cli("summarize", folder, tmp_path / "missing.jsonl", "--output", tmp_path / name), "--output",
                     ".jsonl")
    assert not (tmp_path / name).exists()


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_an_empty_cache_built_for_another_model_is_one_value_error(kind):
    """Round four's review: an unfilled cache built from another config (2 layers, into a 3-layer model) was a raw
    IndexError."""
    from transformers import StaticCache

    model = _decoder(num_hidden_layers=3)
    other = tiny_config(is_decoder=True, num_hidden_layers=2)
    cache = DynamicCache(config=other) if kind == "dynamic" else StaticCache(config=other, max_cache_len=32)
    with pytest.raises(ValueError, match="layers"):
        model(torch.randint(5, 90, (1, 4)), cache=cache, use_cache=True)


def test_a_static_cache_too_small_for_the_call_is_one_value_error():
    from transformers import StaticCache

    model = _decoder()
    cache = StaticCache(config=model.config, max_cache_len=4)
    with pytest.raises(ValueError, match="room for 4 tokens"):
        model(torch.randint(5, 90, (1, 6)), cache=cache, use_cache=True)


def test_a_static_cache_runs_on_the_meta_device():
    """The layer check read the cache's length (a tensor for a static cache: `.item()`, refused on the meta device and
    a host synchronisation on a GPU)."""
    from transformers import StaticCache

    with torch.device("meta"):
        model = _decoder()
        cache = StaticCache(config=model.config, max_cache_len=16)
        output = model(torch.zeros(1, 4, dtype=torch.long), cache=cache, use_cache=True)
    assert output.last_hidden_state.shape == (1, 4, 32)


# --- round four's review: what a loaded checkpoint names as code is not saved again; links stay in their folder ---


FOREIGN_CODE = {"auto_map": {"AutoModelForMaskedLM": "evil/repo--modeling_evil.Evil",
                             "AutoConfig": "evil/repo--configuration_evil.EvilConfig"},
                "custom_pipelines": {"evil": {"impl": "evil.Pipe"}}}


def test_code_a_checkpoint_names_is_not_saved_again(tmp_path, caplog):
    """A NEZHA checkpoint whose config.json names the publisher's code kept it through load and save, so a model
    trained from it and pushed would run that code for whoever loads it with trust_remote_code."""
    NezhaForMaskedLM(tiny_config(vocab_size=VOCAB)).save_pretrained(tmp_path / "poisoned", model_card=False)
    config = json.loads((tmp_path / "poisoned" / "config.json").read_text())
    (tmp_path / "poisoned" / "config.json").write_text(json.dumps({**config, **FOREIGN_CODE}))
    model = NezhaForMaskedLM.from_pretrained(tmp_path / "poisoned")
    assert "evil/repo--modeling_evil.Evil" in caplog.text
    model.save_pretrained(tmp_path / "plain")
    model.save_pretrained(tmp_path / "remote", remote_code=True)
    plain = json.loads((tmp_path / "plain" / "config.json").read_text())
    remote = json.loads((tmp_path / "remote" / "config.json").read_text())
    assert "auto_map" not in plain and "custom_pipelines" not in plain and "custom_pipelines" not in remote
    assert all(value.startswith(("modeling_nezha.", "configuration_nezha.")) for value in remote["auto_map"].values())


def test_nezha_hfs_own_auto_map_loads_without_a_warning(tmp_path, caplog):
    NezhaForMaskedLM(tiny_config(vocab_size=VOCAB)).save_pretrained(tmp_path / "m", remote_code=True)
    NezhaForMaskedLM.from_pretrained(tmp_path / "m")
    assert "auto_map" not in caplog.text


def test_a_tokenizer_passes_through_without_the_code_its_config_names(tmp_path, caplog):
    from nezha_hf.checkpoints import load_tokenizer

    make_tokenizer(tmp_path / "t")
    settings = json.loads((tmp_path / "t" / "tokenizer_config.json").read_text())
    (tmp_path / "t" / "tokenizer_config.json").write_text(json.dumps({**settings, "auto_map": {
        "AutoTokenizer": ["evil/repo--tok.Evil", None]}}))
    load_tokenizer(tmp_path / "t").save_pretrained(tmp_path / "saved")
    assert "auto_map" not in json.loads((tmp_path / "saved" / "tokenizer_config.json").read_text())
    assert "evil/repo--tok.Evil" in caplog.text


@pytest.mark.parametrize("linked", ["tokenizer_config.json", "vocab.txt", "sub/config.json", "nowhere"])
def test_a_link_out_of_a_model_folder_is_refused_before_anything_is_read(tmp_path, linked):
    """A BERT whose tokenizer_config.json linked to a credentials file outside it had the file's contents copied into
    the converted model (and from there pushed)."""
    secret = tmp_path / "secret.json"
    secret.write_text('{"token": "hf_SECRET"}')
    source = tmp_path / "source"
    save_layout(small_bert(transformers.BertForMaskedLM), source, "safetensors")
    make_tokenizer(source)
    link = source / linked if linked != "nowhere" else source / "vocab.txt"
    link.parent.mkdir(exist_ok=True)
    link.unlink(missing_ok=True)
    link.symlink_to(secret if linked != "nowhere" else tmp_path / "missing")
    with pytest.raises(ValueError, match="outside the model folder"):
        convert_bert(source, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_hugging_face_caches_own_links_are_allowed(tmp_path):
    """A snapshot of the Hub cache is links into its repository's blobs/: a model folder as transformers keeps it."""
    from nezha_hf.checkpoints import model_folder

    repo = tmp_path / "models--org--name"
    NezhaModel(tiny_config()).save_pretrained(tmp_path / "saved", model_card=False)
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    for file in (tmp_path / "saved").iterdir():
        blob = repo / "blobs" / file.name
        file.rename(blob)
        (snapshot / file.name).symlink_to(Path("../..") / "blobs" / file.name)
    assert model_folder(snapshot) == snapshot
    assert NezhaModel.from_pretrained(snapshot) is not None


def test_a_link_out_of_a_summariser_folder_is_one_line(tmp_path, tokenizer, run_cli):
    from test_nothing_lost import one_line_failure

    folder = _summarizer_folder(tmp_path, tokenizer)
    (tmp_path / "elsewhere.json").write_text((folder / "summarizer.json").read_text())
    (folder / "summarizer.json").unlink()
    (folder / "summarizer.json").symlink_to(tmp_path / "elsewhere.json")
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"id": "a", "text": "原告诉称。被告辩称。"}, ensure_ascii=False) + "\n")
    one_line_failure(run_cli("summarize", folder, data, "--extract-only"), "outside the model folder")


def test_converters_carry_the_tokenizer_class_config_json_names(tmp_path):
    """Round four's first fix dropped `tokenizer_class` as unknown; AutoTokenizer reads it from config.json."""
    source = _poisoned_bert(tmp_path)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "tokenizer_class": "BertTokenizer"}))
    convert_bert(source, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["tokenizer_class"] == "BertTokenizer"


def test_the_hierarchical_alpha_is_checked_before_the_weights_are_read(tmp_path, monkeypatch):
    from nezha_hf import conversion

    source = tmp_path / "source"
    save_layout(small_bert(transformers.BertForMaskedLM), source, "safetensors")
    monkeypatch.setattr(conversion, "read_pytorch_checkpoint", lambda *a: pytest.fail("weights read first"))
    with pytest.raises(ValueError, match="alpha"):
        convert_bert_hierarchical(source, tmp_path / "out", alpha=0.5000001)


def test_train_summarizer_records_the_encoding_its_judgments_were_read_with(tmp_path, tokenizer, monkeypatch):
    """A folder run that left out GBK files, resumed with --encoding gb18030, would train on other judgments with the
    checkpoints of the first: the encoding is part of the run's record."""
    from nezha_hf import summarization
    from nezha_hf.cail import Judgment

    recorded = []

    def stop(folder, record, resume):
        recorded.append(record.settings)
        raise KeyboardInterrupt

    monkeypatch.setattr(summarization, "prepare_checkpoints", stop)
    base = tmp_path / "base"
    NezhaForMaskedLM(tiny_config(vocab_size=VOCAB)).save_pretrained(base, model_card=False)
    tokenizer.save_pretrained(base)
    judgments = [Judgment(f"j{i}", ["原告诉称。", "被告辩称。"], [1, 0], "原告诉称。") for i in range(3)]
    for encoding in (None, "gb18030"):
        with pytest.raises(KeyboardInterrupt):
            summarization.train_summarizer(judgments, base, tmp_path / f"out-{encoding}", encoding=encoding)
    assert [settings["encoding"] for settings in recorded] == [None, "gb18030"]


# --- every JSON file read: bounded, checked, named (issue 54) -------------------------------------------------------

DEEP = "[" * 10_000 + "]" * 10_000  # 20 KB of brackets: the standard library's parser recurses past Python's limit


def test_deeply_nested_json_in_any_file_read_is_one_error_naming_the_file(tmp_path):
    """Issue 54 item 11: 10 KB of brackets raised `RecursionError`, naming no file, through `summarizer.json`, a
    journal's record, `trainer_state.json`, `config.json` and `generation_config.json`."""
    from nezha_hf.checkpoints import RunRecord, checkpoint_problem, prepare_checkpoints
    from nezha_hf.distributed import _journal_difference
    from nezha_hf.summarization import SETTINGS_FILE, check_export, summarizer_settings

    folder = tmp_path / "summarizer"
    folder.mkdir()
    (folder / SETTINGS_FILE).write_text(DEEP)
    with pytest.raises(ValueError, match=rf"{SETTINGS_FILE}: nests 10,000 levels"):
        summarizer_settings(folder)
    (folder / "export.json").write_text(DEEP)
    with pytest.raises(ValueError, match="export.json: nests"):
        check_export(folder)
    checkpoint = tmp_path / "run" / "checkpoint-4"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text(DEEP)
    assert "trainer_state.json: nests" in checkpoint_problem(checkpoint)
    record = RunRecord("pretrain", "base", "x", [], "y", {})
    (tmp_path / "run" / RunRecord.FILE).write_text(DEEP)
    with pytest.raises(ValueError, match=rf"{RunRecord.FILE}: nests .*--no-resume"):
        prepare_checkpoints(tmp_path / "run", record)
    journal = tmp_path / "journal"
    journal.mkdir()
    (journal / "record.json").write_text(DEEP)
    assert "record.json" in _journal_difference(journal, record)
    for name in ("config.json", "generation_config.json"):
        model = tmp_path / name
        NezhaForMaskedLM(tiny_config(vocab_size=VOCAB)).save_pretrained(model, model_card=False)
        (model / name).write_text(DEEP)
        with pytest.raises(ValueError, match=rf"{name}: nests"):
            NezhaForMaskedLM.from_pretrained(model)
    with pytest.raises(ValueError, match="config.json: nests"):  # as pretrain and train-summarizer read it
        NezhaConfig.from_pretrained(tmp_path / "config.json")
    for name in ("config.json", "tokenizer_config.json", "special_tokens_map.json"):  # what a converter reads, copies
        source = tmp_path / f"bert-{name}"
        save_layout(small_bert(transformers.BertForMaskedLM), source, "safetensors")
        make_tokenizer(source)
        (source / name).write_text(DEEP)
        with pytest.raises(ValueError, match=rf"{name}: nests"):
            convert_bert(source, tmp_path / f"out-{name}")


def test_the_json_reader_bounds_size_depth_and_kind_and_names_the_field(tmp_path):
    """A FIFO is refused (not waited on), a file over the size bound is refused before it is read, and a value of
    the wrong type or range is named by its field."""
    import os

    from nezha_hf.json_files import Integer, JSONFileError, ListOf, Object, String, read_json

    fifo = tmp_path / "state.json"
    os.mkfifo(fifo)
    with pytest.raises(JSONFileError, match="state.json: is a FIFO, not a regular file"):
        read_json(fifo)
    big = tmp_path / "big.json"
    big.write_text("[" + "0," * 1000 + "0]")
    with pytest.raises(JSONFileError, match="big.json: holds 2,003 bytes, more than the 1,000 accepted"):
        read_json(big, max_bytes=1000)
    schema = Object({"steps": ListOf(Object({"step": Integer(minimum=0)}, required=["step"])), "name": String()},
                    required=["steps"])
    shaped = tmp_path / "shaped.json"
    for text, message in [('{"steps": [{"step": 1}, {"step": "2"}]}', r"steps\[1\].step: must be a whole number"),
                          ('{"steps": [{"step": -1}]}', r"steps\[0\].step: must be a whole number from 0"),
                          ('{"name": "x"}', "steps: is missing"), ('[]', "must be a JSON object, got a list"),
                          ('{"steps": [], "x": 1}', "x: is not a key this file has"),
                          ('{"steps": [], "steps": []}', "'steps' twice"), ('', "not valid JSON")]:
        shaped.write_text(text)
        with pytest.raises(JSONFileError, match=rf"shaped.json: .*{message}"):
            read_json(shaped, schema)
    shaped.write_text('{"steps": [{"step": 3}]}')
    assert read_json(shaped, schema) == {"steps": [{"step": 3}]}
# --- paths that a file names are held to its folder (issue 54) ---------------------------------------------------


def _folder_naming(tmp_path, entry: str, index_name="model.safetensors.index.json", layout="nezha") -> Path:
    """A model folder with no weights of its own whose weight index names `entry` for every tensor, beside a
    `private/` folder holding real weights (what an index naming them would copy into an output). Entries with a
    `@` are made inside the folder: `@link` a link out to the private weights, `@fifo` a FIFO, `@device` a device
    (/dev/null's), `@folder` a folder."""
    import os
    import stat

    private, folder = tmp_path / "private", tmp_path / "hostile"
    model = NezhaForMaskedLM(tiny_config(vocab_size=VOCAB)) if layout == "nezha" else small_bert(
        transformers.BertForMaskedLM)
    model.save_pretrained(private, **({"model_card": False} if layout == "nezha" else {}))
    weights = next(private.glob("model.safetensors"))
    folder.mkdir()
    (folder / "config.json").write_text((private / "config.json").read_text())
    make_tokenizer(folder)
    name = {"@link": "link.safetensors", "@fifo": "fifo.safetensors", "@device": "device.safetensors",
            "@folder": "sub"}.get(entry, entry.replace("PRIVATE", str(weights)))
    if entry == "@link":
        (folder / name).symlink_to(weights)
    elif entry == "@fifo":
        os.mkfifo(folder / name)
    elif entry == "@device":
        os.mknod(folder / name, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    elif entry == "@folder":
        (folder / name).mkdir()
    keys = json.loads(json.dumps(list(load_safetensors(weights))))
    (folder / index_name).write_text(json.dumps({"metadata": {}, "weight_map": dict.fromkeys(keys, name)}))
    return folder


def load_safetensors(path):
    from safetensors.torch import load_file

    return load_file(path)


# Entries that name a file outside the folder, or one inside that is no regular file.
HOSTILE_ENTRIES = ["../private/model.safetensors", "PRIVATE", "sub/../../private/model.safetensors", "@link", "@fifo",
                   "@device", "@folder"]


def _within(seconds, call, folder):
    """`call()`, failing the test if it was still blocked on a FIFO of `folder` after `seconds` (reading one never
    ends): another process then opens them for writing, so that the reader sees their end and the test ends. (A
    thread of this process may never run: the reader can hold the GIL while it waits.)"""
    import subprocess

    release = subprocess.Popen([sys.executable, "-c", f"""
import os, sys, time
time.sleep({seconds})
for fifo in {[str(p) for p in folder.glob("*") if p.is_fifo()]!r}:
    for _ in range(100):
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            print(fifo, flush=True)
        except OSError:
            break
"""], stdout=subprocess.PIPE, text=True)
    try:
        return call()
    finally:
        release.kill()
        hung = sorted(set(release.communicate()[0].split()))
        assert not hung, f"still reading the FIFO {hung} after {seconds} s"


@pytest.mark.parametrize("entry", HOSTILE_ENTRIES)
def test_convert_reads_no_shard_an_index_names_outside_its_folder(tmp_path, entry):
    folder = _folder_naming(tmp_path, entry, layout="bert")
    refusal = r"model\.safetensors\.index\.json names .*it may only name regular files|is a link to .*outside the model"
    with pytest.raises(ValueError, match=refusal):
        _within(10, lambda: convert_bert(folder, tmp_path / "out"), folder)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("entry", HOSTILE_ENTRIES)
@pytest.mark.parametrize("index_name", ["model.safetensors.index.json", "pytorch_model.bin.index.json"])
def test_from_pretrained_reads_no_shard_an_index_names_outside_its_folder(tmp_path, entry, index_name):
    folder = _folder_naming(tmp_path, entry, index_name)
    # An index naming a link out: the link itself is refused first (the folder's links are checked before anything).
    refusal = rf"{re.escape(index_name)} names .*it may only name regular files|is a link to .*outside the model folder"
    with pytest.raises(ValueError, match=refusal):
        _within(10, lambda: NezhaForMaskedLM.from_pretrained(folder), folder)


@pytest.mark.parametrize("entry", ["../private/model.safetensors", "@fifo"])
def test_every_reader_of_weights_holds_an_index_to_its_folder(tmp_path, entry):
    from nezha_hf.distributed import read_weights

    folder = _folder_naming(tmp_path, entry)
    with pytest.raises(ValueError, match=r"names .*it may only name regular files"):
        _within(10, lambda: read_weights(folder), folder)


@pytest.mark.parametrize("entry", ["../private/model.safetensors", "@fifo", "@device"])
def test_convert_refuses_an_index_naming_outside_in_one_line(tmp_path, run_cli, entry):
    from test_nothing_lost import one_line_failure

    folder = _folder_naming(tmp_path, entry, layout="bert")
    done = _within(10, lambda: run_cli("convert", "bert", folder, tmp_path / "out"), folder)
    one_line_failure(done, "model.safetensors.index.json", "it may only name regular files")
    assert not (tmp_path / "out").exists()


def test_an_index_naming_its_own_shards_still_loads(tmp_path):
    """The check keeps what is right: shards named plainly, or in a subfolder of the model folder."""
    model = NezhaForMaskedLM(tiny_config(vocab_size=VOCAB))
    model.save_pretrained(tmp_path / "m", model_card=False, max_shard_size="20KB")
    index = tmp_path / "m" / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    (tmp_path / "m" / "shards").mkdir()
    for name in set(weight_map.values()):
        (tmp_path / "m" / name).rename(tmp_path / "m" / "shards" / name)
    index.write_text(json.dumps({"weight_map": {k: f"shards/{v}" for k, v in weight_map.items()}}))
    from nezha_hf.distributed import read_weights

    assert set(read_weights(tmp_path / "m")) == set(weight_map)


@pytest.mark.parametrize("entry", ["../private/tokenizer.1.0.0.json", "PRIVATE"])
def test_a_tokenizer_config_names_no_tokenizer_file_outside_its_folder(tmp_path, entry):
    """transformers reads the newest of the `fast_tokenizer_files` a tokenizer_config.json names, joined to the
    folder: a name that climbs out had a file outside read as the tokenizer."""
    from nezha_hf.checkpoints import load_tokenizer

    private, folder = tmp_path / "private", tmp_path / "t"
    make_tokenizer(private)
    make_tokenizer(folder)
    (private / "tokenizer.1.0.0.json").write_text((private / "tokenizer.json").read_text())
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["fast_tokenizer_files"] = [entry.replace("PRIVATE", str(private / "tokenizer.1.0.0.json"))]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"tokenizer_config\.json names .*it may only name regular files"):
        load_tokenizer(folder)



# What a tokenizer loader reads of a folder, each damaged as it failed on 23f309b: a FIFO hung the loader, 10 KB of
# brackets raised `RecursionError` naming no file, a key given twice took its last value without a word.
TOKENIZER_DAMAGE = {
    "tokenizer_config.json": (DEEP, r"tokenizer_config\.json: nests 10,000 levels"),
    "special_tokens_map.json": ('{"cls_token": "[CLS]", "cls_token": "[MASK]"}',
                                r"special_tokens_map\.json: .*'cls_token' twice"),
    "added_tokens.json": (DEEP, r"added_tokens\.json: nests 10,000 levels"),
    "tokenizer.json": ("@fifo", r"'tokenizer\.json', which is a FIFO"),
    "tokenizer.json vocab": ("@repeated", r"tokenizer\.json: .*'\[UNK\]' twice"),
    "chat_template.jinja": ("@fifo", r"'chat_template\.jinja', which is a FIFO"),
    "tokenizer.1.0.0.json": (DEEP, r"tokenizer\.1\.0\.0\.json: nests 10,000 levels"),
}


@pytest.mark.parametrize("damaged", TOKENIZER_DAMAGE)
def test_every_file_a_tokenizer_loader_reads_is_read_by_the_one_reader_first(tmp_path, damaged):
    """Issue 54's leftovers: `load_tokenizer` read `tokenizer_config.json` with `json.loads` itself and left the other
    files to transformers' raw reads. Each is now checked first: one `ValueError` naming the file."""
    import os

    from nezha_hf.checkpoints import load_tokenizer

    folder = tmp_path / "t"
    make_tokenizer(folder)
    name, (content, message) = damaged.split()[0], TOKENIZER_DAMAGE[damaged]
    if name == "tokenizer.1.0.0.json":
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, "fast_tokenizer_files": [name]}))
    if content == "@repeated":  # the vocabulary gives [UNK] twice, first with another token's id
        text = (folder / name).read_text()
        assert '"[UNK]":' in text
        content = text.replace('"[UNK]":', '"[UNK]": 5, "[UNK]":', 1)
    (folder / name).unlink(missing_ok=True)
    if content == "@fifo":
        os.mkfifo(folder / name)
    else:
        (folder / name).write_text(content)
    with pytest.raises(ValueError, match=message):
        _within(10, lambda: load_tokenizer(folder), folder)


def test_pretrain_names_a_damaged_tokenizer_file_in_one_line(tmp_path, tokenizer, run_cli):
    from test_nothing_lost import base_model, corpus, one_line_failure

    base, data = base_model(tmp_path / "base", tokenizer), corpus(tmp_path / "corpus")
    (base / "special_tokens_map.json").write_text(DEEP)
    done = run_cli("pretrain", base, data, "--output", tmp_path / "out", "--max-steps", "1")
    one_line_failure(done, "special_tokens_map.json", "nests 10,000 levels")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage", ["../private/model.safetensors", "@repeated", "@deep"])
def test_the_pooler_of_a_base_is_read_through_its_index_held_to_its_folder(tmp_path, damage):
    """Issue 54's leftovers: `saved_pooler` (what pretrain keeps of its base) and `add_pooler` read a weight index
    with `json.loads` and opened what it named: a file outside the folder, the last of two `weight_map`s, or
    `RecursionError` on 10 KB of brackets. Both now go through `named_files.weight_files` / `json_files.read_json`."""
    from nezha_hf.conversion import add_pooler, initialised_pooler, saved_pooler

    if damage.startswith(".."):
        folder = _folder_naming(tmp_path, damage)
        message = r"names '\.\./private/model\.safetensors', a path outside its folder"
    else:
        folder = tmp_path / "sharded"
        NezhaForMaskedLM(tiny_config(vocab_size=VOCAB)).save_pretrained(folder, model_card=False, max_shard_size="20KB")
        index = folder / "model.safetensors.index.json"
        pooler = initialised_pooler(tiny_config(vocab_size=VOCAB))
        add_pooler(folder, pooler)  # as pretrain adds it: a shard of its own, named in the index
        assert saved_pooler(folder).keys() == pooler.keys()
        text = index.read_text()
        repeated = text.replace('"weight_map":', '"weight_map": {}, "weight_map":', 1)
        index.write_text(DEEP if damage == "@deep" else repeated)
        message = (r"model\.safetensors\.index\.json: nests 10,000 levels" if damage == "@deep"
                   else r"model\.safetensors\.index\.json: .*'weight_map' twice")
    with pytest.raises(ValueError, match=message):
        saved_pooler(folder)
    if not damage.startswith(".."):
        with pytest.raises(ValueError, match=message):
            add_pooler(folder, pooler)


@pytest.mark.parametrize("damage", ["@repeated", "@deep"])
def test_export_remote_code_reads_the_config_through_the_one_reader(tmp_path, damage):
    """Issue 54's leftovers: `hub.export_remote_code` read `config.json` with `json.loads`: a key given twice was
    rewritten with its last value, without a word; 10 KB of brackets raised `RecursionError`, naming no file."""
    folder = tmp_path / "m"
    NezhaForMaskedLM(tiny_config(vocab_size=VOCAB)).save_pretrained(folder, model_card=False)
    config = folder / "config.json"
    repeated = config.read_text().replace('"hidden_size":', '"hidden_size": 8, "hidden_size":', 1)
    before = DEEP if damage == "@deep" else repeated
    config.write_text(before)
    message = r"config\.json: nests 10,000 levels" if damage == "@deep" else r"config\.json: .*'hidden_size' twice"
    with pytest.raises(ValueError, match=message):
        hub.export_remote_code(folder)
    assert config.read_text() == before

def _exported_generator(decode_kwargs, components=("prefill", "decode")):
    """What `ExportedModel.from_pretrained` gives for an exported generator whose export.json describes its decoding
    step's inputs as `decode_kwargs`; its programs must not run."""
    from types import SimpleNamespace

    def never(**_):
        pytest.fail("a program ran")

    metadata = SimpleNamespace(kwargs=decode_kwargs)
    return SimpleNamespace(components={name: SimpleNamespace(metadata=metadata) for name in components},
                           runners={name: never for name in components}, config=tiny_config(is_decoder=True),
                           generation_config=None)


STATIC = {"container": "StaticCache"}
ODD_MANIFESTS = {
    "no decode": ({"cache": STATIC, "attention_mask": {"shape": [1, 64]}}, ("prefill",), "decode"),
    "no prefill": ({"cache": STATIC, "attention_mask": {"shape": [1, 64]}}, ("decode",), "prefill"),
    "no inputs": (None, ("prefill", "decode"), "no KV cache"),
    "no cache": ({"attention_mask": {"shape": [1, 64]}}, ("prefill", "decode"), "no KV cache"),
    "no mask shape": ({"cache": STATIC, "attention_mask": {"shape": None}}, ("prefill", "decode"), "size of None"),
    "16 TB": ({"cache": STATIC, "attention_mask": {"shape": [1, 2**40]}}, ("prefill", "decode"), "size of"),
    "text": ({"cache": STATIC, "attention_mask": {"shape": [1, "64"]}}, ("prefill", "decode"), "size of '64'"),
}


@pytest.mark.parametrize("case", ODD_MANIFESTS)
def test_an_exported_generators_odd_manifest_is_one_error_naming_it_before_any_cache(case):
    """Odd exported folders ended in `KeyError: 'decode'` or `'NoneType' object is not subscriptable`, and a static
    cache size from export.json was trusted (one asked for 16 TB)."""
    from nezha_hf.summarization import generate_exported

    kwargs, components, what = ODD_MANIFESTS[case]
    generator = _exported_generator(kwargs, components)
    with pytest.raises(ValueError, match=rf"export\.json.*{re.escape(what)}"):
        generate_exported(generator, torch.ones(1, 4, dtype=torch.long), None, 4, None, 0)


def test_a_static_cache_larger_than_free_memory_is_refused_before_it_is_made(monkeypatch):
    import psutil

    from nezha_hf.summarization import generate_exported

    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("Memory", (), {"available": 2**20})())
    generator = _exported_generator({"cache": STATIC, "attention_mask": {"shape": [1, 100_000]}})
    with pytest.raises(ValueError, match="static cache of 100,000 positions .* GiB free"):
        generate_exported(generator, torch.ones(1, 4, dtype=torch.long), None, 4, None, 0)
