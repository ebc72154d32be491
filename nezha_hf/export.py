"""Export NEZHA encoders to ONNX for serving, checked with onnxruntime before the file is put in place.

    from nezha_hf.export import export_onnx
    report = export_onnx("my-nezha/", "my-nezha.onnx")     # or: nezha-hf export onnx my-nezha/ my-nezha.onnx

The graph is made by PyTorch's dynamo exporter (`torch.onnx.export(..., dynamo=True)`) with a dynamic
batch size and length, and takes `input_ids`, `attention_mask` and `token_type_ids`. ONNX has no
NEZHA attention, so the attention is written in standard ONNX operations by `onnx_attention`: queries in
chunks (an ONNX `Scan`), linear memory, the relative terms as key and value shifts and one gather per chunk
(docs/serving.md: how it compares with BERT in onnxruntime). Importing this module registers that graph
with the exporters (`onnx_attention.register_onnx_attention`), transformers' included.
Needs `pip install "nezha_hf[onnx]"` (onnx, onnxscript, onnxruntime).
"""

import contextlib
import copy
import io
import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .checkpoints import model_folder
from .extras import require_extra
from .json_files import Anything, ListOf, Nullable, Object, String, read_json
from .modeling_nezha import (
    NezhaForMultipleChoice,
    NezhaForSentenceExtraction,
    NezhaForUniLM,
    NezhaPreTrainedModel,
)
from .readers import write_manifest
from .relative_attention import Engine
from .safe_output import check_destination, staged_file, staged_folder
from .summarization import (
    EXPORTED_KIND,
    EXTRACTOR_DIR,
    GENERATOR_DIR,
    SETTINGS_FILE,
    ExtractionCollator,
    Summarizer,
    encode_document,
    load_exported_summarizer,
    load_summarizer,  # its home is summarization; importable here too, where it was first documented
    save_settings,
    summarizer_settings,
)

try:  # without the [onnx] extra there is nothing to register; the export functions say what to install
    from .onnx_attention import register_onnx_attention
except ImportError:
    pass
else:
    register_onnx_attention()

INPUT_NAMES = ("input_ids", "attention_mask", "token_type_ids")
# What `export_onnx` reads of a model folder's config before loading it: the head it names.
ARCHITECTURES = Object({"architectures": Nullable(ListOf(String(max_length=200)))}, others=Anything())
# The engine an exported copy runs: an op (`attention_ops.engine_op`) the exporters write as `onnx_attention`'s graph.
EXPORTED_ENGINE = Engine.CHUNKED
# Heads whose inputs are not the three above, or that generate: not exported.
NOT_EXPORTED = (NezhaForUniLM, NezhaForSentenceExtraction)
VERIFY_LENGTHS = (16, 80)


@dataclass
class OnnxExport:
    """What `export_onnx` wrote and how it checked it."""

    path: str
    architecture: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    max_difference: float  # largest |onnxruntime - PyTorch| over the verification batches
    verified_lengths: tuple[int, ...]

    def summary(self) -> str:
        return (f"Exported {self.architecture} to {self.path} (inputs {', '.join(self.inputs)}; outputs "
                f"{', '.join(self.outputs)}); onnxruntime matches PyTorch to {self.max_difference:.1e} on padded "
                f"batches of {' and '.join(map(str, self.verified_lengths))} tokens.")


class _Outputs(nn.Module):
    """The model with a fixed tuple of named outputs, which is what an ONNX graph returns."""

    def __init__(self, model: NezhaPreTrainedModel, names: tuple[str, ...]):
        super().__init__()
        self.model, self.names = model, names

    def forward(self, input_ids, attention_mask, token_type_ids):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        return tuple(out[name] for name in self.names)


# Where the exporters' own notes come from: torch.onnx ("torchvision is not installed. Skipping torchvision::nms"),
# onnxscript (type names it cannot resolve), torch.export; their warnings about PyTorch's internals (a deprecated
# `LeafSpec` check, axis names merged) concern PyTorch's developers, not the user of an export. transformers'
# exporters (the summariser's) add that they are experimental, the versions they were tested with, and how to
# export faster: every export here is checked against PyTorch before it is written, which is what the user needs.
EXPORTER_LOGGERS = ("torch.onnx", "onnxscript", "torch.export", "torch._export", "transformers.exporters")
EXPORTER_WARNINGS = r"(torch|onnxscript|onnx_ir|copyreg)(\.|$)"


@contextlib.contextmanager
def exporter_notes_held_back():
    """While exporting: the exporters' warnings and log lines below errors held back (`EXPORTER_LOGGERS`,
    `EXPORTER_WARNINGS`), and what they print on standard output (torch.onnx's `[torch.onnx] Run decompositions...`
    steps, which transformers' exporter does not turn off); errors, and every line of nezha_hf, still show."""
    # Two of transformers' exporter modules name their loggers after their files, not under `transformers.exporters`.
    files = [name for name in list(logging.Logger.manager.loggerDict)
             if "/transformers/exporters/" in name.replace(os.sep, "/")]
    loggers = [logging.getLogger(name) for name in (*EXPORTER_LOGGERS, *files)]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            for category in (UserWarning, FutureWarning, DeprecationWarning):
                warnings.filterwarnings("ignore", category=category, module=EXPORTER_WARNINGS)
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _example(model, batch: int, length: int, seed: int) -> dict[str, torch.Tensor]:
    """A padded batch (the second row padded from the middle) of valid ids and token types."""
    generator = torch.Generator().manual_seed(seed)
    shape = (batch, 2, length) if isinstance(model, NezhaForMultipleChoice) else (batch, length)
    input_ids = torch.randint(0, model.config.vocab_size, shape, generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, ..., length // 2 :] = 0
    token_type_ids = torch.randint(0, model.config.type_vocab_size, shape, generator=generator)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids}


