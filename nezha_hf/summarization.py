"""Long-judgment summarisation: extract sentences with NEZHA over the whole document, then generate.

    summarizer = load_summarizer("my-summarizer/")     # trained, or exported to ONNX: the folder says which
    summaries = summarizer.summarize(read_judgments(["judgments/"]))

Stage 1, `NezhaForSentenceExtraction`, reads the entire judgment in one pass (no 512-token
windows, unlike SPACES, which encoded one sentence at a time) and scores every sentence. The
selection keeps sentences whose probability reaches `threshold`, in document order, within a
token budget for the generator. Stage 2, `NezhaForUniLM`, writes the summary from the selected
sentences. `train_summarizer` trains both from one CAIL2020 JSONL file (labels from the file, or
from `oracle_labels` when a record has none); `summarize_files` is `nezha-hf summarize` (files in, a JSONL or text
file out, resumable); `evaluate_summaries` scores against references.

A summariser folder holds `extractor/`, `generator/`, the tokenizer and `summarizer.json` (`SETTINGS_FILE`). Its
models are PyTorch models (`train-summarizer`) or ONNX programs (`nezha-hf export onnx`, `nezha_hf.export`), run
here by `ExportedExtractor` and `ExportedGenerator` on onnxruntime; `load_summarizer` loads either kind.
"""

import contextlib
import json
import math
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import TrainingArguments
from transformers.generation import LogitsProcessor, LogitsProcessorList
from transformers.trainer_callback import PrinterCallback, ProgressCallback
from transformers.utils import logging

from .cail import Judgment, lead, oracle_labels, read_command_inputs, rouge_scores
from .checkpoints import (
    RunRecord,
    TrainingRun,
    check_links,
    check_tokenizer,
    load_tokenizer,
    model_folder,
    prepare_checkpoints,
)
from .configuration_nezha import NezhaConfig
from .distributed import claimed_by_main, cpu_only, on_main, processes, run_batches
from .extras import require_extra
from .generation_nezha import CopySpanLogitsProcessor
from .json_files import JSON_OBJECT, Anything, Integer, JSONFileError, ListOf, Object, String, read_json
from .modeling_nezha import NezhaForSentenceExtraction, NezhaForUniLM, NezhaSentenceExtractionOutput, sentence_means
from .named_files import file_in_folder
from .padding import attention_mask_for, pad_rows
from .readers import MANIFEST_FILE, MANIFEST_SCHEMA, check_manifest, check_onnx_program, first_line, write_manifest
from .safe_output import check_destination, staged_file
from .unilm import UniLMDataCollator, generate_text

