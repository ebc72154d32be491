"""Model cards and remote-code export for NEZHA checkpoints.

- `build_model_card` / `write_model_card`: a `README.md` with YAML metadata (`library_name`,
  `tags` with `nezha`, `pipeline_tag`, `language`, `license`, `base_model`, evaluation results),
  from the templates in `model_cards/` (a kind from `CARD_KINDS` names one; rendered in Jinja2's sandbox with the
  card's data only), as a `huggingface_hub.ModelCard`. Every NEZHA model's `save_pretrained` and `push_to_hub`
  call it. Every value reaches the card by the rule of the place it lands in (`render_card_template`): Markdown
  text, a string literal in the usage code, a code span, the YAML header.
- `export_remote_code`: make a checkpoint folder loadable with `trust_remote_code=True` by people
  who do not install nezha_hf: the modeling file and every module it imports are copied beside the
  weights and `config.json` gets an `auto_map` entry for every Auto class.
- `save_model` / `push_model_to_hub`: what `NezhaPreTrainedModel.save_pretrained` and `push_to_hub` do
  (the upload with `huggingface_hub`'s public API).

Nothing here touches the network except `push_model_to_hub`, and only when asked.
"""

import ast
import html
import json
import os
import re
import shutil
import tempfile
import unicodedata
from importlib import resources
from pathlib import Path

from huggingface_hub import EvalResult, HfApi, ModelCard, ModelCardData
from jinja2.sandbox import ImmutableSandboxedEnvironment
from transformers.dynamic_module_utils import get_relative_import_files

from .configuration_nezha import CARD_KINDS, card_setting_problem
from .documents import read_text
from .json_files import JSON_OBJECT, read_json
from .modeling_nezha import NEZHA_HEADS, nezha_head
from .regular_files import open_regular_file
from .safe_output import staged_file, staged_files_into, write_text_atomically

CARD_MARKER = "<!-- written by nezha_hf -->"
TASK_DESCRIPTIONS = {
    "text-classification": "text classification",
    "token-classification": "token classification (tagging, NER)",
    "question-answering": "extractive question answering",
    "multiple-choice": "multiple choice",
    "feature-extraction": "feature extraction (sentence and token embeddings)",
}


def template_path(kind: str) -> Path:
    """The template file for `kind`, one of `CARD_KINDS` (converted, continued-pretraining, classifier, summarizer):
    a name, never a path."""
    if kind not in CARD_KINDS:
        raise ValueError(f"No model-card template {kind!r}: the kinds are {', '.join(CARD_KINDS)} "
                         "(model_cards/README.md).")
    return Path(str(resources.files("nezha_hf.model_cards") / f"{kind}.md"))


class WrittenForContext(str):
    """A card value already written for the place it lands in (by a filter of `CARD_CONTEXT_FILTERS`, or the YAML
    header): inserted as it is. Any other value is Markdown text (`markdown_text`)."""


# A line of a value that would start a code block: a fence (``` or ~~~ after up to 3 spaces), or an indentation of 4
# spaces or a tab (CommonMark's indented code).
CODE_BLOCK_START = re.compile(r"^( {0,3})(`{3,}|~{3,})|^(?=    |\t)", re.MULTILINE)


def markdown_text(value) -> str:
    """`value` as Markdown text (a template value with no filter): HTML's special characters as entities, so that a
    value holds no raw HTML, and no line of it starts a code block (a fence is escaped, an indented line starts
    with a space written as an entity), so that nothing a reader copies as code comes from a value. Markdown
    emphasis, lists, links and tables stay."""
    if isinstance(value, WrittenForContext):
        return value
    text = html.escape(str(value), quote=False)
    return CODE_BLOCK_START.sub(lambda m: f"{m[1]}\\{m[2]}" if m[2] else "&#32;", text)


def python_literal(value) -> WrittenForContext:
    """`value` as a Python string literal (`{{ x | python }}`, in the usage code): data there, never code."""
    literal = json.dumps(str(value), ensure_ascii=False)
    return WrittenForContext(literal if ast.literal_eval(literal) == str(value) else repr(str(value)))


