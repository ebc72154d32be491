"""How NEZHA models load, save and shard checkpoints: the rules `NezhaPreTrainedModel` adds to transformers'.

`NezhaLoadingMixin` holds them, each override saying which behaviour of transformers it changes (and
tests/test_modeling_nezha.py, "transformers still ...", fails if transformers changes that behaviour, so that the
override can go): checkpoints of transformers 4.x and of older releases (a `bert.` prefix, persisted buffers), errors
that name the checkpoint (a missing folder, a damaged file, tensors or layers that do not fit the config), a model
card and remote code on saving (`nezha_hf.hub`), and weights tied before sharding. The model itself is in
`modeling_nezha.py`; this file, like it, imports only transformers and its siblings, so that remote code copies it.
"""

import functools
import os
import re

from huggingface_hub import try_to_load_from_cache
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from transformers.modeling_utils import PreTrainedModel
from transformers.utils import logging

from .configuration_nezha import NezhaConfigError
from .json_files import read_json
from .named_files import check_links, weight_files
from .readers import check_weights_file
from .relative_attention import prepare_attention
from .tokenizer_cap import warn_if_tokenizer_caps_length

logger = logging.get_logger(__name__)


class CheckpointShapeError(ValueError, RuntimeError):
    """A checkpoint tensor whose shape does not fit the config: a `ValueError` (bad input) that also satisfies
    transformers' contract for size mismatches when loading (`RuntimeError`)."""


def _check_json_files(folder) -> None:
    """Read the JSON files transformers reads from a local model folder (its config and generation config) as
    `json_files.read_json` reads any: one bounded in size and depth (10 KB of brackets would exhaust the recursion of
    transformers' reader), and a regular file (transformers passes over a generation config that is a folder and
    generates with other settings), so that a damaged one is a `JSONFileError` naming it."""
    for name in ("config.json", "generation_config.json"):
        path = os.path.join(folder, name)
        if os.path.lexists(path):
            read_json(path)


def _check_weight_files(folder) -> list:
    """The weight files of the model folder `folder` (`named_files.weight_files`), each checked whole before
    transformers reads it (`readers.check_weights_file`: a safetensors header that reads, a torch file of plain
    tensors, weights' dtypes); an `UnusableFile` naming the first that is not."""
    files = weight_files(folder)
    for path in files:
        check_weights_file(path)
    return files


def _files_read(path, subfolder: str = "", cache_dir=None, revision=None) -> str | None:
    """The local folder transformers reads a model from, however it was named: a folder (and its `subfolder`), or a
    Hub id whose snapshot is in the cache (`cache_dir`, `revision`), so that every check here applies to what
    transformers reads. None for no path (weights handed over), or a Hub id not in the cache (transformers downloads
    it; nothing is there yet to check)."""
    if path is None:
        return None
    folder = _local_folder(path)
    if folder is not None:
        return os.path.join(folder, subfolder) if subfolder else folder
    name = f"{subfolder.strip('/')}/config.json" if subfolder else "config.json"
    cached = try_to_load_from_cache(str(path), name, cache_dir=cache_dir, revision=revision)  # on disk only
    return os.path.dirname(cached) if isinstance(cached, str) else None


def _non_finite(model) -> list[str]:
    """The names of the model's weights that hold a NaN or an infinity (a diverged run's, a damaged file's); of a
    sharded model, this process's part (no collective)."""
    names = []
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        if local.is_floating_point() and local.device.type != "meta" and not bool(local.isfinite().all()):
            names.append(name)
    return names


def _local_folder(path) -> str | None:
    """`path` (user folder expanded) when it can only be a local folder: a path object, or a string that is no
    model-hub id, or an existing folder; None for a hub id (and for no path, as with `state_dict=`)."""
    if path is None:
        return None
    folder = os.path.expanduser(path)
    if isinstance(path, os.PathLike) or os.path.isdir(folder):
        return folder
    try:
        validate_repo_id(str(path))
    except HFValidationError:
        return folder
    return None


def _not_corrupted(record) -> bool:
    """A logging filter: False for transformers' "This checkpoint seem corrupted" (see `NezhaLoadingMixin.tie_weights`)."""
    return not record.getMessage().startswith("This checkpoint seem corrupted")