logger = logging.get_logger(__name__)
EXTRACTOR_DIR, GENERATOR_DIR = "extractor", "generator"
SETTINGS_FILE = "summarizer.json"  # a summariser folder's settings (`Summarizer.settings`)
# What a summariser folder's manifest (`readers.MANIFEST_FILE`) says it is: trained, or exported to ONNX.
TRAINED_KIND, EXPORTED_KIND = "summarizer", "exported summarizer"


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
        tokenizer that is not the models' own, is an error naming it. (`load_summarizer` loads this kind and the
        exported kind alike.)"""
        directory = Path(directory)
        check_links(directory)
        saved = {**summarizer_settings(directory), **settings}
        if is_exported(directory):
            raise ValueError(f"{directory} is an exported summariser (nezha-hf export onnx): load it with "
                             "nezha_hf.summarization.load_summarizer.")
        missing = [f"{part}/config.json" for part in (EXTRACTOR_DIR, GENERATOR_DIR)
                   if not (directory / part / "config.json").is_file()]
        if missing:
            raise FileNotFoundError(f"{directory} is not a whole summariser folder: {', '.join(missing)} is missing "
                                    "(train-summarizer writes it).")
        if os.path.lexists(directory / MANIFEST_FILE):
            check_manifest(directory, TRAINED_KIND, f"Train the summariser again; if you changed its files on "
                           f"purpose, delete {MANIFEST_FILE} (they are then loaded unchecked, with a warning).")
        else:
            logger.warning(f"{directory} has no {MANIFEST_FILE} (an older nezha_hf saved it): its files cannot be "
                           "checked against what was saved. Saving it again (Summarizer.save_pretrained) writes one.")
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
        """Write the two models, the tokenizer and the settings into `directory`, then the folder's manifest
        (`readers.write_manifest`), which loading checks every file against."""
        directory = Path(directory)
        self.extractor.save_pretrained(directory / EXTRACTOR_DIR)
        self.generator.save_pretrained(directory / GENERATOR_DIR)
        self.tokenizer.save_pretrained(directory)
        save_settings(directory, self.settings())
        write_manifest(directory, TRAINED_KIND)

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
                for p, j in zip(probabilities, judgments, strict=True)]

    def summarize(self, judgments: list[Judgment], extract_only: bool = False, batch_size: int = 4,
                  show_progress: bool = False, progress=None, **generate_kwargs) -> list[dict]:
        """One result per judgment: `id`, `extracted` (sentence indices) and `summary`.

        `extract_only=True` returns the extracted sentences as the summary. `generate_kwargs` go to
        `generate` (default: `self.num_beams` beams, up to 512 new tokens, no repeated trigrams).
        `progress` (a `distributed.ItemProgress`, as `run_batches` gives it) is told each judgment's stage, each
        decoding step, and each judgment done.
        """
        selections = []
        # One at a time (the extractor reads each whole), so that each is seen to start.
        for number, judgment in enumerate(tqdm(judgments, desc="extracting", disable=not show_progress), start=1):
            if progress is not None:
                progress.stage(f"extracting {number} of {len(judgments)}")
            selections += self.extract([judgment])
            if extract_only and progress is not None:
                progress.done()
        sources = ["".join(j.sentences[i] for i in chosen) for j, chosen in zip(judgments, selections, strict=True)]
        if extract_only:
            summaries = sources
        else:
            settings = {"num_beams": self.num_beams, "max_new_tokens": 512, "no_repeat_ngram_size": 3, **generate_kwargs}
            if progress is not None:  # a long stage: each decoding step is shown
                steps = DecodingSteps(progress, len(sources), settings["max_new_tokens"])
                settings["logits_processor"] = LogitsProcessorList([*settings.get("logits_processor", []), steps])
            # One summary per source, in the sources' order (generate_text checks it): never zipped short.
            summaries = generate_text(self.generator, self.tokenizer, sources, max_source_length=self.token_budget,
                                      batch_size=batch_size, show_progress=show_progress, **settings)
            if progress is not None:  # generated together: all are done now
                for _ in judgments:
                    progress.done()
        return [{"id": j.id, "extracted": chosen, "summary": summary}
                for j, chosen, summary in zip(judgments, selections, summaries, strict=True)]


class DecodingSteps(LogitsProcessor):
    """A logits processor that changes nothing: it tells `progress` (an `ItemProgress`) each decoding step of the
    `count` summaries being generated (up to `limit` tokens), so that a long generation shows it is alive."""

    def __init__(self, progress, count: int, limit: int):
        self.progress, self.count, self.limit = progress, count, limit
        self.start = None  # the prompt's length: a shorter or equal input is the next generate call's prompt

    def __call__(self, input_ids, scores):
        if self.start is None or input_ids.shape[1] <= self.start:
            self.start = input_ids.shape[1]
        summaries = f"{self.count} summar{'y' if self.count == 1 else 'ies'}"
        self.progress.stage(f"generating {summaries}: token {input_ids.shape[1] - self.start + 1} of at most "
                            f"{self.limit}")
        return scores


def is_exported(directory: Path) -> bool:
    """Whether a summariser folder is `nezha-hf export onnx`'s (its parts ONNX programs) rather than
    `train-summarizer`'s: as its manifest says, or where that cannot be read, as its parts' files say."""
    directory = Path(directory)
    try:
        return read_json(directory / MANIFEST_FILE, MANIFEST_SCHEMA)["kind"] == EXPORTED_KIND
    except (OSError, ValueError):  # its loader names what is wrong with the manifest
        return any((directory / part / "export.json").exists() for part in (EXTRACTOR_DIR, GENERATOR_DIR))


def save_settings(directory: Path, settings: dict) -> None:
    """Write a summariser folder's `summarizer.json` (`SETTINGS_FILE`): `settings` as `Summarizer.settings` gives
    them (checked by `settings_problem`)."""
    problem = settings_problem(settings)
    if problem:
        raise ValueError(f"Summarizer: {problem}.")
    (Path(directory) / SETTINGS_FILE).write_text(json.dumps(settings))


def summarizer_settings(directory: Path) -> dict:
    """What `summarizer.json` in a summariser folder holds (`Summarizer.settings`); an error naming the file if it is
    missing or damaged."""
    path = directory / SETTINGS_FILE
    try:
        settings = read_json(path, JSON_OBJECT)
    except FileNotFoundError:
        raise FileNotFoundError(f"{directory} is not a summariser folder: it has no {SETTINGS_FILE} (train-summarizer "
                                "and export onnx write one).") from None
    except JSONFileError as error:  # the file, and the field, named
        raise ValueError(f"{error}: write the summariser again.") from None
    except OSError as error:
        raise ValueError(f"{path} cannot be read ({error.strerror or type(error).__name__}).") from None
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


# --- an exported summariser, on onnxruntime --------------------------------------------------------------------


# The longest static cache an exported generator may say it was made with (its `export.json`, data from whoever made
# the folder: one asked for 16 TB); memory is checked too, before the cache is made (`check_cache_memory`).
MAX_STATIC_CACHE = 1 << 20


def exported_cache_size(generator, where) -> int | None:
    """The static cache size the `export_for_generation` model `generator` was exported with (None for a dynamic
    cache), read from its manifest's description of its `decode` component; a `ValueError` starting with `where`
    (what names the manifest) when the manifest lacks a `prefill` or `decode` component or a cache, or gives a
    size that is no whole number from 1 to `MAX_STATIC_CACHE`."""
    components = getattr(generator, "components", None) or {}
    missing = [name for name in ("prefill", "decode") if name not in components]
    if missing:
        raise ValueError(f"{where} describes no {' or '.join(missing)} component: export the summariser again.")
    traced = getattr(components["decode"].metadata, "kwargs", None)
    if not isinstance(traced, dict) or not isinstance(traced.get("cache"), dict):
        raise ValueError(f"{where} describes no KV cache for the decode component (a generator exported from a config "
                         "saying use_cache=False): export it again from a model whose config has use_cache=True.")
    if traced["cache"].get("container") != "StaticCache":
        return None
    mask = traced.get("attention_mask")
    shape = mask.get("shape") if isinstance(mask, dict) else None
    size = shape[1] if isinstance(shape, list) and len(shape) == 2 else None  # a static cache's masks span it whole
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= MAX_STATIC_CACHE:
        raise ValueError(f"{where} gives the static cache a size of {size!r}, not a length from 1 to "
                         f"{MAX_STATIC_CACHE:,}: export the summariser again.")
    return size


def check_cache_memory(config, rows: int, size: int) -> None:
    """A `ValueError` if a static key/value cache of `size` positions for `rows` sequences of a model of `config`
    (float32) needs more memory than the machine has free, before it is made."""
    import psutil

    needed = rows * 2 * config.num_hidden_layers * size * config.hidden_size * 4
    free = psutil.virtual_memory().available
    if needed > free:
        raise ValueError(f"A static cache of {size:,} positions for {rows} sequences needs {needed / 2**30:,.1f} GiB; "
                         f"this machine has {free / 2**30:,.1f} GiB free.")


def generate_exported(generator, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, max_new_tokens: int,
                      eos_token_id: int | None, pad_token_id: int, logits_processor=None) -> torch.Tensor:
    """Greedy decoding with a `NezhaForUniLM` exported by transformers' `export_for_generation` (its `prefill` and
    `decode` components; a dynamic or a static cache, any backend): the tokens `model.generate(..., num_beams=1,
    do_sample=False)` gives with the same logits processors. Returns the prompt followed by the new tokens, as
    `generate` does.

    The prompt is the UniLM source (token type 0); decoding steps take no token types (the model treats tokens
    after its cache as targets). A `CopySpanLogitsProcessor` among the processors reads each step's copy logits.
    A static cache's size is the one it was exported with; the prompt and the new tokens must fit in it.
    """
    from transformers import DynamicCache, StaticCache

    processors = LogitsProcessorList(logits_processor or [])
    size = exported_cache_size(generator, "The exported generator's export.json")
    if size is not None:
        if input_ids.shape[1] + max_new_tokens > size:
            raise ValueError(f"The prompt ({input_ids.shape[1]} tokens) and {max_new_tokens} new tokens do not fit the "
                             f"static cache of {size} the generator was exported with.")
        check_cache_memory(generator.config, input_ids.shape[0], size)
        cache = StaticCache(config=generator.config, max_cache_len=size)
    else:
        cache = DynamicCache(config=generator.config)

    def mask_for(mask):
        return mask if size is None else nn.functional.pad(mask, (0, size - mask.shape[1]))

    attention_mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    out = generator.runners["prefill"](input_ids=input_ids, attention_mask=mask_for(attention_mask),
                                       token_type_ids=torch.zeros_like(input_ids), cache=cache)
    sequences, unfinished = input_ids, torch.ones(input_ids.shape[0], dtype=torch.bool)
    for _ in range(max_new_tokens):
        for processor in processors:
            if isinstance(processor, CopySpanLogitsProcessor):
                processor.read_copy_logits(None, None, out)
        token = processors(sequences, out.logits[:, -1].float()).argmax(-1)
        token = torch.where(unfinished, token, torch.full_like(token, pad_token_id))
        sequences = torch.cat([sequences, token[:, None]], 1)
        attention_mask = torch.cat([attention_mask, torch.ones_like(token[:, None])], 1)
        if eos_token_id is not None:
            unfinished &= token != eos_token_id
        if not unfinished.any():
            break
        out = generator.runners["decode"](input_ids=token[:, None], attention_mask=mask_for(attention_mask),
                                          cache=out.cache)
    return sequences


@contextlib.contextmanager
def programs_of(folder):
    """What onnxruntime raises while running the programs of the exported part `folder` (in the block) as a
    `ValueError` naming the folder: its own messages name no file."""
    try:
        yield
    except Exception as error:
        if type(error).__module__.startswith("onnxruntime"):
            raise ValueError(f"The ONNX programs in {folder} fail to run ({first_line(error)}): export the summariser "
                             "again.") from None
        raise


class ExportedExtractor:
    """An exported extractor (`nezha_hf.export.TokenScores`: per-token scores) where `Summarizer` takes the extractor:
    called like the model, it returns the sentence logits the model returns. `folder` is where it was loaded from
    (named in errors)."""

    device = torch.device("cpu")

    def __init__(self, exported, folder=None):
        self.exported, self.config, self.folder = exported, exported.config, folder

    def eval(self):
        return self

    def __call__(self, input_ids, attention_mask, sentence_ids):
        with programs_of(self.folder):
            scores = self.exported(input_ids=input_ids, attention_mask=attention_mask)
        logits, _ = sentence_means(scores, sentence_ids, int(sentence_ids.max().clamp(min=0)) + 1)
        return NezhaSentenceExtractionOutput(logits=logits)


class ExportedGenerator:
    """A `NezhaForUniLM` exported by transformers' `export_for_generation`, where `Summarizer` takes the model:
    `generate` decodes greedily (`generate_exported`), with no repeated n-grams and, for a generator with a copy
    head, the SPACES copy constraint, as the model's own `generate` would."""

    device = torch.device("cpu")

    def __init__(self, exported, folder=None):
        self.exported, self.config, self.generation_config = exported, exported.config, exported.generation_config
        self.folder = folder

    def generate(self, input_ids, attention_mask=None, token_type_ids=None, max_new_tokens: int = 20, num_beams: int = 1,
                 no_repeat_ngram_size: int = 0, eos_token_id=None, pad_token_id=None, copy_constraint: bool | None = None,
                 do_sample: bool = False, num_return_sequences: int = 1, logits_processor=None):
        """Greedy decoding (`num_beams=1`, `do_sample=False`) of the prompt `input_ids` (all source): one sequence
        per prompt row, in the rows' order."""
        from transformers.generation import NoRepeatNGramLogitsProcessor

        if num_beams != 1 or do_sample or num_return_sequences != 1:
            raise ValueError("An exported generator decodes greedily, one sequence per source: pass num_beams=1, "
                             "do_sample=False and num_return_sequences=1.")
        eos = self.generation_config.eos_token_id if eos_token_id is None else eos_token_id
        pad = self.generation_config.pad_token_id if pad_token_id is None else pad_token_id
        processors = [NoRepeatNGramLogitsProcessor(no_repeat_ngram_size)] if no_repeat_ngram_size else []
        processors += list(logits_processor or [])  # as `generate` takes them (e.g. `DecodingSteps`)
        if copy_constraint if copy_constraint is not None else self.config.unilm_copy_tags:
            special = {t for t in (pad, eos, self.generation_config.bos_token_id) if t is not None}
            processors.append(CopySpanLogitsProcessor.for_prompt(input_ids, attention_mask, special))
        with programs_of(self.folder):
            return generate_exported(self.exported, input_ids, attention_mask, max_new_tokens, eos, pad, processors)


