"""Convert BERT checkpoints (Hugging Face or TensorFlow) and older NEZHA releases into this package's format.

Every source tensor is either mapped to a NEZHA weight or listed, with the reason, in a report
that is printed and saved as `conversion_report.json` beside the output. A NEZHA weight that no
source tensor provides is an error unless `allow_missing` names it (it is then initialised
randomly when the model is loaded). The output loads with `AutoModel*.from_pretrained` with an
empty load report; the converter checks that before it returns.

    from nezha_hf.conversion import convert_bert, convert_tf, convert_legacy_nezha
    report = convert_bert("bert-base-chinese/", "nezha-from-bert/")
    report = convert_tf("model.ckpt-900000", "nezha-base-tf/", config_file="bert_config.json", vocab_file="vocab.txt")
    report = convert_legacy_nezha("old-nezha-pytorch/", "nezha-base/")
    report = convert_bert_hierarchical("bert-base-chinese/", "bert-long/")  # stays a BERT, reads up to 16,384 tokens

A converted BERT has lost its word order (absolute positions are dropped and NEZHA's relative
positions are new to it): continue masked-LM training before use (`nezha_hf.pretraining`).
"""

import fnmatch
import json
import re
import shutil
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

from .checkpoints import check_tokenizer_files, model_folder
from .configuration_nezha import NezhaConfig, NezhaConfigError, card_setting_problem
from .extras import require_extra
from .json_files import JSON_OBJECT, JSONFileError, read_json
from .hub import export_remote_code, vocabulary_languages, write_model_card
from .modeling_nezha import NEZHA_HEADS, POOLER_WEIGHT, NezhaForMaskedLM, nezha_head
from .documents import read_text
from .named_files import INDEX_SCHEMA, weight_files
from .readers import first_line, open_regular_file, read_weights
from .safe_output import check_destination, glob_escape, staged_folder

REPORT_NAME = "conversion_report.json"
TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")
# NEZHA has no length cap; a tokenizer that says 512 would cut long documents when truncation is on.
UNLIMITED_MODEL_MAX_LENGTH = 1_000_000

# Source tensors that have no NEZHA counterpart, and why.
DROPPED_TENSORS = [
    (r"(^|\.)embeddings\.position_embeddings\.weight$", "absolute position embeddings: NEZHA uses relative positions"),
    (r"(^|\.)embeddings\.position_ids$", "buffer of position indices: carries no information"),
    (r"(^|\.)embeddings\.token_type_ids$", "buffer of zeros: carries no information"),
    (r"relative_positions_encoding\.positions_encoding$", "persisted sinusoid buffer: rebuilt from the config"),
]
# What `config.json` says a convertible checkpoint is (a TensorFlow release's bert_config.json says nothing).
BERT_FAMILY = (None, "bert", "nezha")
# NEZHA weights that every BERT-family source has: `allow_missing` may name head weights, never these.
CORE_WEIGHTS = re.compile(r"^(nezha\.)?(embeddings|encoder)\.")
# Parts of TensorFlow checkpoints that are training state, not weights.
TF_TRAINING_STATE = [
    (r"(^|/)(adam_m|adam_v|Adam|Adam_1|Momentum|AdamWeightDecayOptimizer(_1)?|LAMB(_1)?)$", "optimizer state"),
    (r"^(global_step|good_steps|loss_scale|current_loss_scale|beta1_power|beta2_power)$", "training counter"),
]
# Config fields of BERT that NEZHA does not have.
BERT_ONLY_CONFIG = {
    "position_embedding_type": "NEZHA's positions are relative and built in",
    "gradient_checkpointing": "a training option, not part of the model: use TrainingArguments(activation_checkpointing=True)",
    "directionality": "Google BERT metadata",
    "pooler_fc_size": "Google BERT metadata",
    "pooler_num_attention_heads": "Google BERT metadata",
    "pooler_num_fc_layers": "Google BERT metadata",
    "pooler_size_per_head": "Google BERT metadata",
    "pooler_type": "Google BERT metadata",
    "use_relative_position": "always true in NEZHA",
}
# Config keys that tell a loader to fetch and run code (`trust_remote_code`): never carried into an output. (With
# `remote_code=True` the converter writes an `auto_map` of its own, naming nezha_hf's files it copies beside.)
LOADER_CODE_CONFIG = {
    "auto_map": "names code for transformers to fetch and run (trust_remote_code): not carried",
    "custom_pipelines": "names pipeline code for transformers to fetch and run (trust_remote_code): not carried",
}
# Config keys the converter writes itself.
REWRITTEN_CONFIG = {
    "model_type": "written anew for the output",
    "architectures": "written anew for the output",
    "transformers_version": "written anew for the output",
    "_name_or_path": "where the source was loaded from; a Hub id becomes the model card's base_model",
    "torch_dtype": "the weights keep their own dtype",
    "dtype": "the weights keep their own dtype",
    "nezha_card": "the source's model-card settings: the converter writes its own",
}
# Settings of every transformers config worth carrying: `num_labels` (transformers turns it into id2label), the
# tokenizer's class when config.json names it (`AutoTokenizer` reads it there), the fine-tuning task.
GENERAL_SETTINGS = {"num_labels", "tokenizer_class", "finetuning_task"}
# What a converted NEZHA config is built from: NezhaConfig's settings and `max_position_embeddings` (kept for
# transformers 4.x, see NezhaConfig); a BERT output's, BertConfig's.
NEZHA_SETTINGS = {f.name for f in fields(NezhaConfig)} - set(REWRITTEN_CONFIG) | GENERAL_SETTINGS | {
    "max_position_embeddings"}
