"""Model cards, uploads (through a local stand-in for the Hub client) and remote code."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from helpers import VOCAB, save_layout, small_bert, snapshot, tiny_config

import nezha_hf
from nezha_hf import (
    NezhaForMaskedLM,
    NezhaForQuestionAnswering,
    NezhaForSequenceClassification,
    NezhaForTokenClassification,
    NezhaForUniLM,
    NezhaModel,
    hub,
)
from nezha_hf.conversion import convert_bert
from nezha_hf.hub import CARD_MARKER, build_model_card

REPO = Path(__file__).resolve().parents[1]


def card_metadata(path):
    text = Path(path).read_text(encoding="utf-8")
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1]), text


def test_save_pretrained_writes_a_model_card(tmp_path):
    model = NezhaForMaskedLM(tiny_config(vocab_size=VOCAB))
    model.save_pretrained(tmp_path / "a", model_card={"license": "mit", "datasets": ["cail2020"]})
    metadata, text = card_metadata(tmp_path / "a" / "README.md")
    assert metadata["library_name"] == "transformers" and "nezha" in metadata["tags"]
    assert metadata["pipeline_tag"] == "fill-mask" and "language" not in metadata  # no vocabulary to tell it by
    assert metadata["license"] == "mit" and metadata["datasets"] == ["cail2020"]
    assert "import nezha_hf" in text
    # A README the user wrote is kept.
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "README.md").write_text("my own card")
    model.save_pretrained(tmp_path / "b")
    assert (tmp_path / "b" / "README.md").read_text() == "my own card"
    model.save_pretrained(tmp_path / "c", model_card=False)
    assert not (tmp_path / "c" / "README.md").exists()


@pytest.mark.parametrize("cls, tag", [(NezhaForSequenceClassification, "text-classification"),
                                      (NezhaForQuestionAnswering, "question-answering"),
                                      (NezhaForUniLM, "summarization"), (NezhaModel, "feature-extraction")])
def test_card_template_and_pipeline_tag_follow_the_head(cls, tag):
    card = build_model_card(cls.__name__, {"eval_results": [
        {"task_type": tag, "dataset_type": "cail2020", "dataset_name": "CAIL2020", "metric_type": "rouge",
         "metric_value": 0.5}]})
    assert card.data.pipeline_tag == tag and card.data.library_name == "transformers"
    assert "model-index" in str(card.data.to_dict()) or card.data.eval_results
    assert CARD_MARKER in card.text
    with pytest.raises(ValueError, match="Unknown model-card settings"):
        build_model_card(cls.__name__, {"licence": "typo"})


def test_converted_model_card_names_its_base_model(tmp_path):
    bert = small_bert()
    bert.config._name_or_path = "google-bert/bert-base-chinese"
    save_layout(bert, tmp_path / "bert", "safetensors")
    config = json.loads((tmp_path / "bert" / "config.json").read_text())
    config["_name_or_path"] = "google-bert/bert-base-chinese"
    (tmp_path / "bert" / "config.json").write_text(json.dumps(config))
    convert_bert(tmp_path / "bert", tmp_path / "nezha")
    metadata, text = card_metadata(tmp_path / "nezha" / "README.md")
    assert metadata["base_model"] == "google-bert/bert-base-chinese" and "Not ready for use as is" in text
    # A model fine-tuned from it keeps naming the base model.
    model = NezhaForSequenceClassification.from_pretrained(tmp_path / "nezha", num_labels=2)
    model.save_pretrained(tmp_path / "tuned")
    metadata, _ = card_metadata(tmp_path / "tuned" / "README.md")
    assert metadata["base_model"] == "google-bert/bert-base-chinese" and metadata["pipeline_tag"] == "text-classification"


class LocalHub:
    """Stands in for `huggingface_hub.HfApi`: records what would be uploaded, touches no network."""

    instances = []

    def __init__(self, token=None):
        self.token, self.repos, self.uploads = token, [], []
        LocalHub.instances.append(self)

    def create_repo(self, repo_id, private=None, exist_ok=False, **kwargs):
        self.repos.append(repo_id)
        return SimpleNamespace(repo_id=f"someone/{repo_id}")

    def upload_folder(self, repo_id, folder_path, **kwargs):
        files = {path.name: path.read_bytes() for path in Path(folder_path).iterdir()}
        self.uploads.append({"repo_id": repo_id, "files": files, **kwargs})
        return SimpleNamespace(commit_url=f"local://{repo_id}")


def test_push_to_hub_uploads_weights_config_and_card(monkeypatch):
    monkeypatch.setattr(hub, "HfApi", LocalHub)
    LocalHub.instances.clear()
    model = NezhaForTokenClassification(tiny_config(vocab_size=VOCAB, num_labels=3))
    model.push_to_hub("nezha-ner", tags=["legal"], commit_message="first", remote_code=True, token="secret")
    [api] = LocalHub.instances
    assert api.token == "secret" and api.repos == ["nezha-ner"] and len(api.uploads) == 1
    upload = api.uploads[0]
    assert upload["repo_id"] == "someone/nezha-ner" and upload["commit_message"] == "first"
    files = upload["files"]
    assert {"config.json", "model.safetensors", "README.md", "modeling_nezha.py", "relative_attention.py",
            "configuration_nezha.py", "fused_attention.py", "three_regions.py", "attention_ops.py",
            "generation_nezha.py", "loading_nezha.py", "tokenizer_cap.py", "json_files.py"} <= set(files)
    text = files["README.md"].decode()
    metadata = yaml.safe_load(text.split("---\n")[1])
    assert metadata["tags"] == ["nezha", "legal"] and metadata["pipeline_tag"] == "token-classification"
    assert "someone/nezha-ner" in text
    assert json.loads(files["config.json"])["auto_map"]["AutoModelForTokenClassification"] == (
        "modeling_nezha.NezhaForTokenClassification"
    )


def test_remote_code_loads_without_nezha_hf(tmp_path):
    torch.manual_seed(0)
    model = NezhaForMaskedLM(tiny_config(vocab_size=VOCAB)).eval()
    model.save_pretrained(tmp_path / "remote", remote_code=True)
    config = json.loads((tmp_path / "remote" / "config.json").read_text())
    expected_keys = {"AutoConfig"} | {head.auto_class for head in nezha_hf.NEZHA_HEADS if head.auto_class}
    assert set(config["auto_map"]) == expected_keys
    input_ids = torch.randint(5, VOCAB, (2, 40))
    with torch.no_grad():
        torch.save({"input_ids": input_ids, "logits": model(input_ids).logits}, tmp_path / "expected.pt")
    script = textwrap.dedent(f"""
        import sys
        sys.modules["nezha_hf"] = None  # make `import nezha_hf` fail, as where it is not installed
        sys.path = [p for p in sys.path if p not in ("", {str(REPO)!r})]
        import torch, transformers
        try:
            import nezha_hf
            raise SystemExit("nezha_hf is importable")
        except ImportError:
            pass
        path = {str(tmp_path / "remote")!r}
        expected = torch.load({str(tmp_path / "expected.pt")!r})
        model = transformers.AutoModelForMaskedLM.from_pretrained(path, trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        with torch.no_grad():
            got = model(expected["input_ids"]).logits
        print("max difference", (got - expected["logits"]).abs().max().item())
        for auto in ("AutoModel", "AutoModelForSequenceClassification", "AutoModelForQuestionAnswering",
                     "AutoModelForCausalLM"):
            getattr(transformers, auto).from_pretrained(path, trust_remote_code=True)
        generator = transformers.AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)
        print("generates", generator.generate(expected["input_ids"][:1, :5], max_new_tokens=3,
                                               eos_token_id=3, pad_token_id=0).shape[1])
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")})
    assert done.returncode == 0, done.stderr[-3000:]
    assert float(done.stdout.split("max difference ")[1].split()[0]) < 1e-6
    assert "generates 8" in done.stdout


