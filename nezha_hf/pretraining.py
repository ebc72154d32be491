"""Continued masked-LM pretraining: teach a converted BERT (or adapt any NEZHA) on your own text.

A BERT converted with `nezha-hf convert` has lost its word order: its absolute position
embeddings are gone and NEZHA's relative positions are new to it. Masked-LM training on long
text gives it back. This module does that with Trainer:

- documents from `.txt` / JSONL files (`nezha_hf.documents`), tokenised with the model's tokenizer;
- whole-word masking for Chinese: words come from jieba, every token of a chosen word is masked
  (transformers' own whole-word masking finds words by gaps between tokens, and Chinese text has
  none, so it would treat a whole run of characters as one word);
- documents packed into sequences of `max_length` tokens (default 1,024), `[SEP]` between documents;
- resumable: rerunning with the same output continues from the last complete checkpoint of the same
  run (one whose save was interrupted is skipped, with a warning naming it); checkpoints of a run with
  another base model, other data or other settings are refused;
- on several processes (`accelerate launch`, `torchrun`): DDP, or transformers' FSDP2 with `--fsdp`
  (`nezha_hf.distributed`).

    nezha-hf pretrain converted-bert/ corpus/*.txt --output nezha-adapted/ --max-steps 20000
    accelerate launch --num_processes 4 -m nezha_hf pretrain converted-bert/ corpus/ --output nezha-adapted/ --fsdp

or, in Python, `continue_pretraining("converted-bert/", ["corpus/"], "nezha-adapted/", max_steps=20000)`.
"""

import bisect
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import TrainerCallback, TrainerState, TrainingArguments
from transformers.distributed import DistributedConfig
from transformers.utils import logging

from .checkpoints import (TrainingRun, check_tokenizer, finished, load_tokenizer, model_folder, prepare_checkpoints,
                          read_trainer_state)
from .json_files import JSON_OBJECT, read_json
from .configuration_nezha import NezhaConfig
from .conversion import add_pooler, initialised_pooler, saved_pooler
from .distributed import cpu_only, on_main
from .hub import write_model_card
from .documents import jieba_words, read_documents, refused_files
from .modeling_nezha import NezhaForMaskedLM
from .padding import attention_mask_for, pad_rows

logger = logging.get_logger(__name__)
NOT_A_WORD = -1


def jieba_word_ids(text: str, offsets: list[tuple[int, int]]) -> list[int]:
    """For each token (given by its character offsets in `text`), the index of the jieba word it starts in."""
    word_starts, position = [], 0
    for word in jieba_words(text):
        word_starts.append(position)
        position += len(word)
    return [bisect.bisect_right(word_starts, start) - 1 for start, _ in offsets]


def pack_documents(tokenizer, texts, max_length: int = 1024, show_progress: bool = True) -> list[dict]:
    """Tokenise texts and pack them into `[CLS] ... [SEP]` sequences of at most `max_length` tokens.

    Returns examples with `index` (their position in the list), `input_ids` and `word_ids` (the jieba
    word of each token, numbered from 0 within a sequence; -1 on special tokens).
    """
    if max_length < 8:
        raise ValueError(f"max_length={max_length} is too short to pack documents.")
    content_length = max_length - 2
    examples, ids, words = [], [], []

    def flush():
        if ids:
            renumbered = {w: n for n, w in enumerate(dict.fromkeys(w for w in words if w != NOT_A_WORD))}
            examples.append({
                "index": len(examples),
                "input_ids": [tokenizer.cls_token_id, *ids, tokenizer.sep_token_id],
                "word_ids": [NOT_A_WORD, *(renumbered.get(w, NOT_A_WORD) for w in words), NOT_A_WORD],
            })
            ids.clear()
            words.clear()

    word_offset = 0
    for text in tqdm(texts, desc="tokenising", unit="doc", disable=not show_progress):
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        doc_words = [word_offset + w for w in jieba_word_ids(text, encoded["offset_mapping"])]
        word_offset = (max(doc_words) + 1) if doc_words else word_offset
        for token, word in zip(encoded["input_ids"] + [tokenizer.sep_token_id], doc_words + [NOT_A_WORD]):
            ids.append(token)
            words.append(word)
            if len(ids) == content_length:
                flush()
    flush()
    return examples