# What `check_export` reads of `ExportedModel.save_pretrained`'s manifest; the rest is transformers' to read.
EXPORT_MANIFEST_SCHEMA = Object({"export_format": String(max_length=64),
                                 "components": Object({}, others=Object({"file": String()}, required=["file"],
                                                                        others=Anything()))},
                                required=["export_format", "components"], others=Anything())


def check_export(folder: Path) -> None:
    """An error naming what a folder `ExportedModel.save_pretrained` wrote lacks (its manifest, a program file it
    names, its config), before transformers would look the folder up on the model hub. The manifest is data from
    whoever made the folder: it must name ONNX programs (what `export_summarizer` writes; other formats can run code
    when loaded) by plain file names inside the folder."""
    from transformers.exporters.auto import get_exporter_class

    manifest_path = folder / "export.json"
    try:
        manifest = read_json(manifest_path, EXPORT_MANIFEST_SCHEMA)
        files = [name for entry in manifest["components"].values()
                 for name in get_exporter_class(manifest["export_format"]).program_files(entry["file"])]
    except FileNotFoundError:
        raise FileNotFoundError(f"{manifest_path} is missing: export the summariser again.") from None
    except JSONFileError as error:
        raise ValueError(f"{error}: export the summariser again.") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"{manifest_path} is damaged ({type(error).__name__}): export the summariser again.") from None
    if manifest["export_format"] != "onnx":
        raise ValueError(f"{manifest_path} names {manifest['export_format']!r} programs; an exported summariser holds "
                         "ONNX programs (nezha-hf export onnx).")
    for name in [*files, "config.json"]:
        if file_in_folder(folder, name, manifest_path, must_exist=False) is None:
            raise FileNotFoundError(f"{folder / name} is missing: export the summariser again.")
    for name in files:
        if name.endswith(".onnx"):
            check_onnx_program(folder / name, folder)
    for name in ("config.json", "generation_config.json"):  # bounded before transformers reads them
        if (folder / name).is_file():
            read_json(folder / name, JSON_OBJECT)


