"""Long-judgment summarisation: extract sentences with NEZHA over the whole document, then generate.

    summarizer = Summarizer.from_pretrained("my-summarizer/")
    summaries = summarizer.summarize(read_judgments(["judgments/"]))

Stage 1, `NezhaForSentenceExtraction`, reads the entire judgment in one pass (no 512-token
windows, unlike SPACES, which encoded one sentence at a time) and scores every sentence. The
selection keeps sentences whose probability reaches `threshold`, in document order, within a
token budget for the generator. Stage 2, `NezhaForUniLM`, writes the summary from the selected
sentences. `train_summarizer` trains both from one CAIL2020 JSONL file (labels from the file, or
from `oracle_labels` when a record has none); `evaluate_summaries` scores against references.
"""

import json
import math
import random
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import TrainingArguments
from transformers.trainer_callback import PrinterCallback, ProgressCallback
from transformers.utils import logging

from .cail import Judgment, lead, oracle_labels, rouge_scores
from .checkpoints import (
    RunRecord,
    check_links,
    check_tokenizer,
    StopWhenNotFinite,
    last_complete_checkpoint,
    load_tokenizer,
    prepare_checkpoints,
)
from .configuration_nezha import NezhaConfig
from .modeling_nezha import NezhaForSentenceExtraction, NezhaForUniLM
from .padding import attention_mask_for, pad_rows
from .pretraining import resumed_settings
from .distributed import (
    DistributedCheckpointTrainer,
    claimed_by_main,
    cpu_only,
    on_main,
    processes,
    shared_staged_folder,
)
from .safe_output import check_destination
from .unilm import UniLMDataCollator, generate_text

logger = logging.get_logger(__name__)
EXTRACTOR_DIR, GENERATOR_DIR = "extractor", "generator"


# --- stage 1: extraction ---------------------------------------------------------------------


def encode_document(tokenizer, sentences: list[str], max_length: int | None = None) -> dict[str, list[int]]:
    """`[CLS] sentence tokens ... [SEP]` with the sentence index of every token (-1 on special tokens).

    `max_length=None` keeps the whole document (NEZHA has no length cap); otherwise the sentences
    that do not fit are dropped, with a warning.
    """
    input_ids, sentence_ids = [tokenizer.cls_token_id], [-1]
    # One batched tokenizer call for the whole document, not one call per sentence.
    encoded = tokenizer(sentences, add_special_tokens=False, verbose=False)["input_ids"] if sentences else []
    for index, ids in enumerate(encoded):
        ids = ids or [tokenizer.unk_token_id]
        if max_length is not None and len(input_ids) + len(ids) + 1 > max_length:
            logger.warning(f"Document cut at sentence {index} of {len(sentences)} to fit max_length={max_length}.")
            break
        input_ids += ids
        sentence_ids += [index] * len(ids)
    return {"input_ids": input_ids + [tokenizer.sep_token_id], "sentence_ids": sentence_ids + [-1]}


class ExtractionCollator:
    """Pads encoded documents (`input_ids`, `sentence_ids`, optional `labels`) into a batch."""

    def __init__(self, tokenizer):
        self.pad_id = tokenizer.pad_token_id

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        ids = [f["input_ids"] for f in features]
        batch = {
            "input_ids": pad_rows(ids, self.pad_id),
            "attention_mask": attention_mask_for(ids),
            "sentence_ids": pad_rows([f["sentence_ids"] for f in features], -1),
        }
        if "labels" in features[0]:
            batch["labels"] = pad_rows([f["labels"] for f in features], -100)
        return batch


def extraction_labels(judgment: Judgment) -> list[int]:
    """The judgment's own labels, else the greedy oracle's (needs a reference summary)."""
    if judgment.labels is not None:
        return list(judgment.labels)
    if judgment.summary is None:
        raise ValueError(f"{judgment.id}: no labels and no summary to derive them from.")
    return oracle_labels(judgment.sentences, judgment.summary)