class NezhaLoadingMixin:
    """Loading, saving and sharding for `NezhaPreTrainedModel` (which puts it before `PreTrainedModel`)."""

    # Buffers older releases persisted; they carry no information.
    _keys_to_ignore_on_load_unexpected = [
        r"relative_positions_encoding\.positions_encoding",
        r"embeddings\.token_type_ids",
        r"embeddings\.position_ids",
    ]
    # `import nezha_hf` sets this to the `nezha_hf.hub` module (model cards, remote code, uploads);
    # loaded as remote code without nezha_hf, it stays None and saving is transformers' own.
    hub_integration = None

    def _adjust_missing_and_unexpected_keys(self, loading_info) -> None:
        # Changes: transformers drops the buffers older releases persisted (`_keys_to_ignore_on_load_unexpected`)
        # in silence; NEZHA says it did, once (a note, never an error).
        before = set(loading_info.unexpected_keys)
        super()._adjust_missing_and_unexpected_keys(loading_info)
        dropped = sorted(key for key in before - set(loading_info.unexpected_keys)
                         if "pooler.dense." not in key and not key.startswith("cls."))  # a head's, not a buffer
        if dropped:
            logger.warning(
                f"Dropped {len(dropped)} persisted buffer(s) of an older NEZHA release; they carry no information "
                f"(the relative table is rebuilt): {', '.join(dropped[:4])}{' ...' if len(dropped) > 4 else ''}"
            )

    def tie_weights(self, missing_keys=None, recompute_mapping: bool = True):
        """Changes: transformers warns "This checkpoint seem corrupted" when both ends of a tied pair are absent; a
        checkpoint without the whole masked-LM head (a converted `BertModel`) is not corrupt, and the load report lists
        the head as missing, so that warning is left out then (the report stays)."""
        whole_head_missing = missing_keys is not None and {
            "cls.predictions.bias", "cls.predictions.transform.dense.weight"} <= set(missing_keys)
        if not whole_head_missing:
            return super().tie_weights(missing_keys=missing_keys, recompute_mapping=recompute_mapping)
        transformers_logger = logging.get_logger("transformers.modeling_utils")
        transformers_logger.addFilter(_not_corrupted)
        try:
            return super().tie_weights(missing_keys=missing_keys, recompute_mapping=recompute_mapping)
        finally:
            transformers_logger.removeFilter(_not_corrupted)

    @classmethod
    def maybe_distribute_model(cls, model, distributed_config, mesh_manager):
        """transformers' sharding for `from_pretrained(..., distributed_config=...)`, with tied weights tied first.

        Changes: transformers shards before it ties the weights; NEZHA ties first (and refuses pipeline parallelism).

        transformers 5.24 shards the model before it ties its weights: FSDP2 then manages the MLM decoder's own copy
        beside the word embeddings, re-tying afterwards leaves that copy in FSDP's buffers, and from the second step
        on training differs from one process (its own Llama with tied embeddings does the same). Tied here, they are
        one parameter, in one FSDP unit.
        """
        if mesh_manager is not None:
            if distributed_config.pp_size > 1:
                raise ValueError(
                    "NEZHA has no pipeline-parallel plan: transformers' pipeline engine splits the `layers`, "
                    "`embed_tokens` and `norm` of decoder-only models. Use fsdp_size and tp_size."
                )
            if distributed_config.dp_size > 1:
                model.tie_weights(recompute_mapping=False)
        return super().maybe_distribute_model(model, distributed_config, mesh_manager)

    def _move_missing_keys_from_meta_to_device(self, missing_keys, *args, **kwargs) -> None:
        """Changes: transformers materialises the missing weights but the targets of tied ones; NEZHA also
        materialises the source of a missing tied pair.

        Tied before sharding (`maybe_distribute_model`), the MLM bias and the decoder's bias are one parameter, which
        transformers lists as missing under the decoder's name only, a tied target it skips: a checkpoint without an
        MLM head (a converted BertModel) left `cls.predictions.bias` on the meta device, and FSDP2 training failed.
        """
        tied = self.all_tied_weights_keys
        sources = {tied[key] for key in missing_keys if key in tied}
        on_meta = {key for key in sources if self.get_parameter_or_buffer(key).device.type == "meta"}
        super()._move_missing_keys_from_meta_to_device(set(missing_keys) | on_meta, *args, **kwargs)

    def save_pretrained(self, save_directory, *args, model_card: dict | bool = True, remote_code: bool = False, **kwargs):
        """`PreTrainedModel.save_pretrained`, plus a model card and, if asked, remote code.

        Args:
            model_card: True (default) writes `README.md` from `nezha_hf.hub.build_model_card`, with the
                settings in `config.nezha_card` (the converters record `base_model` there); a dict adds
                settings (`license`, `datasets`, `eval_results`, ...); False writes none. A README not
                written by nezha_hf is never overwritten.
            remote_code: also copy the modeling files and write a complete `auto_map`, so that the folder
                loads with `trust_remote_code=True` where nezha_hf is not installed.

        The files are written into a temporary sibling of `save_directory` and moved in once all of them
        are complete. Cards and remote code need nezha_hf installed; loaded as remote code, this is
        transformers' own `save_pretrained`.

        A model sharded by `from_pretrained(..., distributed_config=...)` is saved as transformers saves it: every
        process calls this, all of them gather the weights, the first writes them, and none returns before the
        folder is in place. `distributed_checkpoint=True` writes transformers' per-process distributed checkpoint.
        """
        if self.hub_integration is None or kwargs.get("distributed_checkpoint"):
            return super().save_pretrained(save_directory, *args, **kwargs)
        if not self.should_save_on_this_rank(kwargs.get("is_main_process", True)):
            # Writes nothing; joins the gathers and barriers of a sharded model.
            super().save_pretrained(save_directory, *args, **{**kwargs, "is_main_process": False})
        else:
            save = functools.partial(PreTrainedModel.save_pretrained, self, *args, **kwargs)
            self.hub_integration.save_model(self, save, save_directory, model_card=model_card, remote_code=remote_code)
        # transformers' own barrier comes before the files are moved into place: wait for them too.
        self.barrier_after_gathered_checkpoint_save(getattr(self.config, "distributed_config", None))

    def push_to_hub(self, repo_id: str, *, model_card: dict | bool = True, remote_code: bool = False, **kwargs):
        """Upload to the Hub with a NEZHA model card (see `save_pretrained`); the only method that uses the network.

        Same arguments as transformers' `push_to_hub` (`commit_message`, `commit_description`,
        `private`, `token`, `revision`, `create_pr`, `max_shard_size`, `tags`), plus `model_card` and
        `remote_code`. `tags` are added to the card's tags (which always include `nezha`). Loaded as
        remote code without nezha_hf, this is transformers' own `push_to_hub`.
        """
        if self.hub_integration is None:
            return super().push_to_hub(repo_id, **kwargs)
        return self.hub_integration.push_model_to_hub(
            self, repo_id, model_card=model_card, remote_code=remote_code, **kwargs
        )

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """Load a checkpoint: transformers v4 NEZHA, or older releases that use a `bert.` prefix.

        Same arguments as `PreTrainedModel.from_pretrained`, plus `allow_new_layers=True` to accept a config
        with more layers than the checkpoint has (they are initialised randomly; without it that is a
        `ValueError`, as is a config with fewer layers). Persisted buffers of old releases are ignored. `.bin` files
        are read with `torch.load(weights_only=True)`, so a pickle that tries to run code is refused. A weight index
        may only name regular files inside the folder (`named_files.weight_files`). Errors name the checkpoint, and for tensors whose shape does not fit the config, each tensor with both shapes.

        Changes from transformers: a path that is no model-hub id and no folder is a `FileNotFoundError` (transformers
        would look it up on the Hub); a tokenizer beside the model that caps inputs at BERT's 512 tokens is one
        warning (`tokenizer_cap`); a damaged weights file is a `ValueError` naming the checkpoint; tensors that do
        not fit the config are a `ValueError` naming each with both shapes (transformers raises a `RuntimeError`
        that points to the report it logged, so NEZHA loads with `ignore_mismatched_sizes=True` and raises itself
        unless it was asked for).
        """
        path = pretrained_model_name_or_path
        folder = _local_folder(path)
        if folder is not None and not os.path.isdir(folder):
            raise FileNotFoundError(f"No such model folder: {path} (model-hub ids look like 'owner/name').")
        kwargs.setdefault("key_mapping", {r"^bert\.": "nezha."})
        strict_shapes = not kwargs.get("ignore_mismatched_sizes", False)
        wants_info = kwargs.pop("output_loading_info", False)
        allow_new_layers = kwargs.pop("allow_new_layers", False)
        # What transformers will read, however it was named (a subfolder, a snapshot in the Hub cache), checked first:
        # links held to the folder, its JSON bounded, the shards an index names inside it, each weights file whole.
        read_from = _files_read(path, kwargs.get("subfolder") or "", kwargs.get("cache_dir"), kwargs.get("revision"))
        files = []
        if read_from is not None:
            check_links(read_from)
            _check_json_files(read_from)
            files = _check_weight_files(read_from)
        try:
            model, info = super().from_pretrained(
                path, *args, **{**kwargs, "ignore_mismatched_sizes": True, "output_loading_info": True}
            )
        except NezhaConfigError as error:
            where = os.path.join(read_from, "config.json") if read_from else f"the config.json of {path}"
            raise NezhaConfigError(f"{where}: {error}") from None
        weights = ", ".join(os.path.basename(file) for file in files) or "its weights"
        non_finite = _non_finite(model)
        if non_finite:
            raise ValueError(f"The checkpoint at {path} ({weights}) holds values that are not finite (NaN or "
                             f"infinity) in "
                             f"{', '.join(non_finite[:3])}{' ...' if len(non_finite) > 3 else ''}: it is damaged, or "
                             "was saved from a training run that diverged.")
        # Built on the meta device, the model prepared nothing: now that its weights are placed, get its attention
        # ready where it runs (a model loaded onto another device never builds the CPU kernel).
        prepare_attention(model.config._attn_implementation, model.device)
        _check_layers(path, model.config.num_hidden_layers, info, allow_new_layers)
        if strict_shapes and info["mismatched_keys"]:
            details = "; ".join(
                f"{key}: checkpoint {tuple(ckpt)} vs model {tuple(model_shape)}"
                for key, ckpt, model_shape in sorted(info["mismatched_keys"])
            )
            raise CheckpointShapeError(
                f"The checkpoint at {path} ({weights}) does not fit its config: {details}. "
                "Fix config.json, or pass ignore_mismatched_sizes=True to re-initialise these tensors."
            )
        warn_if_tokenizer_caps_length(path, folder, kwargs.get("cache_dir"), kwargs.get("revision"))
        return (model, info) if wants_info else model


_LAYER_QUERY = re.compile(r"(?:^|\.)encoder\.layer\.(\d+)\.attention\.self\.query\.weight$")


def _check_layers(path, num_layers: int, info: dict, allow_new_layers: bool) -> None:
    """A config and a checkpoint of encoder layers that disagree on their number is an error (loading would give
    random layers, or drop trained ones, with a log line only), unless new layers are asked for."""
    def layers(keys):
        return sorted({int(match.group(1)) for key in keys if (match := _LAYER_QUERY.search(key))})

    extra, missing = layers(info["unexpected_keys"]), layers(info["missing_keys"])
    if extra:
        raise ValueError(f"The checkpoint at {path} has {num_layers + len(extra)} layers, but its config says "
                         f"num_hidden_layers={num_layers}: layers {extra} would be dropped. Fix config.json.")
    # A checkpoint with no layer at all is not a NEZHA encoder's: transformers' own report of missing keys applies.
    if missing and len(missing) < num_layers and not allow_new_layers:
        raise ValueError(f"The checkpoint at {path} has {num_layers - len(missing)} layers, but its config says "
                         f"num_hidden_layers={num_layers}: layers {missing} would be random. Fix config.json, or "
                         "pass allow_new_layers=True to add them on purpose.")