def load_exported_summarizer(directory, **settings) -> Summarizer:
    """The summariser `export_summarizer` wrote, running on onnxruntime: `.summarize(judgments)` as usual (greedy).
    `settings` override those of its `summarizer.json`; more than one beam is refused (an exported generator decodes
    greedily). A missing or damaged part is an error naming it."""
    require_extra("onnx", "Running an exported summariser")
    from transformers.exporters import ExportedModel

    directory = Path(directory)
    check_links(directory)
    saved = {**summarizer_settings(directory), **settings}
    if saved.get("num_beams", Summarizer.num_beams) != 1:
        raise ValueError(f"{directory} is an exported summariser, which decodes greedily: it cannot use "
                         f"{saved['num_beams']} beams (pass 1, or run the trained summariser).")
    check_manifest(directory, EXPORTED_KIND, "Export the summariser again (nezha-hf export onnx).")
    parts = {}
    for part in (EXTRACTOR_DIR, GENERATOR_DIR):
        check_export(directory / part)
        try:
            parts[part] = ExportedModel.from_pretrained(directory / part)
        except Exception as error:  # a manifest of another shape, a program onnxruntime refuses
            raise ValueError(f"{directory / part} does not load ({type(error).__name__}: {first_line(error)}): "
                             "export the summariser again.") from None
    if parts[GENERATOR_DIR].generation_config is None:
        raise FileNotFoundError(f"{directory / GENERATOR_DIR / 'generation_config.json'} is missing: export the "
                                "summariser again.")
    exported_cache_size(parts[GENERATOR_DIR], directory / GENERATOR_DIR / "export.json")
    summarizer = Summarizer(ExportedExtractor(parts[EXTRACTOR_DIR], directory / EXTRACTOR_DIR),
                            ExportedGenerator(parts[GENERATOR_DIR], directory / GENERATOR_DIR),
                            load_tokenizer(directory), **saved)
    summarizer.check(directory)
    return summarizer


