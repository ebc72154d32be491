"""One warning for a NEZHA folder whose tokenizer would cut its inputs at 512 tokens.

transformers 4.x-era NEZHA checkpoints carry BERT's `model_max_length: 512` in `tokenizer_config.json`. NEZHA reads
any length, but `pipeline("token-classification")`, sentence-transformers and CrossEncoder truncate to the
tokenizer's `model_max_length` (other pipelines when asked to truncate), so such a folder loses
everything past 512 tokens without a word.
`NezhaPreTrainedModel.from_pretrained`, which all of them call, runs `warn_if_tokenizer_caps_length` once the model
has loaded. The converters (`nezha-hf convert nezha` among them) write `model_max_length` 1,000,000.
"""

import os

from huggingface_hub import try_to_load_from_cache
from transformers.utils import logging

from .json_files import read_json

logger = logging.get_logger(__name__)

# BERT's 512 absolute positions: a cap at or below it was inherited from BERT. A longer cap is someone's choice for
# NEZHA (the converters write 1,000,000) and is left alone.
BERT_POSITIONS = 512
TOKENIZER_CONFIG = "tokenizer_config.json"


def tokenizer_config_path(path, folder: str | None, cache_dir=None, revision=None) -> str | None:
    """The `tokenizer_config.json` beside a model: in `folder` (a local folder), or, for a Hub id, in the snapshot
    already in the Hub cache (looked up on disk only, never fetched); None where there is none."""
    if folder is not None:
        candidate = os.path.join(folder, TOKENIZER_CONFIG)
        return candidate if os.path.isfile(candidate) else None
    if path is None:  # weights handed over directly (`state_dict=`): no folder
        return None
    cached = try_to_load_from_cache(str(path), TOKENIZER_CONFIG, cache_dir=cache_dir, revision=revision)
    return cached if isinstance(cached, str) else None


def tokenizer_cap(config_path: str) -> int | None:
    """The `model_max_length` a tokenizer config sets, if it is a whole number; None if it sets none (or the file
    cannot be read: loading the tokenizer reports that, not this check)."""
    try:
        config = read_json(config_path)
    except (OSError, ValueError):  # `JSONFileError` among them: nested too deeply, too large, not JSON
        return None
    cap = config.get("model_max_length") if isinstance(config, dict) else None
    return cap if isinstance(cap, int) and not isinstance(cap, bool) else None


def warn_if_tokenizer_caps_length(path, folder: str | None, cache_dir=None, revision=None) -> None:
    """Log one warning (per folder and process: transformers' `logger.warning_once`) if the tokenizer beside the
    model at `path` caps inputs at BERT's 512 tokens or fewer, naming the command that writes a copy without the cap.

    Through transformers' logging, as transformers' own notes on truncation ("Token indices sequence length is
    longer than the specified maximum sequence length") and on loading are: `TRANSFORMERS_VERBOSITY=error` silences
    both. A Python warning would answer to Python's filters instead, and fail test suites that run with `-W error`.
    """
    config_path = tokenizer_config_path(path, folder, cache_dir, revision)
    cap = tokenizer_cap(config_path) if config_path is not None else None
    if cap is None or cap > BERT_POSITIONS:
        return
    model_folder = os.path.realpath(os.path.dirname(config_path))
    logger.warning_once(
        f"The tokenizer in {model_folder} says model_max_length={cap} (BERT's limit, which NEZHA does not have): "
        f"token-classification pipelines, sentence-transformers and CrossEncoder cut every input at {cap} tokens "
        "without a word (other pipelines too when asked to truncate), and its notice that longer inputs "
        "\"will result in indexing errors\" is BERT's, untrue for NEZHA. "
        f"`nezha-hf convert nezha {model_folder} NEW_FOLDER` writes a copy whose tokenizer reads any length."
    )