def sentence_probabilities(model, tokenizer, judgments: list[Judgment], batch_size: int = 1,
                           show_progress: bool = False) -> list[list[float]]:
    """Extraction probability of every sentence of every judgment (whole documents, one pass each)."""
    collator, results = ExtractionCollator(tokenizer), []
    model.eval()
    for start in tqdm(range(0, len(judgments), batch_size), desc="extracting", disable=not show_progress):
        chunk = judgments[start : start + batch_size]
        batch = collator([encode_document(tokenizer, j.sentences) for j in chunk])
        with torch.no_grad():
            logits = model(**{k: v.to(model.device) for k, v in batch.items()}).logits.float()
        for row, judgment in enumerate(chunk):
            scores = logits[row, : len(judgment.sentences)]
            if not bool(scores.isfinite().all()):
                raise ValueError(f"The extractor's scores for {judgment.id} are not finite: the model is broken "
                                 "(non-finite weights, e.g. from a training run that diverged).")
            results.append(torch.sigmoid(scores).tolist())
    return results


def select_sentences(probabilities: list[float], sentences: list[str], tokenizer=None, threshold: float = 0.5,
                     token_budget: int | None = None) -> list[int]:
    """Indices (document order) of sentences with probability >= `threshold`, at least the best one.

    With `token_budget` (and a tokenizer), the most probable of those are kept until their tokens
    would exceed the budget: the generator's source length.
    """
    ranked = sorted(range(len(probabilities)), key=lambda i: -probabilities[i])
    chosen = [i for i in ranked if probabilities[i] >= threshold] or ranked[:1]
    if token_budget is not None:
        kept, used = [], 0
        for index in chosen:
            size = len(tokenizer(sentences[index], add_special_tokens=False, verbose=False)["input_ids"])
            if used + size > token_budget and kept:
                break
            kept.append(index)
            used += size
        chosen = kept
    return sorted(chosen)


# --- the two stages together -----------------------------------------------------------------


@dataclass
class Summarizer:
    """An extractor, a generator and their tokenizer, saved side by side in one folder."""

    extractor: NezhaForSentenceExtraction
    generator: NezhaForUniLM
    tokenizer: object
    threshold: float = 0.5
    token_budget: int = 1000
    num_beams: int = 3  # beam search by default; an exported summariser decodes greedily (1)

    def __post_init__(self):
        problem = settings_problem(self.settings())
        if problem:
            raise ValueError(f"Summarizer: {problem}.")

    @classmethod
    def from_pretrained(cls, directory: str | Path, **settings) -> "Summarizer":
        """Load the summariser folder `train-summarizer` wrote: the models `extractor/` and `generator/`, their
        tokenizer and `summarizer.json`, whose settings `settings` override. A part that is missing or damaged, or a
        tokenizer that is not the models' own, is an error naming it. (`nezha_hf.export.load_summarizer` loads this
        kind and the exported kind alike.)"""
        directory = Path(directory)
        check_links(directory)
        saved = {**summarizer_settings(directory), **settings}
        if is_exported(directory):
            raise ValueError(f"{directory} is an exported summariser (nezha-hf export onnx): load it with "
                             "nezha_hf.export.load_summarizer.")
        missing = [f"{part}/config.json" for part in (EXTRACTOR_DIR, GENERATOR_DIR)
                   if not (directory / part / "config.json").is_file()]
        if missing:
            raise FileNotFoundError(f"{directory} is not a whole summariser folder: {', '.join(missing)} is missing "
                                    "(train-summarizer writes it).")
        summarizer = cls(NezhaForSentenceExtraction.from_pretrained(directory / EXTRACTOR_DIR).eval(),
                         NezhaForUniLM.from_pretrained(directory / GENERATOR_DIR).eval(),
                         load_tokenizer(directory), **saved)
        summarizer.check(directory)
        return summarizer

    def check(self, directory) -> None:
        """A `ValueError` unless the tokenizer is both models' own and the generator ends a summary at its [SEP]."""
        for part, model in ((EXTRACTOR_DIR, self.extractor), (GENERATOR_DIR, self.generator)):
            check_tokenizer(self.tokenizer, model.config, Path(directory) / part)
        end = self.generator.generation_config.eos_token_id
        if end != self.tokenizer.sep_token_id:
            raise ValueError(f"The generator of {directory} ends a summary at token {end}, not at its tokenizer's [SEP] "
                             f"({self.tokenizer.sep_token_id}): it is not the generator train-summarizer wrote with "
                             "this tokenizer.")

    def save_pretrained(self, directory: str | Path) -> None:
        """Write the two models, the tokenizer and the settings into `directory`."""
        directory = Path(directory)
        self.extractor.save_pretrained(directory / EXTRACTOR_DIR)
        self.generator.save_pretrained(directory / GENERATOR_DIR)
        self.tokenizer.save_pretrained(directory)
        (directory / "summarizer.json").write_text(json.dumps(self.settings()))

    def settings(self) -> dict:
        """What `summarizer.json` holds: the extraction threshold, the generator's source budget, the beams."""
        return {"threshold": self.threshold, "token_budget": self.token_budget, "num_beams": self.num_beams}

    def extract_probabilities(self, judgments: list[Judgment], show_progress: bool = False) -> list[list[float]]:
        """The extractor's probability of every sentence of every judgment."""
        return sentence_probabilities(self.extractor, self.tokenizer, judgments, show_progress=show_progress)

    def extract(self, judgments: list[Judgment], show_progress: bool = False) -> list[list[int]]:
        """Selected sentence indices per judgment."""
        probabilities = self.extract_probabilities(judgments, show_progress)
        return [select_sentences(p, j.sentences, self.tokenizer, self.threshold, self.token_budget)
                for p, j in zip(probabilities, judgments)]

    def summarize(self, judgments: list[Judgment], extract_only: bool = False, batch_size: int = 4,
                  show_progress: bool = False, **generate_kwargs) -> list[dict]:
        """One result per judgment: `id`, `extracted` (sentence indices) and `summary`.

        `extract_only=True` returns the extracted sentences as the summary. `generate_kwargs` go to
        `generate` (default: `self.num_beams` beams, up to 512 new tokens, no repeated trigrams).
        """
        selections = self.extract(judgments, show_progress)
        sources = ["".join(j.sentences[i] for i in chosen) for j, chosen in zip(judgments, selections)]
        if extract_only:
            summaries = sources
        else:
            settings = {"num_beams": self.num_beams, "max_new_tokens": 512, "no_repeat_ngram_size": 3, **generate_kwargs}
            summaries = generate_text(self.generator, self.tokenizer, sources, max_source_length=self.token_budget,
                                      batch_size=batch_size, show_progress=show_progress, **settings)
        return [{"id": j.id, "extracted": chosen, "summary": summary}
                for j, chosen, summary in zip(judgments, selections, summaries)]