def test_a_save_that_fails_half_way_leaves_the_folder_as_it_was(tmp_path, monkeypatch):
    torch.manual_seed(0)
    NezhaForMaskedLM(tiny_config(vocab_size=VOCAB)).save_pretrained(tmp_path / "model")
    (tmp_path / "model" / "checkpoint-5").mkdir()  # e.g. a Trainer's output folder
    before = snapshot(tmp_path / "model")

    def broken_card(*args, **kwargs):
        raise RuntimeError("the card template failed")

    monkeypatch.setattr(hub, "build_model_card", broken_card)
    with pytest.raises(RuntimeError, match="card template"):
        NezhaForMaskedLM(tiny_config(vocab_size=VOCAB, hidden_size=64)).save_pretrained(tmp_path / "model")
    assert snapshot(tmp_path / "model") == before
    assert (tmp_path / "model" / "checkpoint-5").is_dir() and [p.name for p in tmp_path.iterdir()] == ["model"]


# --- card values by the context they land in (issue 54, item 2) ----------------------------------------------------
# markdown-it-py (a CommonMark parser; transformers brings it through typer and rich) reads the cards as the Hub
# does: it is the independent reference for what a value became (text, code, raw HTML).
from huggingface_hub import ModelCard  # noqa: E402
from markdown_it import MarkdownIt  # noqa: E402