def _load(model_or_path) -> NezhaPreTrainedModel:
    """The model to export, on `EXPORTED_ENGINE` and in eval mode (a model object is copied, and keeps its own)."""
    if isinstance(model_or_path, NezhaPreTrainedModel):
        # A copy of the config: `_from_config` would otherwise switch the caller's model's attention too.
        model = type(model_or_path)._from_config(copy.deepcopy(model_or_path.config),
                                                 attn_implementation=EXPORTED_ENGINE.value)
        model.load_state_dict(model_or_path.state_dict())
        return model.eval()
    from .modeling_nezha import nezha_head

    path = model_folder(model_or_path)
    architectures = read_json(path / "config.json", ARCHITECTURES).get("architectures") or ["NezhaModel"]
    head = nezha_head(architectures[0])
    return head.model_class.from_pretrained(path, attn_implementation=EXPORTED_ENGINE.value).eval()


def export_onnx(model_or_path, output: str | os.PathLike, atol: float = 1e-4, overwrite: bool = False) -> OnnxExport:
    """Export a NEZHA encoder to an ONNX file, verified with onnxruntime before it is moved to `output`.

    Args:
        model_or_path: a `NezhaPreTrainedModel`, or a folder saved with `save_pretrained` (any encoder
            head: `NezhaModel`, masked LM, pretraining, sequence / token classification, next-sentence
            prediction, question answering, multiple choice).
        output: the `.onnx` file to write. It is written beside its destination and renamed into place
            only after onnxruntime has reproduced PyTorch's outputs within `atol` on padded batches.
        atol: largest allowed absolute difference between onnxruntime and PyTorch.
        overwrite: replace an existing `output` (otherwise that is an error).

    Returns:
        An `OnnxExport` with what was written and the largest difference measured.
    """
    output = Path(output)
    if output.suffix.lower() != ".onnx":
        raise ValueError(f"The ONNX file's name should end in .onnx, got {output}.")
    sources = [] if isinstance(model_or_path, NezhaPreTrainedModel) else [model_or_path]
    check_destination(output, sources, overwrite=overwrite, kind="file")
    require_extra("onnx", "ONNX export")
    import onnxruntime

    model = _load(model_or_path)
    if isinstance(model, NOT_EXPORTED):
        raise ValueError(f"{type(model).__name__} is not exported to ONNX (it generates, or takes other inputs); "
                         "export one of the encoder heads.")
    example = _example(model, 2, VERIFY_LENGTHS[0], seed=0)
    with torch.no_grad():
        reference = model(**example)
    names = tuple(name for name, value in reference.items() if isinstance(value, torch.Tensor))
    wrapped = _Outputs(model, names).eval()
    batch, length = torch.export.Dim("batch", min=1), torch.export.Dim("length", min=2)
    axes = {0: batch, 2: length} if isinstance(model, NezhaForMultipleChoice) else {0: batch, 1: length}
    with staged_file(output, overwrite) as draft, exporter_notes_held_back():
        torch.onnx.export(wrapped, tuple(example[name] for name in INPUT_NAMES), str(draft), dynamo=True,
                          input_names=list(INPUT_NAMES), output_names=list(names), verbose=False,
                          dynamic_shapes=tuple(axes for _ in INPUT_NAMES), external_data=False)
        session = onnxruntime.InferenceSession(str(draft), providers=["CPUExecutionProvider"])
        largest = 0.0
        for seed, check_length in enumerate(VERIFY_LENGTHS):
            inputs = _example(model, 3, check_length, seed=seed + 1)
            with torch.no_grad():
                expected = wrapped(**inputs)
            got = session.run(list(names), {name: value.numpy() for name, value in inputs.items()})
            largest = max([largest, *(float(abs(torch.from_numpy(g) - e).max()) for g, e in zip(got, expected))])
        if not largest <= atol:
            raise ValueError(f"The ONNX graph differs from PyTorch by {largest:.2e} (more than {atol:.0e}); nothing written.")
    return OnnxExport(str(output), type(model).__name__, INPUT_NAMES, names, largest, VERIFY_LENGTHS)


# --- summarisers: the extractor and the generator through transformers' exporters -------------------------