def load_summarizer(directory, **settings) -> Summarizer:
    """A summariser folder of either kind: `train-summarizer`'s (`Summarizer.from_pretrained`) or
    `nezha-hf export onnx`'s (`load_exported_summarizer`). `settings` override those of its `summarizer.json`."""
    if is_exported(directory):
        return load_exported_summarizer(directory, **settings)
    return Summarizer.from_pretrained(directory, **settings)


# --- the `summarize` command: files in, one file out ------------------------------------------------------------


SUMMARY_SUFFIXES = (".jsonl", ".json", ".txt")  # what `summarize_files` writes: JSONL, or text for .txt


@dataclass
class SummarizedFiles:
    """What `summarize_files` did: a result per judgment (`Summarizer.summarize`'s), in input order, and how many
    input files it left out (each named in a warning when it was found)."""

    results: list[dict]
    left_out: int


def result_schema(judgment: Judgment) -> Object:
    """What `Summarizer.summarize` gives for `judgment` (a `json_files` schema): its `id`, the indices of its
    sentences `extracted`, and the `summary` text; a journal's result is checked against it before it is reused."""
    return Object({"id": String(max_length=1 << 16), "extracted": ListOf(Integer(0, len(judgment.sentences) - 1)),
                   "summary": String(max_length=1 << 24)}, required=["id", "extracted", "summary"])