import ast  # noqa: E402

from nezha_hf.configuration_nezha import CARD_KINDS  # noqa: E402

# Values made to leave the context they are put in: Python code, a fenced block, raw HTML, a code span, a template.
HOSTILE_LINES = [
    'x", trust_remote_code=True); import os; os.system("touch /tmp/pwned"); ("',
    "x'); __import__('os').system('id'); ('",
    "<script>alert(1)</script>", "<img src=x onerror=alert(1)>", "a & b <!-- c", "`` ` ```", "{{ 7 * 7 }}", "\\",
]
HOSTILE_TEXTS = [*HOSTILE_LINES, 'x")\nimport os; os.system("touch /tmp/pwned")\n#"',
                 "```python\nimport os; os.system('id')\n```", "~~~\nrm -rf /\n~~~",
                 "intro\n\n    import os; os.system('id')\n\n\timport os", "</code></pre><script>x</script>"]
CODE_SETTINGS = ("repo_id", "base_model", "pipeline_tag")  # validated: a Hub id, a known task
TEXT_SETTINGS = ("model_name", "task_description", "training_summary", "evaluation_summary", "extra")
ONE_LINE_SETTINGS = ("model_name", "task_description")


def card_structure(card_text: str) -> tuple:
    """What a card is made of, read as CommonMark: its raw HTML, its code blocks (the Python ones as syntax trees
    with the string constants left out) and its front matter."""
    tokens = MarkdownIt("commonmark").parse(ModelCard(card_text).text)
    html = [t.content for t in tokens if t.type == "html_block"]
    html += [c.content for t in tokens if t.children for c in t.children if c.type == "html_inline"]
    code = []
    for token in tokens:
        if token.type in ("fence", "code_block"):
            tree = ast.parse(token.content) if token.info == "python" else token.content
            if token.info == "python":
                for node in ast.walk(tree):
                    if isinstance(node, ast.Constant):
                        node.value = "?"
                tree = ast.dump(tree)
            code.append((token.type, token.info, tree))
    return html, code


def python_strings(card_text: str) -> set:
    tokens = MarkdownIt("commonmark").parse(ModelCard(card_text).text)
    return {node.value for t in tokens if t.type == "fence" and t.info == "python"
            for node in ast.walk(ast.parse(t.content)) if isinstance(node, ast.Constant)}


@pytest.mark.parametrize("kind", CARD_KINDS)
@pytest.mark.parametrize("name", TEXT_SETTINGS)
def test_hostile_card_texts_stay_text(kind, name):
    """Every text setting of every card kind, with values made to become code or HTML: the card has the same raw
    HTML and the same code (as CommonMark and Python parse them) as with a plain value, and the value is still
    readable in it."""
    settings = {"kind": kind, "base_model": "owner/base", "repo_id": "owner/name"}
    plain = str(build_model_card("NezhaForSequenceClassification", {**settings, name: "plain"}))
    values = HOSTILE_LINES if name in ONE_LINE_SETTINGS else HOSTILE_TEXTS
    for value in values:
        card = str(build_model_card("NezhaForSequenceClassification", {**settings, name: value}))
        assert card_structure(card) == card_structure(plain), (name, value)
        assert "<script" not in card and "<img" not in card