class TokenScores(nn.Module):
    """A `NezhaForSentenceExtraction` up to its per-token scores (`[batch, length]`): what is exported, so that the
    graph has no data-dependent sentence count; `summarization.ExportedExtractor` pools them (`sentence_means`)."""

    def __init__(self, extractor: NezhaForSentenceExtraction):
        super().__init__()
        self.extractor = extractor

    def forward(self, input_ids, attention_mask):
        hidden = self.extractor.nezha(input_ids, attention_mask=attention_mask).last_hidden_state
        return self.extractor.classifier(hidden).squeeze(-1)


# Judgments the export is verified on (real CAIL2020 judgments shipped with the package), and how far.
VERIFY_NEW_TOKENS = 40


@dataclass
class SummarizerExport:
    """What `export_summarizer` wrote and how it checked it."""

    path: str
    documents: int
    probability_difference: float  # largest |onnxruntime - PyTorch| of an extraction probability
    new_tokens: int  # at most this many tokens generated per judgment, all equal to PyTorch's

    def summary(self) -> str:
        return (f"Exported the summariser to {self.path} (extractor and generator, prefill + decoding step); on "
                f"{self.documents} real judgments onnxruntime's extraction probabilities match PyTorch's to "
                f"{self.probability_difference:.1e} and its greedy summaries (up to {self.new_tokens} tokens) are "
                "PyTorch generate()'s.")


def export_summarizer(directory, output, atol: float = 1e-4, overwrite: bool = False,
                      greedy: bool = False) -> SummarizerExport:
    """Export a summariser folder (from `train-summarizer`) to ONNX: the extractor with transformers'
    `OnnxExporter`, the generator with its `export_for_generation` (dynamic shapes and cache), the tokenizer and
    settings beside them. Verified before it is put in place at `output`: on the real judgments shipped with the
    package, the extraction probabilities within `atol` and `VERIFY_NEW_TOKENS` greedily generated tokens equal
    to PyTorch `generate()`'s. `nezha_hf.summarization.load_summarizer(output)` runs it.

    The exported generator decodes greedily (one beam). A summariser that decodes with more beams (the default of
    `train-summarizer` is 3) would write other summaries once exported, so it is refused unless `greedy=True`
    (`--greedy`) accepts greedy decoding for the export."""
    from transformers.exporters.configs import OnnxConfig
    from transformers.exporters.exporter_onnx import OnnxExporter

    from .cail import read_judgments
    from .demo import EXAMPLES
    from .unilm import encode_sources

    directory = model_folder(directory, SETTINGS_FILE)
    output = check_destination(output, [directory], overwrite)
    beams = summarizer_settings(directory).get("num_beams", 1)
    if beams != 1 and not greedy:
        raise ValueError(f"{directory} decodes with {beams} beams, but an exported summariser decodes greedily and "
                         "would write other summaries: pass --greedy (greedy=True) to export it decoding greedily.")
    require_extra("onnx", "ONNX export")
    summarizer = Summarizer.from_pretrained(directory)
    summarizer.generator.config.use_cache = True  # decoding steps take a cache, whatever the saved config says
    judgments = read_judgments([EXAMPLES])
    tokenizer, config = summarizer.tokenizer, OnnxConfig(dynamic=True)
    # Two examples of different lengths, so that the batch and length axes stay dynamic (a size of 1 would be fixed).
    sample = ExtractionCollator(tokenizer)([encode_document(tokenizer, j.sentences) for j in judgments[:2]])
    prompt = encode_sources(tokenizer, ["".join(j.sentences[:3]) for j in judgments[:2]])
    with staged_folder(output, overwrite) as staging, exporter_notes_held_back():
        exporter = OnnxExporter()  # made here: it warns about the versions it was tested with
        scorer_inputs = {key: sample[key] for key in ("input_ids", "attention_mask")}
        scorer = exporter.export(TokenScores(summarizer.extractor), scorer_inputs, config)
        scorer.config = summarizer.extractor.config  # saved beside it, as the generator's is: loading checks both
        scorer.save_pretrained(staging / EXTRACTOR_DIR)
        exporter.export_for_generation(summarizer.generator, prompt, config,
                                       generation_config=summarizer.generator.generation_config,
                                       ).save_pretrained(staging / GENERATOR_DIR)
        tokenizer.save_pretrained(staging)
        save_settings(staging, {**summarizer.settings(), "num_beams": 1})
        write_manifest(staging, EXPORTED_KIND)
        exported = load_exported_summarizer(staging)
        probabilities = [summarizer.extract_probabilities(judgments), exported.extract_probabilities(judgments)]
        difference = max(abs(a - b) for x, y in zip(*probabilities, strict=True) for a, b in zip(x, y, strict=True))
        if not difference <= atol:
            raise ValueError(f"The exported extractor differs from PyTorch by {difference:.2e} (more than {atol:.0e}); "
                             "nothing written.")
        expected, got = (s.summarize(judgments, num_beams=1, max_new_tokens=VERIFY_NEW_TOKENS)
                         for s in (summarizer, exported))
        if expected != got:
            raise ValueError("The exported summariser writes other summaries than PyTorch generate(); nothing written.")
    return SummarizerExport(str(output), len(judgments), difference, VERIFY_NEW_TOKENS)


__all__ = ["OnnxExport", "SummarizerExport", "TokenScores", "export_onnx", "export_summarizer", "load_summarizer"]