# Where `str.splitlines` breaks a line (`\r\n` once): an id or a summary holding one would shift every following line
# of a text output.
LINE_BREAKS = re.compile("\r\n|[\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029]")
# The line breaks `json.dumps(..., ensure_ascii=False)` leaves as they are (it escapes the others), as JSON escapes.
JSON_RAW_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def summaries_text(results: list[dict], text: bool = False) -> str:
    """Results of `Summarizer.summarize` as JSONL (one `{id, extracted, summary}` a line, every line break inside
    escaped, so that any reader finds one line per result) or, with `text`, as text (each id on a line, its summary
    on the next, a blank line between). A text summary's line breaks (`LINE_BREAKS`) are each replaced by a space,
    said once in a warning with the count; ids with one are refused before (`summarize_files`)."""
    if not text:
        return "".join(json.dumps(r, ensure_ascii=False).translate(JSON_RAW_BREAKS) + "\n" for r in results)
    blocks, breaks = [], []
    for r in results:
        summary, count = LINE_BREAKS.subn(" ", r["summary"])
        blocks.append(f"{r['id']}\n{summary}")
        breaks.append(count)
    if sum(breaks):
        logger.warning(f"{sum(map(bool, breaks))} of {len(results)} summaries held line breaks ({sum(breaks)} in all): "
                       "in the text output each is written as a space, one summary per line (JSONL, .jsonl, keeps "
                       "them).")
    return "\n\n".join(blocks) + "\n"