@pytest.mark.parametrize("kind", CARD_KINDS)
def test_card_values_that_become_code_are_validated(kind):
    """`repo_id`, `base_model` (Hub ids) and `pipeline_tag` (a known task) reach the usage code and the metadata:
    anything else is refused, naming the setting; valid ones appear in the code as string literals."""
    for name in CODE_SETTINGS:
        for value in [*HOSTILE_TEXTS, "a/b/c", "", "../x"]:
            with pytest.raises(ValueError, match=name):
                build_model_card("NezhaForSequenceClassification", {"kind": kind, name: value})
    card = str(build_model_card("NezhaForSequenceClassification",
                                {"kind": kind, "repo_id": "owner/name", "base_model": "google-bert/bert-base-chinese",
                                 "pipeline_tag": "text-classification"}))
    assert "owner/name" in python_strings(card)
    if kind == "classifier":
        assert "text-classification" in python_strings(card)


@pytest.mark.parametrize("name", TEXT_SETTINGS[:2])
def test_one_line_card_texts_are_one_line(name):
    with pytest.raises(ValueError, match=name):
        build_model_card("NezhaForMaskedLM", {name: "a\n\n## injected"})


def test_hostile_card_metadata_round_trips_through_the_yaml():
    """Values that land in the YAML header (language, license, tags, datasets, evaluation results, the model name)
    read back as they were given, and the body after the header is the template's."""
    value = "x\n---\n<script>alert(1)</script>\n---\n: [a, {b"
    settings = {"language": [value], "license": value, "tags": [value], "datasets": [value],
                "eval_results": [{"task_type": "fill-mask", "dataset_type": value, "dataset_name": value,
                                  "metric_type": value, "metric_value": 0.5}]}
    card = build_model_card("NezhaForMaskedLM", settings)
    metadata = ModelCard(str(card)).data.to_dict()  # read back as the Hub's client reads it
    assert metadata["language"] == [value] and metadata["license"] == value and value in metadata["tags"]
    assert metadata["datasets"] == [value] and metadata["model-index"][0]["results"][0]["dataset"]["name"] == value
    assert card_structure(str(card)) == card_structure(str(build_model_card("NezhaForMaskedLM")))


def test_push_to_hub_refuses_a_hostile_card_repo_id_before_uploading(monkeypatch):
    monkeypatch.setattr(hub, "HfApi", LocalHub)
    LocalHub.instances.clear()
    model = NezhaForMaskedLM(tiny_config(vocab_size=VOCAB))
    with pytest.raises(ValueError, match="repo_id"):
        model.push_to_hub("nezha", model_card={"repo_id": 'x")\nimport os; os.system("id")\n#"'})
    assert all(not api.uploads and not api.repos for api in LocalHub.instances)


def test_hostile_card_ids_in_a_config_are_dropped_with_a_warning(tmp_path, caplog):
    """A checkpoint's `nezha_card` is data from whoever published it: ids and tags that are not ids or tags are
    dropped where the config is read, and the model still saves with a card."""
    card = {"repo_id": 'x")\nimport os\n#"', "base_model": "<script>", "pipeline_tag": "fill-mask\")\n#",
            "license": "mit"}
    config = tiny_config(vocab_size=VOCAB, nezha_card=card)
    assert config.nezha_card == {"license": "mit"} and "repo_id" in caplog.text
    NezhaForMaskedLM(config).save_pretrained(tmp_path / "m")
    assert "import os" not in (tmp_path / "m" / "README.md").read_text()


def test_every_template_value_goes_through_a_context_rule():
    """Every `{{ ... }}` of every template is a variable with no filter (Markdown text) or with one of the context
    filters; `safe` would let a value through as it is."""
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    for kind in CARD_KINDS:
        tree = ImmutableSandboxedEnvironment().parse(hub.template_path(kind).read_text(encoding="utf-8"))
        for output in tree.find_all(nodes.Output):
            for expression in output.nodes:
                if isinstance(expression, nodes.TemplateData):
                    continue
                if isinstance(expression, nodes.Filter):
                    assert expression.name in hub.CARD_CONTEXT_FILTERS, (kind, expression.name)
                    expression = expression.node
                assert isinstance(expression, nodes.Name), (kind, expression)