def code_span(value) -> WrittenForContext:
    """`value` as a Markdown code span (`{{ x | code }}`): fenced by more backticks than it holds in a row, on one
    line."""
    text = " ".join(str(value).splitlines())
    fence = "`" * (max(map(len, re.findall("`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return WrittenForContext(f"{fence}{pad}{text}{pad}{fence}")


# The contexts a template puts a value in, besides Markdown text: each template value is a variable, alone
# (Markdown text) or through one of these filters (tests/test_hub.py checks every template).
CARD_CONTEXT_FILTERS = {"python": python_literal, "code": code_span}


def render_card_template(template: str, **data) -> str:
    """`template` (Jinja2) filled with `data` and nothing else, in Jinja2's immutable sandbox: a template reaches no
    Python internals (attribute walks to `__globals__` and the like are a `jinja2.exceptions.SecurityError`) and
    changes nothing it is given. Every value is written by the rule of its context: `markdown_text` unless a
    filter of `CARD_CONTEXT_FILTERS` wrote it (a `WrittenForContext` passes as it is)."""
    environment = ImmutableSandboxedEnvironment(finalize=markdown_text)
    environment.filters.update(CARD_CONTEXT_FILTERS)
    return environment.from_string(template).render(**data)


ONE_LINE_TEXTS = ("model_name", "task_description")  # in a heading or a sentence


def check_card_settings(settings: dict) -> None:
    """A `ValueError` naming the first model-card setting that cannot be written as what it is: `repo_id` and
    `base_model` a Hub repo id, `pipeline_tag` a known task (`configuration_nezha.card_setting_problem`), the one-line
    texts (`model_name`, `task_description`) without line breaks or control characters."""
    for name, value in settings.items():
        problem = card_setting_problem(name, value) if value is not None else None
        if name in ONE_LINE_TEXTS and any(unicodedata.category(c) in ("Cc", "Zl", "Zp") for c in str(value)):
            problem = f"{name} {value!r} is not one line of text (it holds a line break or a control character)"
        if problem:
            raise ValueError(f"Model-card setting {problem}.")


def build_model_card(architecture: str, settings: dict | None = None) -> ModelCard:
    """A model card for a checkpoint of class `architecture`.

    `settings` (all optional): `kind` (template), `model_name`, `repo_id`, `language` (default none;
    `write_model_card` and `save_model` tell it from the vocabulary, `vocabulary_languages`), `license` (default "apache-2.0"), `base_model`, `datasets`, `tags` (added to "nezha"),
    `pipeline_tag`, `eval_results` (a list of `huggingface_hub.EvalResult` or of dicts with its
    fields), and the template texts `task_description`, `training_summary`,
    `evaluation_summary`, `extra`.
    """
    settings = dict(settings or {})
    check_card_settings(settings)
    head = nezha_head(architecture)
    kind = settings.pop("kind", None) or head.card_template
    pipeline_tag = settings.pop("pipeline_tag", None) or head.pipeline_tag
    eval_results = [r if isinstance(r, EvalResult) else EvalResult(**r) for r in settings.pop("eval_results", [])]
    model_name = settings.pop("model_name", None) or settings.get("repo_id") or f"nezha-{architecture}"
    card_data = ModelCardData(
        language=settings.pop("language", None),
        license=settings.pop("license", "apache-2.0"),
        library_name="transformers",
        tags=["nezha", *(t for t in settings.pop("tags", []) if t != "nezha")],
        pipeline_tag=pipeline_tag,
        base_model=settings.get("base_model"),
        datasets=settings.pop("datasets", None),
        eval_results=eval_results or None,
        model_name=model_name if eval_results else None,
    )
    texts = {
        "model_name": model_name,
        "repo_id": settings.pop("repo_id", "path/to/this/folder"),
        "base_model_id": settings.pop("base_model", None),
        "pipeline_tag": pipeline_tag,
        "task_description": settings.pop("task_description", TASK_DESCRIPTIONS.get(pipeline_tag, pipeline_tag)),
        "training_summary": settings.pop("training_summary", "Not recorded."),
        "evaluation_summary": settings.pop("evaluation_summary", "Not recorded."),
        "extra": settings.pop("extra", ""),
    }
    if settings:
        raise ValueError(f"Unknown model-card settings: {sorted(settings)}.")
    template = template_path(kind).read_text(encoding="utf-8")
    card = ModelCard(render_card_template(template, card_data=WrittenForContext(card_data.to_yaml()), **texts))
    card.text = card.text.rstrip() + f"\n\n{CARD_MARKER}\n"
    return card


# A vocabulary with this many CJK characters reads Chinese (bert-base-chinese has about 14,000, English BERTs about 500).
CHINESE_CHARACTERS = 1000


def vocabulary_languages(folder: str | Path) -> list[str] | None:
    """The languages the `vocab.txt` in `folder` is made for, as a card's `language`: `zh` when it has over
    `CHINESE_CHARACTERS` CJK characters, `en` when most of its entries are ASCII words; None without a vocabulary."""
    path = Path(folder) / "vocab.txt"
    if not path.is_file():
        return None
    entries = [entry.removeprefix("##") for entry in read_text(path).splitlines() if entry]
    chinese = sum(len(entry) == 1 and ("\u4e00" <= entry <= "\u9fff" or "\u3400" <= entry <= "\u4dbf")
                  for entry in entries)
    words = sum(entry.isascii() and entry.isalpha() for entry in entries)
    languages = (["en"] if words > len(entries) / 2 else []) + (["zh"] if chinese > CHINESE_CHARACTERS else [])
    return languages or None


def _card_of_ours(path: Path) -> bool:
    """Whether the README at `path` is a card nezha_hf wrote (it holds `CARD_MARKER`); a README that is no regular
    file or no text is someone else's."""
    try:
        with open_regular_file(path) as file:
            return CARD_MARKER.encode() in file.read()
    except (OSError, ValueError):
        return False


def write_model_card(directory: str | Path, architecture: str, settings: dict | None = None,
                     vocabulary: str | Path | None = None) -> Path | None:
    """Write `README.md` into `directory`, unless a README not written by nezha_hf is already there. Without a
    `language` in `settings`, the card's is told by the vocabulary in `vocabulary` (default: `directory`)."""
    path = Path(directory) / "README.md"
    if os.path.lexists(path) and not _card_of_ours(path):
        return None
    if not (settings or {}).get("language"):
        settings = {**(settings or {}), "language": vocabulary_languages(vocabulary or directory)}
    write_text_atomically(path, str(build_model_card(architecture, settings)))
    return path


def remote_code_files() -> list[Path]:
    """The source files a remote-code checkpoint needs: `modeling_nezha.py` and what it imports, recursively.

    Found the way transformers finds them when it loads the checkpoint (its relative imports).
    """
    modeling_file = Path(__file__).with_name("modeling_nezha.py")
    return [modeling_file, *map(Path, get_relative_import_files(modeling_file))]


def export_remote_code(directory: str | Path) -> dict[str, str]:
    """Make the checkpoint in `directory` loadable with `trust_remote_code=True`, without nezha_hf.

    Copies `remote_code_files()` next to the weights and writes a complete `auto_map` (every Auto
    class NEZHA registers) into `config.json`. Returns the `auto_map`.
    """
    directory = Path(directory)
    for path in remote_code_files():
        with staged_file(directory / path.name, overwrite=True) as staging:  # a link is replaced, not written through
            shutil.copyfile(path, staging)
    auto_map = {"AutoConfig": "configuration_nezha.NezhaConfig"}
    auto_map.update(
        {head.auto_class: f"modeling_nezha.{head.model_class.__name__}" for head in NEZHA_HEADS if head.auto_class}
    )
    config_path = directory / "config.json"
    config = read_json(config_path, JSON_OBJECT)  # the one reader: bounded, a key given twice refused
    config["auto_map"] = auto_map
    write_text_atomically(config_path, json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return auto_map


def save_model(model, save, directory: str | Path, model_card: dict | bool = True, remote_code: bool = False) -> None:
    """What `NezhaPreTrainedModel.save_pretrained` does: `save(folder)` (transformers' own save), the model card
    and, if asked, remote code, all written into a temporary sibling of `directory` and moved in once complete
    (see `safe_output.staged_files_into`: other files in `directory` stay)."""
    directory = Path(directory)
    with staged_files_into(directory) as staging:
        save(staging)
        if model_card is not False:
            readme = directory / "README.md"
            if readme.is_file():  # the card is only (re)written when there is none, or ours
                shutil.copy(readme, staging / "README.md")
            settings = {**(getattr(model.config, "nezha_card", None) or {}),
                        **(model_card if isinstance(model_card, dict) else {})}
            vocabulary = staging if (staging / "vocab.txt").is_file() else directory  # the tokenizer saved beside
            write_model_card(staging, model.head_info.model_class.__name__, settings, vocabulary)
        if remote_code:
            export_remote_code(staging)


def push_model_to_hub(
    model, repo_id: str, *, model_card: dict | bool = True, remote_code: bool = False, commit_message=None,
    commit_description=None, private=None, token=None, revision=None, create_pr=False, max_shard_size="50GB", tags=None,
):
    """Save `model` with its NEZHA model card into a temporary folder and upload it as one commit.

    Arguments as `NezhaPreTrainedModel.push_to_hub`. Returns `huggingface_hub`'s commit info. A model sharded over
    several processes is pushed by calling this on every process: all gather the weights, the first uploads them
    (and returns the commit info; the others None).
    """
    if isinstance(model_card, dict):
        check_card_settings(model_card)  # before anything is created on the Hub
    uploads = model.should_save_on_this_rank(True)
    api = HfApi(token=token)
    if uploads:
        repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
    settings = {"repo_id": repo_id, "tags": list(tags or []), **(model_card if isinstance(model_card, dict) else {})}
    with tempfile.TemporaryDirectory() as work_dir:
        model.save_pretrained(work_dir, max_shard_size=max_shard_size, model_card=settings if model_card else False,
                              remote_code=remote_code)
        if not uploads:
            return None
        return api.upload_folder(
            repo_id=repo_id, folder_path=work_dir, commit_message=commit_message or "Upload model",
            commit_description=commit_description, revision=revision, create_pr=create_pr,
        )


__all__ = [
    "CARD_CONTEXT_FILTERS",
    "build_model_card",
    "check_card_settings",
    "export_remote_code",
    "push_model_to_hub",
    "remote_code_files",
    "render_card_template",
    "save_model",
    "template_path",
    "vocabulary_languages",
    "write_model_card",
]