def write_summaries(output: Path, results: list[dict], overwrite: bool) -> None:
    """`summaries_text` of `results` into `output` (text for `.txt`, else JSONL), written beside it and renamed into
    place only once read back with as many lines as it should have (`str.splitlines`'s count: an id line, a summary
    line and a blank line per result in text, one line per result in JSONL), each in its place."""
    text = output.suffix.lower() == ".txt"
    with staged_file(output, overwrite) as staging:
        staging.write_text(summaries_text(results, text), encoding="utf-8")
        lines = staging.read_bytes().decode("utf-8").splitlines()
        expected = 3 * len(results) - 1 if text else len(results)
        ids = lines[::3] if text else [json.loads(line).get("id") for line in lines]
        if len(lines) != expected or ids != [r["id"] for r in results]:
            raise RuntimeError(f"{output} would have {len(lines)} lines for {len(results)} summaries, not {expected} "
                               "each in its place: nothing written.")


def summarize_files(summarizer_dir, inputs, output=None, *, overwrite: bool = False, resume: bool = True,
                    extract_only: bool = False, batch_size: int = 4, threshold: float | None = None,
                    token_budget: int | None = None, num_beams: int | None = None, copy_constraint: bool | None = None,
                    max_new_tokens: int = 512, max_characters: int | None = None, encoding: str | None = None,
                    show_progress: bool = True) -> SummarizedFiles | None:
    """`nezha-hf summarize`: summarise the judgments in `inputs` (`.txt` files, folders, JSONL: `cail.read_judgments`)
    with the summariser folder `summarizer_dir` (either kind: `load_summarizer`) into `output`.

    `output` is a JSONL file (`.jsonl`, `.json`) or text (`.txt`): checked (never an input, nor inside one; replaced
    only with `overwrite`) before any input is read, and written whole at the end. Finished batches are kept beside it
    (`.<name>.progress/`), so that a rerun after a kill goes on from there when nothing it depends on changed
    (`resume=False` starts over); the batches are shared out among the processes of a multi-process launch. Without
    `output` nothing is written (the caller prints the results: `summaries_text`).

    `threshold`, `token_budget`, `num_beams` override the summariser's own settings (None keeps them);
    `copy_constraint=False` decodes freely even if the generator has a copy head; `extract_only` gives the extracted
    sentences as the summary. `max_characters` and `encoding`: as `cail.read_command_inputs` takes them.

    Returns a `SummarizedFiles` on the main process, None on the others.
    """
    state = processes()
    summarizer_dir = model_folder(summarizer_dir, SETTINGS_FILE)
    if output is not None:
        output = check_destination(output, [summarizer_dir, *inputs], overwrite, kind="file")
        if output.suffix.lower() not in SUMMARY_SUFFIXES:
            raise ValueError(f"--output {output}: summaries are written as JSONL (.jsonl, .json) or text (.txt)")
    judgments, left_out = read_command_inputs(inputs, max_characters, encoding)
    if output is not None and output.suffix.lower() == ".txt":
        broken = next((j for j in judgments if LINE_BREAKS.search(j.id)), None)
        if broken is not None:
            raise ValueError(f"--output {output}: the id {broken.id!r} ({broken.source}) holds a line break, which "
                             "would shift every following line of a text file: write JSONL (.jsonl) instead, or "
                             "rename the input.")
    settings = {key: value for key, value in (("threshold", threshold), ("token_budget", token_budget),
                                              ("num_beams", num_beams)) if value is not None}
    summarizer = load_summarizer(summarizer_dir, **settings)
    options = {"max_new_tokens": max_new_tokens}
    if copy_constraint is not None:
        options["copy_constraint"] = copy_constraint

    def summarize(start, stop, progress):
        return summarizer.summarize(judgments[start:stop], extract_only=extract_only, batch_size=batch_size,
                                    progress=progress, **options)

    journal = output.with_name(f".{output.name}.progress") if output is not None else None
    record = RunRecord.create("summarize", summarizer_dir, inputs, {
        **summarizer.settings(), **options, "extract_only": extract_only, "batch_size": batch_size,
        "encoding": encoding})
    with claimed_by_main(state, *([output] if output is not None else [])):
        results = run_batches(state, len(judgments), batch_size, summarize, journal, record,
                              keys=[j.id for j in judgments], resume=resume, show_progress=show_progress,
                              unit="judgments", result_schema=lambda index: result_schema(judgments[index]),
                              item_progress=True)
        if not state.is_main_process:
            return None
        if output is not None:
            write_summaries(output, results, overwrite)
            shutil.rmtree(journal)
    return SummarizedFiles(results, left_out)


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
    data_files = list(dict.fromkeys(re.sub(r":\d+$", "", j.source) for j in judgments if j.source))  # in order
    run = TrainingRun("train-summarizer", base_model, data_files, output_dir, overwrite)
    with run.claimed():
        return _train_summarizer(run, judgments, base_model, validation_fraction, epochs,
                                 {"extractor": extractor_steps, "generator": generator_steps}, max_length,
                                 copy_mechanism, seed, show_progress, resume, encoding, training_arguments)


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