def is_exported(directory: Path) -> bool:
    """Whether a summariser folder is `nezha-hf export onnx`'s (its parts ONNX programs) rather than
    `train-summarizer`'s."""
    return (Path(directory) / EXTRACTOR_DIR / "export.json").is_file()


def summarizer_settings(directory: Path) -> dict:
    """What `summarizer.json` in a summariser folder holds (`Summarizer.settings`); an error naming the file if it is
    missing or damaged."""
    path = directory / "summarizer.json"
    try:
        settings = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{directory} is not a summariser folder: it has no summarizer.json (train-summarizer "
                                "and export onnx write one).") from None
    except (OSError, ValueError) as error:
        raise ValueError(f"{path} is damaged ({type(error).__name__}): write the summariser again.") from None
    if not isinstance(settings, dict):
        raise ValueError(f"{path} is damaged (not a JSON object): write the summariser again.")
    problem = settings_problem(settings)
    if problem:
        raise ValueError(f"{path}: {problem}. Correct the file, or write the summariser again.")
    return settings


SETTINGS = ("threshold", "token_budget", "num_beams")  # what `Summarizer.settings` (summarizer.json) holds
# Beams beyond this buy nothing for summaries and multiply the generator's memory (a cache per beam): a downloaded
# summarizer.json asking for a million is refused, not run out of memory.
MAX_BEAMS = 64