BERT_SETTINGS = {f.name for f in fields(transformers.BertConfig)} - set(REWRITTEN_CONFIG) | GENERAL_SETTINGS | {
    "position_embedding_type"}
BERT_TO_NEZHA_CLASS = {bert: head.model_class.__name__ for head in NEZHA_HEADS for bert in head.bert_classes}
# The masked-LM decoder and its source when tied (the same in every head that has one).
TIED_DECODER = NezhaForMaskedLM._tied_weights_keys


class ConversionError(ValueError):
    """A checkpoint that cannot be converted as asked (unreadable, incomplete, or shaped wrong)."""


@dataclass
class ConversionReport:
    """What a conversion did with every source tensor; saved as `conversion_report.json`."""

    source: str
    output: str
    source_format: str
    architecture: str
    mapped: dict[str, str] = field(default_factory=dict)  # source name -> NEZHA name
    dropped: list[dict] = field(default_factory=list)  # {"name", "shape", "reason"}
    missing_allowed: list[str] = field(default_factory=list)
    config_dropped: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def drop(self, name: str, shape, reason: str) -> None:
        self.dropped.append({"name": name, "shape": list(shape), "reason": reason})

    def summary(self) -> str:
        """A human-readable account, one line per dropped tensor."""
        lines = [
            f"Converted {self.source} ({self.source_format}) -> {self.output} as {self.architecture}",
            f"  mapped {len(self.mapped)} tensors; " + (f"dropped {len(self.dropped)}:" if self.dropped else "dropped none"),
        ]
        lines += [f"    - {item['name']} {tuple(item['shape'])}: {item['reason']}" for item in self.dropped]
        lines += [f"  left uninitialised (allowed): {name}" for name in self.missing_allowed]
        lines += [f"  config field dropped: {key} ({reason})" for key, reason in self.config_dropped.items()]
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)

    def save(self, directory: Path) -> Path:
        path = Path(directory) / REPORT_NAME
        path.write_text(json.dumps(asdict(self), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        return path


# --- reading checkpoints ---------------------------------------------------------------------


def read_pytorch_checkpoint(directory: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a Hugging Face checkpoint directory (safetensors or `.bin`, sharded or not)."""
    directory = model_folder(directory, needs=None)
    try:
        files = weight_files(directory)  # only regular files inside the folder, whatever an index names
    except ValueError as error:
        raise ConversionError(str(error)) from None
    if not files:
        raise ConversionError(f"No model.safetensors or pytorch_model.bin in {directory}.")
    state = {}
    for path in files:
        try:
            state.update(read_weights(path))
        except (OSError, ValueError) as error:
            raise ConversionError(str(error)) from None
    return state


def _tf_to_pytorch_name(name: str) -> str:
    """`bert/encoder/layer_3/attention/self/query/kernel` -> `bert.encoder.layer.3.attention.self.query.weight`."""
    parts = []
    for part in name.split("/"):
        layer = re.fullmatch(r"layer_(\d+)", part)
        if layer:
            parts += ["layer", layer.group(1)]
        elif part in ("kernel", "gamma", "output_weights"):
            parts.append("weight")
        elif part in ("beta", "output_bias"):
            parts.append("bias")
        else:
            parts.append(part)
    pytorch_name = ".".join(parts)
    if pytorch_name.endswith("_embeddings"):  # embedding tables are bare variables in TF
        pytorch_name += ".weight"
    return pytorch_name


def read_tf_checkpoint(checkpoint: str | Path, report: "ConversionReport") -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The weights of a TensorFlow checkpoint, renamed to PyTorch BERT names (needs `nezha_hf[tf]`).

    Kernels are transposed to `[out, in]`; optimizer slots and counters are listed in the report.
    Returns the tensors and, for the report, the TF name of each PyTorch name.
    """
    require_extra("tf", "Reading TensorFlow checkpoints")
    import tensorflow as tf

    checkpoint = Path(checkpoint)
    # Its files, regular files before TensorFlow opens them (a FIFO would hang it), named in whatever it raises.
    index = checkpoint.with_name(checkpoint.name + ".index")
    files = [index, *sorted(checkpoint.parent.glob(glob_escape(checkpoint.name) + ".data-*-of-*"))]
    for path in files:
        open_regular_file(path).close()
    where = f"{checkpoint} ({', '.join(path.name for path in files)})"
    try:
        reader = tf.train.load_checkpoint(str(checkpoint))
        shapes = reader.get_variable_to_shape_map()
    except Exception as error:  # TensorFlow raises several unrelated types for unreadable files
        raise ConversionError(f"Could not read the TensorFlow checkpoint {where}: {first_line(error)}") from None
    state, tf_names = {}, {}
    for name in sorted(shapes):
        reason = next((why for pattern, why in TF_TRAINING_STATE if re.search(pattern, name)), None)
        if reason:
            report.drop(name, shapes[name], reason)
            continue
        try:
            value = torch.from_numpy(reader.get_tensor(name).copy())
        except Exception as error:
            raise ConversionError(f"Could not read variable {name} from {where}: {first_line(error)}") from None
        if name.endswith("/kernel"):
            value = value.T.contiguous()
        state[_tf_to_pytorch_name(name)] = value
        tf_names[_tf_to_pytorch_name(name)] = name
    return state, tf_names


# --- mapping -------------------------------------------------------------------------------


def nezha_name(source_name: str) -> str:
    """The NEZHA parameter name for a BERT / old-NEZHA PyTorch name (prefix `nezha.`, LayerNorm `weight/bias`)."""
    name = re.sub(r"^(bert|nezha)\.", "", source_name)
    name = re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", name)
    name = re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", name)
    if name.startswith(("embeddings.", "encoder.", "pooler.")):
        name = "nezha." + name
    return name


def _architecture(config_dict: dict, names: set[str], requested: str | None) -> str:
    if requested:
        try:
            return nezha_head(requested).model_class.__name__
        except ValueError as error:
            raise ConversionError(str(error)) from None
    for architecture in config_dict.get("architectures") or []:
        if architecture in BERT_TO_NEZHA_CLASS:
            return BERT_TO_NEZHA_CLASS[architecture]
        try:
            return nezha_head(architecture).model_class.__name__
        except ValueError:
            continue
    has = {prefix: any(n.startswith(prefix) for n in names) for prefix in ("cls.predictions.", "cls.seq_relationship.", "qa_outputs.", "classifier.")}
    if has["cls.predictions."]:
        return "NezhaForPreTraining" if has["cls.seq_relationship."] else "NezhaForMaskedLM"
    if has["cls.seq_relationship."]:
        return "NezhaForNextSentencePrediction"
    if has["qa_outputs."]:
        return "NezhaForQuestionAnswering"
    if has["classifier."]:
        raise ConversionError("The checkpoint has a classifier but no `architectures` saying which: pass architecture=.")
    return "NezhaModel"


def carried_settings(config_dict: dict, settings: set[str], report: ConversionReport,
                     reasons: dict[str, str] | None = None) -> dict:
    """The keys of a source config that are `settings` of the output's config class; every other key is listed in
    `report.config_dropped` with why (`reasons`, else the loader-code, rewritten and unknown-key reasons). A source
    config is data from whoever published it: nothing it holds is carried without being known."""
    values = {}
    for key, value in config_dict.items():
        if key in settings:
            values[key] = value
        else:
            why = {**LOADER_CODE_CONFIG, **REWRITTEN_CONFIG, **(reasons or {})}.get(key)
            report.config_dropped[key] = why or "not a setting of the output's config class"
    return values


def nezha_config_from_bert(config_dict: dict, architecture: str, report: ConversionReport, **overrides) -> NezhaConfig:
    """Translate a BERT (or old NEZHA) config dict into a `NezhaConfig` of NEZHA's own settings; every other key
    (BERT-only fields, loader-code keys such as `auto_map`, unknown keys) is listed in the report with why."""
    if config_dict.get("position_embedding_type") not in ("absolute", None):
        raise ConversionError(f"position_embedding_type={config_dict['position_embedding_type']!r}: only BERTs with "
                              "absolute positions convert.")
    values = carried_settings(config_dict, NEZHA_SETTINGS, report, BERT_ONLY_CONFIG)
    values.update({key: value for key, value in overrides.items() if value is not None})
    values["architectures"] = [architecture]
    return NezhaConfig(**values)


def _target_shapes(config: NezhaConfig, architecture: str) -> dict[str, torch.Size]:
    """Names and shapes of the persistent tensors the NEZHA class expects (built on the meta device)."""
    with torch.device("meta"):
        model = nezha_head(architecture).model_class(config)
    buffers = {name for name, _ in model.named_buffers()}
    shapes = {name: tensor.shape for name, tensor in model.state_dict().items() if name not in buffers}
    if not any(re.search(POOLER_WEIGHT, name) for name in shapes):  # kept by heads without one (POOLER_WEIGHT)
        shapes.update({name: tensor.shape for name, tensor in initialised_pooler(config).items()})
    return shapes


def initialised_pooler(config: NezhaConfig, dtype=torch.float32, seed: int = 0) -> dict[str, torch.Tensor]:
    """The pooler's weights (`nezha.pooler.dense.*`) initialised as NEZHA initialises a linear layer (normal with
    `config.initializer_range`, zero bias), from `seed`: drawn once and saved, for a checkpoint that has none."""
    generator = torch.Generator().manual_seed(seed)
    size = config.hidden_size
    weight = torch.randn(size, size, generator=generator) * config.initializer_range
    return {"nezha.pooler.dense.weight": weight.to(dtype), "nezha.pooler.dense.bias": torch.zeros(size, dtype=dtype)}


def saved_pooler(folder: str | Path) -> dict[str, torch.Tensor]:
    """The pooler's weights in the checkpoint `folder` (named `nezha.pooler.dense.*`), empty if it has none; its
    weight files as `named_files.weight_files` finds them (whatever an index names is held to the folder)."""
    found = {}
    for path in weight_files(folder):
        found.update({nezha_name(key): tensor for key, tensor in read_weights(path).items()
                      if re.search(POOLER_WEIGHT, key)})
    return found


def add_pooler(folder: str | Path, pooler: dict[str, torch.Tensor]) -> None:
    """Write `pooler` (`nezha.pooler.dense.*`) into the safetensors checkpoint in `folder` (a folder being written:
    the caller stages it), beside weights that lack it; a sharded checkpoint gets a file of its own in its index."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_files(folder)  # every shard the index names inside the folder
        contents = read_json(index, INDEX_SCHEMA)
        save_file(pooler, str(folder / "model-pooler.safetensors"), metadata={"format": "pt"})
        contents["weight_map"].update(dict.fromkeys(pooler, "model-pooler.safetensors"))
        index.write_text(json.dumps(contents, indent=2) + "\n", encoding="utf-8")
        return
    path = folder / "model.safetensors"
    save_file({**read_weights(path), **pooler}, str(path), metadata={"format": "pt"})


def map_state_dict(
    source: dict[str, torch.Tensor],
    config: NezhaConfig,
    architecture: str,
    report: ConversionReport,
    allow_missing: tuple[str, ...] = (),
    source_names: dict[str, str] | None = None,
) -> dict[str, torch.Tensor]:
    """Map source tensors onto the NEZHA class's names, unchanged, recording everything in `report`.

    `source_names` gives the name to report for a tensor (its TensorFlow name, say) if it differs.

    Raises `ConversionError` for shape mismatches, two sources for one target, and target weights
    left without a source that `allow_missing` (glob patterns) does not name.
    """
    targets = _target_shapes(config, architecture)
    mapped: dict[str, torch.Tensor] = {}
    sources_of: dict[str, str] = {}
    mismatches: list[str] = []
    for name in sorted(source):
        tensor = source[name]
        shown = (source_names or {}).get(name, name)
        reason = next((why for pattern, why in DROPPED_TENSORS if re.search(pattern, name)), None)
        if reason:
            report.drop(shown, tensor.shape, reason)
            continue
        target = nezha_name(name)
        if target not in targets and target.removeprefix("nezha.") in targets:
            target = target.removeprefix("nezha.")  # the bare NezhaModel has no prefix
        if target in TIED_DECODER and config.tie_word_embeddings:
            tied_to = next((n for n in source if nezha_name(n) == TIED_DECODER[target]), None)
            if tied_to is not None and torch.equal(source[tied_to], tensor):
                report.drop(shown, tensor.shape, f"tied to {TIED_DECODER[target]} (identical values)")
                continue
            raise ConversionError(
                f"{name} differs from {TIED_DECODER[target]}: the decoder is not tied. Convert with "
                "tie_word_embeddings=False."
            )
        if target not in targets:
            report.drop(shown, tensor.shape, f"no counterpart in {architecture}")
            continue
        if tuple(tensor.shape) != tuple(targets[target]):
            mismatches.append(f"{shown}: shape {tuple(tensor.shape)} vs {target} {tuple(targets[target])}")
            continue
        if target in sources_of:
            raise ConversionError(f"Both {sources_of[target]} and {shown} map to {target}.")
        sources_of[target] = shown
        mapped[target] = tensor.contiguous()
        report.mapped[shown] = target
    if mismatches:
        raise ConversionError("Tensors that do not fit the translated config: " + "; ".join(mismatches))
    for target in sorted(set(targets) - set(mapped)):
        if config.tie_word_embeddings and target in TIED_DECODER:
            continue
        if re.search(POOLER_WEIGHT, target):  # no pooler in the source: one drawn here, once, and saved
            dtype = next(iter(mapped.values())).dtype if mapped else torch.float32
            mapped[target] = initialised_pooler(config, dtype)["nezha.pooler.dense." + target.rsplit(".", 1)[1]]
            report.notes.append(f"{target}: the source has no pooler; initialised once (seed 0) and saved, so that "
                                "a classifier built on this model reads the same pooler at every load")
            continue
        if CORE_WEIGHTS.match(target):
            raise ConversionError(
                f"The source has no tensor for {target}, a weight every BERT has: it is not a BERT-family checkpoint "
                "(allow_missing covers head weights only)."
            )
        if any(fnmatch.fnmatchcase(target, pattern) for pattern in allow_missing):
            report.missing_allowed.append(target)
        else:
            raise ConversionError(
                f"No source tensor for {target} (of {architecture}). Pass allow_missing=[{target!r}] (CLI: "
                f"--allow-missing '{target}') to initialise it randomly, or pick another architecture."
            )
    return mapped


# --- writing -------------------------------------------------------------------------------


def _copy_tokenizer(source_directory: Path | None, output: Path, report: ConversionReport, vocab_file=None, do_lower_case=True,
                    model_max_length: int = UNLIMITED_MODEL_MAX_LENGTH, why: str = "NEZHA has no length cap",
                    only_raise: bool = True):
    """Copy (or write, from `vocab_file`) the tokenizer into `output`, its `model_max_length` raised to
    `model_max_length` (or, with `only_raise=False`, set to it), each change noted in `report` with `why`; keys of
    its config that name code for a loader to fetch (`LOADER_CODE_CONFIG`) are dropped and reported."""
    if vocab_file is not None:
        from transformers import BertTokenizerFast

        shutil.copy(vocab_file, output / "vocab.txt")
        BertTokenizerFast.from_pretrained(output, do_lower_case=do_lower_case).save_pretrained(output)
    elif source_directory is not None:
        check_tokenizer_files(source_directory)  # what is copied is read first, as a tokenizer loader will read it
        copied = [name for name in TOKENIZER_FILES if (source_directory / name).exists()]
        for name in copied:
            shutil.copy(source_directory / name, output / name)
        if not copied:
            report.notes.append("the source has no tokenizer files; add the vocabulary before use")
    config_path = output / "tokenizer_config.json"
    if config_path.exists():
        try:
            tokenizer_config = read_json(config_path, JSON_OBJECT)
        except JSONFileError as error:
            raise ConversionError(f"Could not read the tokenizer config: {error}") from None
        changed = False
        for key in LOADER_CODE_CONFIG.keys() & tokenizer_config.keys():
            del tokenizer_config[key]
            report.config_dropped[f"{config_path.name}: {key}"] = LOADER_CODE_CONFIG[key]
            changed = True
        old = tokenizer_config.get("model_max_length")
        if (old is not None and old < model_max_length) if only_raise else old != model_max_length:
            tokenizer_config["model_max_length"] = model_max_length
            report.notes.append(f"tokenizer model_max_length {old} set to {model_max_length}: {why}")
            changed = True
        if changed:
            config_path.write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_and_verify(mapped, config: NezhaConfig, output: Path, report: ConversionReport) -> None:
    """Save weights, config and report, then load the result with its Auto class and insist on a clean load."""
    save_file(mapped, str(output / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(output)
    report.save(output)
    write_model_card(output, report.architecture, {"kind": "converted", **(config.nezha_card or {})})
    head = nezha_head(report.architecture)
    loader = getattr(transformers, head.auto_class) if head.auto_class else head.model_class
    allowed = set(report.missing_allowed)
    allowed |= {tied for tied, source in TIED_DECODER.items() if source in allowed}  # missing with their source
    _check_clean_load(loader, output, report.output, allowed)


def _check_clean_load(loader, folder: Path, output: str, allowed_missing=frozenset()) -> None:
    """Load `folder` with `loader` (a transformers class) and insist on an empty load report: no weight missing
    (beyond `allowed_missing`), left over or mismatched. `output` names the destination in the error."""
    _, info = loader.from_pretrained(folder, output_loading_info=True)
    missing = set(info["missing_keys"]) - set(allowed_missing)
    if missing or info["unexpected_keys"] or info["mismatched_keys"] or info.get("error_msgs"):
        raise ConversionError(f"The converted checkpoint for {output} does not load cleanly: {info}")


def _convert_state(
    state, config_dict, report, work, architecture, allow_missing, max_relative_position, remote_code, config_file,
    source_names=None,
) -> ConversionReport:
    """The steps shared by every source format, once its tensors have PyTorch BERT names (its config read from
    `config_file`); writes into `work`."""
    if config_dict.get("model_type") not in BERT_FAMILY:
        raise ConversionError(
            f"{report.source} is a {config_dict['model_type']!r} checkpoint; only BERT-family checkpoints "
            f"(model_type {', '.join(t for t in BERT_FAMILY if t)}) convert to NEZHA."
        )
    report.architecture = _architecture(config_dict, {nezha_name(n) for n in state}, architecture)
    tie = config_dict.get("tie_word_embeddings", True)
    decoder = next((n for n in state if nezha_name(n) == "cls.predictions.decoder.weight"), None)
    embeddings = next((n for n in state if nezha_name(n) == "nezha.embeddings.word_embeddings.weight"), None)
    if decoder and embeddings and not torch.equal(state[decoder], state[embeddings]):
        tie = False
        report.notes.append("the masked-LM decoder is not tied to the word embeddings: tie_word_embeddings=False")
    try:
        config = nezha_config_from_bert(config_dict, report.architecture, report,
                                        max_relative_position=max_relative_position, tie_word_embeddings=tie)
    except NezhaConfigError as error:
        raise NezhaConfigError(f"{config_file}: {error}") from None
    # Model cards of this checkpoint and of models trained from it name the source (if it is a Hub id).
    source_id = config_dict.get("_name_or_path", "")
    is_hub_id = "/" in source_id and card_setting_problem("base_model", source_id) is None
    config.nezha_card = {"base_model": source_id} if is_hub_id else {}
    languages = vocabulary_languages(work)  # kept by the models trained from this one, whose folders may lack it
    if languages:
        config.nezha_card["language"] = languages
    mapped = map_state_dict(state, config, report.architecture, report, tuple(allow_missing), source_names)
    _write_and_verify(mapped, config, work, report)
    if remote_code:
        export_remote_code(work)
    return report


def _check_options(max_relative_position: int | None) -> None:
    """A `ValueError` for a `max_relative_position` NezhaConfig refuses, before any checkpoint is read."""
    if max_relative_position is not None:
        NezhaConfig(max_relative_position=max_relative_position)


def _read_config(path: Path) -> dict:
    try:
        return read_json(path, JSON_OBJECT)
    except (OSError, JSONFileError) as error:
        raise ConversionError(f"Could not read the config {path}: {error}") from None


# Tensors with a row per vocabulary entry: the word embeddings, an untied masked-LM decoder and the output bias.
VOCABULARY_ROWS = re.compile(r"(^|\.)(embeddings\.word_embeddings\.weight|predictions\.decoder\.weight|"
                             r"predictions\.decoder\.bias|predictions\.bias)$")


def corpus_characters(files) -> set[str]:
    """The characters of the text in `files` (`.txt` / JSONL files or folders, read as `pretrain` reads them)."""
    from .documents import read_documents

    return {character for document in read_documents(files) for character in document.text if not character.isspace()}


def add_characters(work: Path, state: dict, config_dict: dict, characters: set[str], report: ConversionReport,
                   corpus: str) -> tuple[dict, dict]:
    """Extend the BERT vocabulary in `work` (copied there from the source) with the `characters` its tokenizer reads
    as `[UNK]`, appended in code-point order: `vocab.txt` and the tokenizer files rewritten, and every tensor with a
    row per vocabulary entry (`VOCABULARY_ROWS`) given a new row per character, the mean of its old rows (a neutral
    start that continued pretraining moves). Returns the new state and config; the report says what was added."""
    from transformers import BertTokenizerFast

    vocabulary_file = work / "vocab.txt"
    if not vocabulary_file.is_file():
        raise ConversionError(f"--add-characters needs the source's vocab.txt (a WordPiece vocabulary); "
                              f"{report.source} has none.")
    entries = read_text(vocabulary_file).splitlines()
    rows = config_dict.get("vocab_size")
    if rows != len(entries):
        raise ConversionError(f"--add-characters: {report.source} has {len(entries):,} vocabulary entries but "
                              f"{rows:,} embedding rows; new ids would not match new rows.")
    tokenizer = BertTokenizerFast.from_pretrained(work)
    unknown = [tokenizer.unk_token]
    new = sorted(c for c in characters if tokenizer.tokenize(c) == unknown)
    if not new:
        report.notes.append(f"--add-characters {corpus}: every character of it is in the vocabulary already")
        return state, config_dict
    vocabulary_file.write_text("\n".join([*entries, *new]) + "\n", encoding="utf-8")
    (work / "tokenizer.json").unlink(missing_ok=True)  # rebuilt from vocab.txt and tokenizer_config.json
    BertTokenizerFast.from_pretrained(work).save_pretrained(work)
    state = dict(state)
    for name, tensor in state.items():
        if VOCABULARY_ROWS.search(name) and tensor.shape[0] == rows:
            state[name] = torch.cat([tensor, tensor.float().mean(0, keepdim=True).to(tensor.dtype).expand(
                len(new), *tensor.shape[1:])])
    shown = "".join(new[:20]) + (" ..." if len(new) > 20 else "")
    report.notes.append(f"--add-characters {corpus}: {len(new):,} characters it reads as [UNK] added to the "
                        f"vocabulary ({rows:,} -> {rows + len(new):,} tokens: {shown}); their embedding rows (and "
                        "masked-LM output rows) start as the mean of the old ones: `nezha-hf pretrain` on text that "
                        "uses them teaches them")
    return state, {**config_dict, "vocab_size": rows + len(new)}


def convert_bert(
    source: str | Path,
    output: str | Path,
    architecture: str | None = None,
    allow_missing: tuple[str, ...] | list[str] = (),
    max_relative_position: int | None = None,
    remote_code: bool = False,
    overwrite: bool = False,
    add_characters_from=(),
) -> ConversionReport:
    """Convert a Hugging Face BERT directory (any head, with or without the `bert.` prefix) to NEZHA.

    Args:
        source: directory with `config.json` and `model.safetensors` / `pytorch_model.bin` (or shards).
        output: directory to write; gets `model.safetensors`, `config.json`, the tokenizer files
            and `conversion_report.json`. It is written beside its destination and renamed into place
            once the result loads cleanly; it may not be the source (nor inside it), and an existing
            non-empty folder is replaced (whole) only with `overwrite=True`.
        architecture: NEZHA class to produce (default: from the config's `architectures`, else
            from the heads present).
        allow_missing: glob patterns of NEZHA weights that may stay uninitialised.
        max_relative_position: `K` for the new model (default: `NezhaConfig`'s).
        remote_code: also make the output loadable with `trust_remote_code=True` without nezha_hf.
        overwrite: replace an existing non-empty `output`.
        add_characters_from: `.txt` / JSONL files or folders (a corpus): the characters of their text that the
            BERT's tokenizer reads as `[UNK]` are added to its vocabulary (`add_characters`), so that a BERT of
            another language, or without a domain's characters, reads that text after `nezha-hf pretrain` on it.

    Returns:
        The `ConversionReport` (also printed by the CLI and saved as JSON).
    """
    source = Path(source)
    output = check_destination(output, [source, *add_characters_from], overwrite)
    _check_options(max_relative_position)
    characters = corpus_characters(add_characters_from) if add_characters_from else set()
    state = read_pytorch_checkpoint(source)
    config_dict = _read_config(source / "config.json")
    report = ConversionReport(str(source), str(output), "huggingface-pytorch", "")
    with staged_folder(output, overwrite) as work:
        _copy_tokenizer(source, work, report)
        if add_characters_from:
            state, config_dict = add_characters(work, state, config_dict, characters, report,
                                                " ".join(map(str, add_characters_from)))
        _convert_state(state, config_dict, report, work, architecture, allow_missing, max_relative_position, remote_code,
                       source / "config.json")
    return report


# Hierarchical positions (bert4keras's `PositionEmbedding(hierarchical=True)`): alpha, and the longest table written
# by default (a 768-wide table of 16,384 positions is 48 MB in float32).
HIERARCHICAL_ALPHA = 0.4
HIERARCHICAL_MAX_LENGTH = 16_384
POSITION_TABLE = re.compile(r"(^|\.)embeddings\.position_embeddings\.weight$")


def check_alpha(alpha: float) -> None:
    """A `ValueError` unless `alpha` suits `hierarchical_positions`. Positions a*n+b and b*n+a differ by
    (2 alpha - 1)(u[a] - u[b]) and the block index weighs alpha: near 0.5 they (nearly) coincide, near 0 positions
    repeat every n, near 1 `u` (divided by 1 - alpha) blows up."""
    if not (0.05 <= alpha <= 0.45 or 0.55 <= alpha <= 0.95):
        raise ValueError(f"alpha must lie in [0.05, 0.45] or [0.55, 0.95] (near 0.5 positions a*n+b and b*n+a nearly "
                         f"coincide, near 0 they repeat every n learned positions, near 1 the table blows up); got {alpha}")


def hierarchical_positions(table: torch.Tensor, length: int, alpha: float = HIERARCHICAL_ALPHA) -> torch.Tensor:
    """Su Jianlin's hierarchical decomposition of a learned position table `table` (n x hidden), extended to `length`
    (at most n^2) positions: with `u = (table - alpha * table[0]) / (1 - alpha)`, position `i` is
    `alpha * u[i // n] + (1 - alpha) * u[i % n]`. Computed in float64, returned in the table's dtype; the first n
    rows are the table's own, copied."""
    n = table.shape[0]
    check_alpha(alpha)
    if not n < length <= n * n:
        raise ValueError(f"The length must be more than the {n} learned positions and at most {n}^2 = {n * n:,}; "
                         f"got {length}")
    learned = table.double()
    u = (learned - alpha * learned[0]) / (1 - alpha)
    positions = torch.arange(length)
    extended = (alpha * u[positions // n] + (1 - alpha) * u[positions % n]).to(table.dtype)
    extended[:n] = table  # float64 recomputation rounds back to them too; the copy makes it certain
    return extended


def convert_bert_hierarchical(
    source: str | Path,
    output: str | Path,
    alpha: float = HIERARCHICAL_ALPHA,
    max_length: int | None = None,
    overwrite: bool = False,
) -> ConversionReport:
    """A Hugging Face BERT (any head) that reads longer inputs with no training: its position table of n learned
    positions extended to `max_length` (default: n^2, at most 16,384) by `hierarchical_positions`. The output is a
    plain transformers BERT of the same head (no nezha_hf needed to load it), with `max_position_embeddings` and the
    tokenizer's `model_max_length` set to match, and `conversion_report.json` saying what changed.

    The cheapest long-input baseline: positions below n are the source's own, bit for bit; beyond them the model
    sees combinations it was never trained on. Converting to NEZHA and continuing pretraining
    (`convert_bert`, `nezha_hf.pretraining`) is the alternative that learns; `docs/conversion.md` compares them.
    """
    source = Path(source)
    output = check_destination(output, [source], overwrite)
    check_alpha(alpha)
    state = read_pytorch_checkpoint(source)
    config_dict = _read_config(source / "config.json")
    if config_dict.get("model_type") != "bert":
        raise ConversionError(f"{source} is a {config_dict.get('model_type')!r} checkpoint; hierarchical positions "
                              "extend a BERT's (model_type 'bert').")
    name = next((key for key in state if POSITION_TABLE.search(key)), None)
    if name is None:
        raise ConversionError(f"{source} has no embeddings.position_embeddings.weight to extend.")
    n = state[name].shape[0]
    length = min(n * n, HIERARCHICAL_MAX_LENGTH) if max_length is None else max_length
    state[name] = hierarchical_positions(state[name], length, alpha)
    architecture = _bert_architecture(config_dict, state, source)
    report = ConversionReport(str(source), str(output), "huggingface-pytorch", architecture)
    for key in list(state):
        if re.search(r"(^|\.)embeddings\.position_ids$", key):  # an older save's buffer, sized for n positions
            report.drop(key, state.pop(key).shape, "buffer of position indices: transformers rebuilds it")
    report.mapped = {key: key for key in state}
    report.notes.append(f"{name}: {n} learned positions extended to {length:,} (hierarchical, alpha {alpha:g}); the "
                        f"first {n} copied unchanged")
    config_dict = {**carried_settings(config_dict, BERT_SETTINGS, report, BERT_ONLY_CONFIG),
                   "model_type": "bert", "architectures": [architecture], "max_position_embeddings": length}
    with staged_folder(output, overwrite) as work:
        _copy_tokenizer(source, work, report, model_max_length=length, why="the model's new length",
                        only_raise=False)
        # Cloned: an old .bin's tied tensors share storage, which safetensors refuses.
        save_file({key: value.clone() for key, value in state.items()}, str(work / "model.safetensors"),
                  metadata={"format": "pt"})
        (work / "config.json").write_text(json.dumps(config_dict, indent=2) + "\n", encoding="utf-8")
        report.save(work)
        _check_clean_load(getattr(transformers, architecture), work, str(output))
    return report


def _bert_architecture(config_dict: dict, state: dict, source: Path) -> str:
    """The transformers BERT class of a checkpoint: its config's `architectures`, else told by the heads it has."""
    named = (config_dict.get("architectures") or [None])[0]
    if named is not None:
        if not issubclass(getattr(transformers, named, type), transformers.BertPreTrainedModel):
            raise ConversionError(f"{source}'s architecture {named!r} is not a transformers BERT class.")
        return named
    heads = {head for name in state for head in ("cls.predictions", "cls.seq_relationship", "classifier", "qa_outputs")
             if head in name}
    by_heads = {frozenset(): "BertModel", frozenset({"cls.predictions"}): "BertForMaskedLM",
                frozenset({"cls.seq_relationship"}): "BertForNextSentencePrediction",
                frozenset({"cls.predictions", "cls.seq_relationship"}): "BertForPreTraining",
                frozenset({"qa_outputs"}): "BertForQuestionAnswering"}
    if frozenset(heads) not in by_heads:
        raise ConversionError(f"{source}/config.json names no architecture and its heads ({', '.join(sorted(heads))}) "
                              "fit several BERT classes: add \"architectures\" to it.")
    return by_heads[frozenset(heads)]


def convert_legacy_nezha(
    source: str | Path,
    output: str | Path,
    architecture: str | None = None,
    allow_missing: tuple[str, ...] | list[str] = (),
    remote_code: bool = False,
    overwrite: bool = False,
) -> ConversionReport:
    """Convert an older PyTorch NEZHA release (`bert.` prefix, persisted buffers) to the current layout.

    Same arguments as `convert_bert`; `max_relative_position` comes from the source config. Any NEZHA folder
    converts too, and its copy's tokenizer reads any length (`model_max_length` raised to 1,000,000): the step the
    warning on loading a folder whose tokenizer says 512 names (`tokenizer_cap`).
    """
    return convert_bert(source, output, architecture, allow_missing, remote_code=remote_code, overwrite=overwrite)


def convert_tf(
    checkpoint: str | Path,
    output: str | Path,
    config_file: str | Path,
    vocab_file: str | Path | None = None,
    architecture: str | None = None,
    allow_missing: tuple[str, ...] | list[str] = (),
    max_relative_position: int | None = None,
    do_lower_case: bool = True,
    remote_code: bool = False,
    overwrite: bool = False,
) -> ConversionReport:
    """Convert a TensorFlow checkpoint (Google BERT or Huawei NEZHA naming) to NEZHA. Needs `nezha_hf[tf]`.

    Args:
        checkpoint: the checkpoint prefix, e.g. `.../model.ckpt-900000`.
        config_file: its `bert_config.json`.
        vocab_file: its `vocab.txt` (written with a `BertTokenizerFast` config; `do_lower_case` as
            for the Chinese releases).
        Other arguments as in `convert_bert` (the checkpoint's folder counts as the source).
    """
    sources = [Path(checkpoint).parent, config_file, *([vocab_file] if vocab_file is not None else [])]
    output = check_destination(output, sources, overwrite)
    _check_options(max_relative_position)
    report = ConversionReport(str(checkpoint), str(output), "tensorflow", "")
    state, tf_names = read_tf_checkpoint(checkpoint, report)
    config_dict = _read_config(Path(config_file))
    with staged_folder(output, overwrite) as work:
        if vocab_file is not None:
            _copy_tokenizer(None, work, report, vocab_file=vocab_file, do_lower_case=do_lower_case)
        else:
            report.notes.append("no vocab_file given: add the vocabulary before use")
        _convert_state(state, config_dict, report, work, architecture, allow_missing, max_relative_position, remote_code,
                       config_file, tf_names)
    return report


__all__ = [
    "ConversionError",
    "add_characters",
    "add_pooler",
    "ConversionReport",
    "convert_bert",
    "convert_bert_hierarchical",
    "convert_legacy_nezha",
    "convert_tf",
    "corpus_characters",
    "hierarchical_positions",
    "initialised_pooler",
    "map_state_dict",
    "nezha_config_from_bert",
    "nezha_name",
    "read_pytorch_checkpoint",
    "read_tf_checkpoint",
    "saved_pooler",
]
