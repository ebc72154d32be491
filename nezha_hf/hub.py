"""Model cards and remote-code export for NEZHA checkpoints.

- `build_model_card` / `write_model_card`: a `README.md` with YAML metadata (`library_name`,
  `tags` with `nezha`, `pipeline_tag`, `language`, `license`, `base_model`, evaluation results),
  from the templates in `model_cards/`, through `huggingface_hub.ModelCard`. Every NEZHA model's
  `save_pretrained` and `push_to_hub` call it.
- `export_remote_code`: make a checkpoint folder loadable with `trust_remote_code=True` by people
  who do not install nezha_hf: the three source files are copied beside the weights and
  `config.json` gets an `auto_map` entry for every Auto class.

Nothing here touches the network; `push_to_hub` is the only call that does, and only when asked.
"""

import json
import shutil
from importlib import resources
from pathlib import Path

from huggingface_hub import EvalResult, ModelCard, ModelCardData

CARD_MARKER = "<!-- written by nezha_hf -->"
# Files a remote-code checkpoint needs: the modeling file and its single-dot relative imports.
REMOTE_CODE_FILES = ("configuration_nezha.py", "modeling_nezha.py", "relative_attention.py")

PIPELINE_TAGS = {
    "NezhaModel": "feature-extraction",
    "NezhaForPreTraining": "fill-mask",
    "NezhaForMaskedLM": "fill-mask",
    "NezhaForNextSentencePrediction": "text-classification",
    "NezhaForSequenceClassification": "text-classification",
    "NezhaForMultipleChoice": "multiple-choice",
    "NezhaForTokenClassification": "token-classification",
    "NezhaForQuestionAnswering": "question-answering",
    "NezhaForUniLM": "summarization",
    "NezhaForSentenceExtraction": "summarization",
}
DEFAULT_TEMPLATE = {
    "NezhaForPreTraining": "continued-pretraining",
    "NezhaForMaskedLM": "continued-pretraining",
    "NezhaForUniLM": "summarizer",
    "NezhaForSentenceExtraction": "summarizer",
}
TASK_DESCRIPTIONS = {
    "text-classification": "text classification",
    "token-classification": "token classification (tagging, NER)",
    "question-answering": "extractive question answering",
    "multiple-choice": "multiple choice",
    "feature-extraction": "feature extraction (sentence and token embeddings)",
}
CARD_DATA_FIELDS = ("language", "license", "datasets", "tags", "base_model", "pipeline_tag")


def template_path(kind: str) -> Path:
    """The template file for `kind`: converted, continued-pretraining, classifier or summarizer."""
    path = resources.files("nezha_hf.model_cards") / f"{kind}.md"
    if not path.is_file():
        raise ValueError(f"No model-card template {kind!r}; see model_cards/README.md for the list.")
    return Path(str(path))


def build_model_card(architecture: str, settings: dict | None = None) -> ModelCard:
    """A model card for a checkpoint of class `architecture`.

    `settings` (all optional): `kind` (template), `model_name`, `repo_id`, `language` (default
    "zh"), `license` (default "apache-2.0"), `base_model`, `datasets`, `tags` (added to "nezha"),
    `pipeline_tag`, `eval_results` (a list of `huggingface_hub.EvalResult` or of dicts with its
    fields), and the template texts `task_description`, `training_summary`,
    `evaluation_summary`, `extra`.
    """
    settings = dict(settings or {})
    kind = settings.pop("kind", None) or DEFAULT_TEMPLATE.get(architecture, "classifier")
    pipeline_tag = settings.pop("pipeline_tag", None) or PIPELINE_TAGS.get(architecture)
    eval_results = [r if isinstance(r, EvalResult) else EvalResult(**r) for r in settings.pop("eval_results", [])]
    model_name = settings.pop("model_name", None) or settings.get("repo_id") or f"nezha-{architecture}"
    card_data = ModelCardData(
        language=settings.pop("language", "zh"),
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
    card = ModelCard.from_template(card_data, template_path=str(template_path(kind)), **texts)
    card.text = card.text.rstrip() + f"\n\n{CARD_MARKER}\n"
    return card


def write_model_card(directory: str | Path, architecture: str, settings: dict | None = None) -> Path | None:
    """Write `README.md` into `directory`, unless a README not written by nezha_hf is already there."""
    path = Path(directory) / "README.md"
    if path.exists() and CARD_MARKER not in path.read_text(encoding="utf-8"):
        return None
    build_model_card(architecture, settings).save(path)
    return path


def export_remote_code(directory: str | Path) -> dict[str, str]:
    """Make the checkpoint in `directory` loadable with `trust_remote_code=True`, without nezha_hf.

    Copies the modeling files next to the weights and writes a complete `auto_map` (every Auto
    class NEZHA registers) into `config.json`. Returns the `auto_map`.
    """
    import nezha_hf

    directory = Path(directory)
    package = Path(nezha_hf.__file__).parent
    for name in REMOTE_CODE_FILES:
        shutil.copy(package / name, directory / name)
    auto_map = {"AutoConfig": "configuration_nezha.NezhaConfig"}
    auto_map.update({auto.__name__: f"modeling_nezha.{cls.__name__}" for auto, cls in nezha_hf.AUTO_CLASSES.items()})
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["auto_map"] = auto_map
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return auto_map


__all__ = ["build_model_card", "export_remote_code", "template_path", "write_model_card"]