def settings_problem(settings: dict) -> str | None:
    """What is wrong with summariser settings (`summarizer.json`, or `Summarizer`'s fields), or None: the same rules
    as `nezha-hf summarize`'s options. `threshold` a probability in [0, 1]; `token_budget` and `num_beams` whole
    numbers of at least 1, `num_beams` at most `MAX_BEAMS`; no other keys."""
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        return f"unknown settings {', '.join(unknown)} (a summariser has {', '.join(SETTINGS)})"
    threshold = settings.get("threshold", 0.5)
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 <= threshold <= 1:
        return f"threshold must be a probability in [0, 1], got {threshold!r}"
    for name in ("token_budget", "num_beams"):
        value = settings.get(name, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return f"{name} must be a whole number of at least 1, got {value!r}"
    if settings.get("num_beams", 1) > MAX_BEAMS:
        return f"num_beams must be at most {MAX_BEAMS}, got {settings['num_beams']}"
    return None


def extractor_from(base_model) -> NezhaForSentenceExtraction:
    """A `NezhaForSentenceExtraction` to train, with `base_model`'s encoder. A masked-LM checkpoint has a head the
    extractor does not use (`cls.*`) and no sentence scorer (`classifier.*`, which starts untrained): said in one
    line, instead of transformers' table of unexpected and missing keys; anything else missing or left over is a
    warning naming it."""
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        model, info = NezhaForSentenceExtraction.from_pretrained(base_model, output_loading_info=True)
    finally:
        logging.set_verbosity(verbosity)
    unexpected = sorted(key for key in info["unexpected_keys"] if not key.startswith("cls."))
    missing = sorted(key for key in info["missing_keys"] if not key.startswith("classifier."))
    if unexpected or missing:
        logger.warning(f"Loading the extractor from {base_model}: left over {unexpected}, missing (random) {missing}.")
    else:
        logger.info(f"The extractor starts from {base_model}'s encoder, with an untrained sentence scorer.")
    return model


def train_summarizer(
    judgments: list[Judgment],
    base_model: str | Path,
    output_dir: str | Path,
    validation_fraction: float = 0.1,
    epochs: float = 3.0,
    extractor_steps: int | None = None,
    generator_steps: int | None = None,
    max_length: int = 1024,
    copy_mechanism: bool = False,
    seed: int = 42,
    show_progress: bool = True,
    overwrite: bool = False,
    resume: bool = True,
    encoding: str | None = None,
    **training_arguments,
) -> dict:
    """Train both stages from judgments with reference summaries; save a `Summarizer` in `output_dir`.

    `base_model` is a NEZHA checkpoint with its tokenizer (masked-LM or converted BERT). The
    extractor learns the file's labels (or oracle labels); the generator learns to write the
    summary from the labelled sentences, as in SPACES (at most `max_length` tokens of source plus
    summary). Each stage trains `epochs` passes over the training judgments (one per step and process), unless
    `extractor_steps` / `generator_steps` say how many steps; a line says how many before each stage, and its
    progress bar is named after it. A `validation_fraction` of the judgments (rounded; none when that is under one
    judgment, which a line says) is held out and evaluated after each stage; a fraction that leaves nothing to train
    on is an error.
    Trainer checkpoints go to the sibling folder `<output_dir>.checkpoints/` (`extractor/`,
    `generator/`); a rerun resumes each stage from its last complete checkpoint, if the checkpoints are of
    the same run (base model, data, settings: `checkpoints.prepare_checkpoints`; `resume=False` starts over).
    A loss or weights that stop being finite end the run (`checkpoints.NotFiniteError`). The summariser is
    written beside `output_dir` and renamed into place at the end; an existing non-empty
    `output_dir` is replaced only with `overwrite=True`, and it may not be the base model's folder.
    `copy_mechanism=True` gives the generator the SPACES copy head (`unilm_copy_tags`), trained
    jointly on `copy_tags` labels; its `generate()` then keeps copied spans on source n-grams.
    `encoding` is the one the judgments were read with (`read_judgments`), recorded with the run: it decides which
    files of a folder could be read, so a resume with another is refused.
    Returns the validation metrics.
    """
    state = processes()
    data_files = list(dict.fromkeys(re.sub(r":\d+$", "", j.source) for j in judgments if j.source))  # in order
    output_dir = check_destination(output_dir, [base_model, *data_files], overwrite)
    checkpoints = output_dir.with_name(output_dir.name + ".checkpoints")
    check_destination(checkpoints, [base_model], overwrite=True)
    with claimed_by_main(state, output_dir, checkpoints):
        return _train_summarizer(state, judgments, base_model, output_dir, checkpoints, data_files,
                                 validation_fraction, epochs, {"extractor": extractor_steps, "generator": generator_steps},
                                 max_length, copy_mechanism, seed, show_progress, overwrite, resume, encoding,
                                 training_arguments)


def validation_split(count: int, fraction: float) -> int:
    """How many of `count` judgments `fraction` holds out for validation: rounded, so none when that is under one
    (said in a line); a `ValueError` when it would leave none to train on."""
    held = round(count * fraction)
    if fraction > 0 and held == 0:
        logger.warning(f"No validation: {fraction:g} of {count} judgments is less than one; all {count} train "
                       "(--validation-fraction 0 says so).")
    if held >= count:
        raise ValueError(f"A validation fraction of {fraction:g} holds out {held} of the {count} judgments and leaves "
                         "none to train on: pass a smaller --validation-fraction.")
    return held


class StageProgress(ProgressCallback):
    """Trainer's progress bar, named after the stage it counts (`extractor`, `generator`)."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def on_train_begin(self, args, state, control, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        if self.training_bar is not None:
            self.training_bar.set_description(self.name)


def _train_summarizer(state, judgments, base_model, output_dir, checkpoints, data_files, validation_fraction,
                      epochs, stage_steps, max_length, copy_mechanism, seed, show_progress, overwrite,
                      resume, encoding, training_arguments) -> dict:
    usable = [j for j in judgments if j.summary]
    if len(usable) < 2:
        raise ValueError("train_summarizer needs at least two judgments with a reference summary.")
    held = validation_split(len(usable), validation_fraction)
    # Labels once per judgment: both stages use them, and oracle labels are costly.
    labelled = [(j, extraction_labels(j)) for j in usable]
    random.Random(seed).shuffle(labelled)
    validation, train = labelled[:held], labelled[held:]
    tokenizer = load_tokenizer(base_model)
    check_tokenizer(tokenizer, NezhaConfig.from_pretrained(base_model), base_model)

    def examples_for_extraction(items):
        return [{**encode_document(tokenizer, j.sentences), "labels": labels} for j, labels in items]

    def examples_for_generation(items):
        return [{"source": "".join(s for s, label in zip(j.sentences, labels) if label) or lead(j.sentences),
                 "target": j.summary} for j, labels in items]

    defaults = dict(per_device_train_batch_size=1, learning_rate=5e-5, logging_steps=10, save_steps=500,
                    save_total_limit=1, report_to=[], seed=seed, disable_tqdm=not show_progress,
                    remove_unused_columns=False, use_cpu=cpu_only())
    settings = {**defaults, **training_arguments}
    resumed = resumed_settings(settings, state.num_processes)
    record = RunRecord.create("train-summarizer", base_model, data_files, {
        "validation_fraction": validation_fraction, "max_length": max_length, "copy_mechanism": copy_mechanism,
        "seed": seed, "encoding": encoding, **resumed})
    on_main(state, lambda: prepare_checkpoints(checkpoints, record, resume))
    metrics = {}

    global_batch = resumed["global_batch"]

    def train_stage(name, model, collator, make_examples, steps, label_names):
        if steps is None:
            steps = max(1, math.ceil(epochs * len(train) / global_batch))
            plan = f"{epochs:g} epochs of {len(train)} judgments"
        else:
            plan = f"{steps * global_batch / len(train):.3g} epochs of {len(train)} judgments"
        if state.is_main_process:
            logger.warning(f"Training the {name}: {steps} steps ({plan}).")
        trainer = DistributedCheckpointTrainer(
            model=model, data_collator=collator, train_dataset=make_examples(train),
            eval_dataset=make_examples(validation) if validation else None,
            args=TrainingArguments(str(checkpoints / name), max_steps=steps, label_names=label_names, **settings),
            callbacks=[StopWhenNotFinite()])
        if show_progress:
            trainer.remove_callback(ProgressCallback)
            trainer.add_callback(StageProgress(name))
        else:  # with its progress bar off, Trainer would print every log line instead
            trainer.remove_callback(PrinterCallback)
        last = on_main(state, lambda: last_complete_checkpoint(checkpoints / name))
        trainer.train(resume_from_checkpoint=str(last) if last else None)
        if validation:
            metrics[f"{name}_eval_loss"] = trainer.evaluate()["eval_loss"]
        return model

    extractor = train_stage("extractor", extractor_from(base_model),
                            ExtractionCollator(tokenizer), examples_for_extraction, stage_steps["extractor"], ["labels"])
    # Trainer would look for every label the head takes (copy_labels too) and, not finding them, compute no loss.
    # A cache whatever the base says (a model trained by Trainer may say use_cache=False): the generator decodes.
    generator = train_stage("generator", NezhaForUniLM.from_pretrained(base_model, unilm_copy_tags=copy_mechanism,
                                                                       use_cache=True),
                            UniLMDataCollator(tokenizer, max_length=max_length, truncation="middle",
                                              copy_labels=copy_mechanism),
                            examples_for_generation, stage_steps["generator"],
                            ["labels", "copy_labels"] if copy_mechanism else ["labels"])
    generator.generation_config.eos_token_id = tokenizer.sep_token_id
    generator.generation_config.pad_token_id = tokenizer.pad_token_id
    generator.generation_config.bos_token_id = tokenizer.cls_token_id  # never a copy candidate
    generator.generation_config.use_cache = True
    with shared_staged_folder(state, output_dir, overwrite) as staging:
        if state.is_main_process:
            Summarizer(extractor.eval(), generator.eval(), tokenizer,
                       token_budget=max_length // 2).save_pretrained(staging)
            (staging / "validation_ids.json").write_text(json.dumps([j.id for j, _ in validation]))
    return metrics


# --- evaluation ------------------------------------------------------------------------------


def evaluate_summaries(judgments: list[Judgment], predictions: dict[str, str] | None = None,
                       units=("char", "word"), lead_count: int = 3) -> dict:
    """Mean ROUGE-1/2/L F and CAIL score of each system against the references, per tokenisation unit.

    Systems: `lead-N` (floor), `oracle` (greedy oracle extraction: a ceiling for extraction),
    `labelled` (the file's own labels, when present) and, if given, `predictions` (id -> summary, e.g. from
    `cail.read_predictions`). A judgment with a reference and no prediction, or a prediction whose id no judgment
    has, is a `ValueError` naming a few.
    """
    scored = [j for j in judgments if j.summary]
    if not scored:
        raise ValueError(f"None of the {len(judgments)} judgment(s) has a reference summary to score against.")
    systems = {f"lead-{lead_count}": {j.id: lead(j.sentences, lead_count) for j in scored},
               "oracle": {j.id: "".join(s for s, k in zip(j.sentences, oracle_labels(j.sentences, j.summary)) if k)
                          for j in scored}}
    if all(j.labels is not None for j in scored):
        systems["labelled"] = {j.id: "".join(s for s, k in zip(j.sentences, j.labels) if k) for j in scored}
    if predictions is not None:
        missing = [j.id for j in scored if j.id not in predictions]
        if missing:
            raise ValueError(f"No prediction for {len(missing)} judgment(s), e.g. {missing[:3]}.")
        known = {j.id for j in judgments}
        foreign = [identifier for identifier in predictions if identifier not in known]
        if foreign:
            raise ValueError(f"{len(foreign)} prediction(s) for ids none of the {len(judgments)} judgment(s) has, e.g. "
                             f"{foreign[:3]}: predictions of other judgments, or ids changed on the way.")
        systems["predictions"] = {j.id: predictions[j.id] for j in scored}
    results = {"documents": len(scored), "systems": {}}
    for name, outputs in systems.items():
        results["systems"][name] = {}
        for unit in units:
            rows = [rouge_scores(outputs[j.id], j.summary, unit) for j in scored]
            results["systems"][name][unit] = {key: sum(r[key] for r in rows) / len(rows) for key in rows[0]}
    return results


# What each system of `evaluate_summaries` is, for the legend under its table.
SYSTEM_MEANINGS = {
    "lead": "the judgment's first sentences (a floor)",
    "oracle": "the judgment's sentences that best match the reference (a ceiling for any extraction)",
    "labelled": "the sentences the data file labels as summary sentences",
    "predictions": "the summaries given with --predictions",
}
UNIT_MEANINGS = {"char": "ROUGE over characters", "word": "ROUGE over jieba words"}


def format_scores(results: dict) -> str:
    """A Markdown table of `evaluate_summaries` results, with a legend of its systems and units."""
    count = results["documents"]
    lines = [f"{count} document{'s' if count != 1 else ''}; F scores (`rouge` package); "
             "CAIL = 0.2 R1 + 0.4 R2 + 0.4 RL", "",
             "| system | unit | ROUGE-1 | ROUGE-2 | ROUGE-L | CAIL |", "|---|---|---|---|---|---|"]
    for name, by_unit in results["systems"].items():
        for unit, s in by_unit.items():
            lines.append(f"| {name} | {unit} | {s['rouge-1']:.4f} | {s['rouge-2']:.4f} | {s['rouge-l']:.4f} | {s['cail']:.4f} |")
    lines.append("")
    for name in results["systems"]:
        lines.append(f"{name}: {SYSTEM_MEANINGS[name.split('-')[0]]}")
    units = {unit for by_unit in results["systems"].values() for unit in by_unit}
    lines.append("; ".join(f"{unit}: {UNIT_MEANINGS[unit]}" for unit in sorted(units)))
    return "\n".join(lines)