def _train_summarizer(run, judgments, base_model, validation_fraction, epochs, stage_steps, max_length, copy_mechanism,
                      seed, show_progress, resume, encoding, training_arguments) -> dict:
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
    record = run.record({"validation_fraction": validation_fraction, "max_length": max_length,
                         "copy_mechanism": copy_mechanism, "seed": seed, "encoding": encoding}, settings)
    on_main(run.state, lambda: prepare_checkpoints(run.checkpoints, record, resume))
    metrics = {}
    global_batch = record.settings["global_batch"]

    def train_stage(name, model, collator, make_examples, steps, label_names):
        if steps is None:
            steps = max(1, math.ceil(epochs * len(train) / global_batch))
            plan = f"{epochs:g} epochs of {len(train)} judgments"
        else:
            plan = f"{steps * global_batch / len(train):.3g} epochs of {len(train)} judgments"
        if run.state.is_main_process:
            logger.warning(f"Training the {name}: {steps} steps ({plan}).")
        trainer = run.trainer(
            model=model, data_collator=collator, train_dataset=make_examples(train),
            eval_dataset=make_examples(validation) if validation else None,
            args=TrainingArguments(str(run.checkpoints / name), max_steps=steps, label_names=label_names, **settings))
        if show_progress:
            trainer.remove_callback(ProgressCallback)
            trainer.add_callback(StageProgress(name))
        else:  # with its progress bar off, Trainer would print every log line instead
            trainer.remove_callback(PrinterCallback)
        run.train(trainer, run.last_checkpoint(name))
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
    with run.staged_output() as staging:
        if run.state.is_main_process:
            # Before the summariser: its save writes the folder's manifest last, over every file.
            (staging / "validation_ids.json").write_text(json.dumps([j.id for j, _ in validation]))
            Summarizer(extractor.eval(), generator.eval(), tokenizer,
                       token_budget=max_length // 2).save_pretrained(staging)
    return metrics


# --- evaluation ------------------------------------------------------------------------------


def evaluate_summaries(judgments: list[Judgment], predictions: dict[str, str] | None = None,
                       units=("char", "word"), lead_count: int = 3, predictions_file=None) -> dict:
    """Mean ROUGE-1/2/L F and CAIL score of each system against the references, per tokenisation unit.

    Systems: `lead-N` (floor), `oracle` (greedy oracle extraction: a ceiling for extraction),
    `labelled` (the file's own labels, when present) and, if given, `predictions` (id -> summary, e.g. from
    `cail.read_predictions`). A judgment with a reference and no prediction, or a prediction whose id no judgment
    has, is a `ValueError` naming a few (and `predictions_file`, the file they were read from).
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
        where = f"{predictions_file}: " if predictions_file is not None else ""
        missing = [j.id for j in scored if j.id not in predictions]
        if missing:
            raise ValueError(f"{where}no prediction for {len(missing)} judgment(s), e.g. {missing[:3]}.")
        known = {j.id for j in judgments}
        foreign = [identifier for identifier in predictions if identifier not in known]
        if foreign:
            raise ValueError(f"{where}{len(foreign)} prediction(s) for ids none of the {len(judgments)} judgment(s) "
                             f"has, e.g. {foreign[:3]}: predictions of other judgments, or ids changed on the way.")
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