class WholeWordMaskCollator:
    """Pads packed examples and masks whole words, BERT style.

    Words are drawn in random order until `mlm_probability` of the tokens are covered; each token
    of a chosen word becomes `[MASK]` (80%), a random token (10%) or stays (10%). `labels` hold the
    original ids at masked positions and -100 elsewhere.

    An example with an `index` (as `pack_documents` gives each) is masked with a generator seeded by
    `(seed, epoch, index)`: the same example gets the same mask in the same epoch however it is
    batched, and a run resumed from a checkpoint masks exactly as the uninterrupted run would have
    (Trainer restores its random state only after drawing the first resumed batch). `epoch` is set by
    `MaskingEpochCallback`. Examples without an `index` use torch's global random state.
    """

    def __init__(self, tokenizer, mlm_probability: float = 0.15, pad_to_multiple_of: int | None = None, seed: int = 0):
        if not 0 < mlm_probability < 1:
            raise ValueError(f"mlm_probability must be in (0, 1), got {mlm_probability}.")
        self.tokenizer = tokenizer
        self.mlm_probability = mlm_probability
        self.pad_to_multiple_of = pad_to_multiple_of
        self.seed, self.epoch = seed, 0

    def mask_row(self, word_ids: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Bool mask of the tokens to predict in one row."""
        is_word = word_ids >= 0
        num_words = int(word_ids.max()) + 1 if is_word.any() else 0
        if num_words == 0:
            return torch.zeros_like(is_word)
        budget = max(1, round(int(is_word.sum()) * self.mlm_probability))
        order = torch.randperm(num_words, generator=generator)
        sizes = torch.bincount(word_ids[is_word], minlength=num_words)[order]
        chosen = order[: int((sizes.cumsum(0) < budget).sum()) + 1]
        return is_word & torch.isin(word_ids, chosen)

    def _generator(self, feature: dict) -> torch.Generator | None:
        if "index" not in feature:
            return None
        return torch.Generator().manual_seed((self.seed * 1_000_003 + self.epoch) * 1_000_003 + int(feature["index"]))

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        ids, multiple = [f["input_ids"] for f in features], self.pad_to_multiple_of
        input_ids = pad_rows(ids, self.tokenizer.pad_token_id, multiple).clone()
        word_ids = pad_rows([f["word_ids"] for f in features], NOT_A_WORD, multiple)
        labels = torch.full_like(input_ids, -100)
        for row, feature in enumerate(features):
            generator = self._generator(feature)
            masked = self.mask_row(word_ids[row], generator)
            labels[row, masked] = input_ids[row, masked]
            roll = torch.rand(input_ids.shape[1], generator=generator)
            input_ids[row, masked & (roll < 0.8)] = self.tokenizer.mask_token_id
            random_positions = masked & (roll >= 0.8) & (roll < 0.9)
            input_ids[row, random_positions] = torch.randint(
                len(self.tokenizer), (int(random_positions.sum()),), generator=generator
            )
        return {"input_ids": input_ids, "attention_mask": attention_mask_for(ids, multiple), "labels": labels}


class MaskingEpochCallback(TrainerCallback):
    """Tells a `WholeWordMaskCollator` which epoch begins, so that each epoch masks its examples anew."""

    def __init__(self, collator: WholeWordMaskCollator):
        self.collator = collator

    def on_epoch_begin(self, args, state, control, **kwargs):
        self.collator.epoch = int(state.epoch or 0)


def training_summary(trained, arguments, processes: int, documents: int, sequences: int, max_length: int,
                     mlm_probability: float) -> str:
    """What `continue_pretraining` ran, in words, for the model card: data, steps, batch, learning rate, final loss."""
    losses = [entry["loss"] for entry in trained.log_history if "loss" in entry]
    batch = arguments.per_device_train_batch_size * arguments.gradient_accumulation_steps * processes
    loss = f"; the last logged training loss was {losses[-1]:.3f}" if losses else ""
    return (f"Continued masked-LM pretraining with `nezha-hf pretrain`: {documents:,} documents packed into "
            f"{sequences:,} sequences of up to {max_length:,} tokens, whole-word masking of {mlm_probability:.0%} of "
            f"the tokens; {trained.global_step:,} steps of {batch:,} sequences, peak learning rate "
            f"{arguments.learning_rate:g}, {'bfloat16' if arguments.bf16 else 'float32'}{loss}.")


def masked_lm_from(model_path, **loading) -> NezhaForMaskedLM:
    """`NezhaForMaskedLM.from_pretrained(model_path)`, saying in one line when the checkpoint has no masked-LM head (a
    converted `BertModel`), which then starts untrained, instead of transformers' "This checkpoint seem corrupted"
    and its table of missing keys; anything else missing or left over is a warning naming it."""
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        model, info = NezhaForMaskedLM.from_pretrained(model_path, output_loading_info=True, **loading)
    finally:
        logging.set_verbosity(verbosity)
    head = sorted(key for key in info["missing_keys"] if key.startswith("cls.predictions."))
    missing = sorted(set(info["missing_keys"]) - set(head))
    if missing or info["unexpected_keys"]:
        logger.warning(f"Loading {model_path}: left over {sorted(info['unexpected_keys'])}, missing (random) {missing}.")
    if head:
        logger.warning(f"{model_path} has no masked-LM head (a converted BertModel): a new one is trained with the rest.")
    return model


def check_is_nezha(model_path) -> None:
    """A `ValueError` unless `model_path` holds a NEZHA checkpoint: a BERT (or any other model type) loaded as NEZHA
    would lose its absolute positions in silence, with nothing saying that `convert bert` is the step that does it
    (and reports what it drops)."""
    config = model_folder(model_path) / "config.json"
    model_type = read_json(config, JSON_OBJECT).get("model_type")  # the one reader: bounded, errors name the file
    if model_type == "bert":
        raise ValueError(f"{model_path} is a BERT: run `nezha-hf convert bert {model_path} NEW_FOLDER` first, then "
                         "pretrain NEW_FOLDER.")
    if model_type not in (None, "nezha"):
        raise ValueError(f"{model_path} is a {model_type!r} checkpoint, not a NEZHA: only NEZHA checkpoints (and BERTs "
                         "after `nezha-hf convert bert`) continue pretraining.")


def continue_pretraining(
    model_path: str | Path,
    files,
    output_dir: str | Path,
    max_length: int = 1024,
    mlm_probability: float = 0.15,
    txt_split: str = "blank-lines",
    encoding: str | None = None,
    resume: bool = True,
    overwrite: bool = False,
    show_progress: bool = True,
    fsdp: bool = False,
    **training_arguments,
) -> dict:
    """Continue masked-LM training of the model in `model_path` on `files`; save the result in `output_dir`.

    Args:
        model_path: a NEZHA checkpoint with its tokenizer (e.g. the output of `nezha-hf convert bert`).
        files: `.txt` / JSONL files or folders (`nezha_hf.documents.read_documents`; `.txt` files are
            split into documents on blank lines by default). A file named here that cannot be read (its encoding,
            its kind, no text in it) is an `InputFileError`, before any training; one found in a folder is left out
            with a warning naming it.
        encoding: the encoding of input files that are neither UTF-8 nor UTF-16, e.g. `"gb18030"`
            (`nezha_hf.documents.read_text`); without it, such files are refused.
        output_dir: receives the model and tokenizer, ready for `from_pretrained`, once training ends. Trainer
            checkpoints go to the sibling `<output_dir>.checkpoints/`, with a record of what the run started
            from. An existing non-empty `output_dir` is replaced only with `overwrite=True`.
        max_length: tokens per packed sequence.
        resume: continue from the last complete checkpoint of the same run (same base model, data and
            settings; `checkpoints.prepare_checkpoints`); checkpoints of another run are refused. False starts
            over (deleting the old checkpoints). A run already at its end is not trained further.
        fsdp: with several processes (`accelerate launch`, `torchrun`), shard the model with transformers' FSDP2
            (`DistributedConfig(fsdp_size=<processes>)`, every encoder layer its own unit) instead of keeping a
            whole copy per process (DDP). Checkpoints of either resume on any number of processes.
        training_arguments: passed to `TrainingArguments` (`max_steps`, `per_device_train_batch_size`,
            `learning_rate`, `save_steps`, `gradient_accumulation_steps`, `bf16`, ...).

    Returns:
        Trainer's training metrics (`train_loss`, `train_runtime`, ...); empty when the run had already ended.
        A loss or weights that stop being finite end the run with `checkpoints.NotFiniteError`, writing nothing.
    """
    check_is_nezha(model_path)
    run = TrainingRun("pretrain", model_path, files, output_dir, overwrite)
    state = run.state
    defaults = dict(
        per_device_train_batch_size=8, learning_rate=5e-5, warmup_steps=0.06, weight_decay=0.01, save_steps=500,
        save_total_limit=2, logging_steps=50, report_to=[], disable_tqdm=not show_progress, use_cpu=cpu_only(),
    )
    settings = {**defaults, **training_arguments}
    show_progress = show_progress and state.is_main_process
    with run.claimed():
        tokenizer = load_tokenizer(model_path)
        check_tokenizer(tokenizer, NezhaConfig.from_pretrained(model_path), model_path,
                        needs=("cls_token", "sep_token", "pad_token", "mask_token"))
        problems = []  # the data before the model: a file that cannot be read is refused before it is loaded
        texts = [document.text for document in read_documents(files, txt_split, problems, encoding)]
        if not texts:
            reasons = "; ".join(map(str, problems[:3])) + ("; ..." if len(problems) > 3 else "")
            raise ValueError(f"No text found in {list(map(str, files))}{': ' + reasons if reasons else ''}.")
        sharding = {}
        if fsdp and state.num_processes > 1:
            sharding["distributed_config"] = DistributedConfig(fsdp_size=state.num_processes)
        model = masked_lm_from(model_path, **sharding)
        dataset = pack_documents(tokenizer, texts, max_length, show_progress)
        if state.is_main_process:
            for problem in problems:  # once, by the main process
                logger.warning(f"skipped {problem}")
            refused = len(refused_files(problems))
            logger.warning(f"Packed {len(texts)} documents into {len(dataset)} sequences of up to {max_length} "
                           f"tokens ({len(problems) - refused} input lines skipped, {refused} files left out).")
        arguments = TrainingArguments(output_dir=str(run.checkpoints), remove_unused_columns=False, **settings)
        record = run.record({"max_length": max_length, "mlm_probability": mlm_probability, "txt_split": txt_split,
                             "encoding": encoding, "seed": arguments.seed}, settings)
        last = on_main(state, lambda: prepare_checkpoints(run.checkpoints, record, resume))
        with run.staged_output() as staging:  # model and tokenizer appear together
            if finished(last, arguments.max_steps):
                if state.is_main_process:
                    logger.warning(f"{last} already ends this run: nothing more to train.")
                    NezhaForMaskedLM.from_pretrained(last).save_pretrained(staging)
                metrics = {}
                trained = TrainerState(**read_trainer_state(last))  # checked: `checkpoint_problem`
            else:
                collator = WholeWordMaskCollator(tokenizer, mlm_probability, seed=arguments.seed)
                trainer = run.trainer(model=model, args=arguments, train_dataset=dataset, data_collator=collator,
                                      callbacks=[MaskingEpochCallback(collator)])
                metrics = run.train(trainer, last)
                trainer.save_model(str(staging))
                trained = trainer.state
            if state.is_main_process:
                tokenizer.save_pretrained(str(staging))
                # The masked LM has no pooler; the base's (or one drawn once) is saved with it, so that a classifier
                # built on the output reads the same pooler at every load.
                add_pooler(staging, saved_pooler(model_path) or initialised_pooler(
                    model.config, model.dtype, arguments.seed))
                summary = training_summary(trained, arguments, state.num_processes, len(texts), len(dataset), max_length,
                                           mlm_probability)
                write_model_card(staging, "NezhaForMaskedLM", {**(getattr(model.config, "nezha_card", None) or {}),
                                                               "training_summary": summary})
    return metrics
