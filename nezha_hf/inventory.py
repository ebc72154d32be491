"""Every file nezha_hf reads or resumes from, and every output it writes: one table each, with who reads (or writes)
it, through which reader, what it must hold and what happens when it does not.

`tests/test_fault_matrix.py` is generated from these tables: for every row, every fault of `FAULTS` is a test case,
unless the row excuses it (`excused`, with the reason); `tests/test_readers.py` fails on any read of a file outside
the readers the rows name (`READERS`) and the `NOT_INPUTS` below. docs/robustness.md shows the tables
(`markdown()` renders them; a test keeps the page and the code the same).
"""

from dataclasses import dataclass, field

# What can be wrong with a file, by kind. A row meets each one (a test case), or excuses it with the reason.
FAULTS = {
    # the file itself
    "missing": "not there",
    "empty": "zero bytes",
    "truncated": "its first half only",
    "garbage": "random bytes of its size",
    "flipped": "one byte in its middle changed",
    "folder": "a folder where the file should be",
    "fifo": "a FIFO (reading waits for a writer)",
    "device": "a character device (reading never ends)",
    "link_out": "a symbolic link to a file outside its folder",
    "unreadable": "a file the process may not read (EACCES)",
    # what it holds
    "wrong_shape": "well-formed, of another shape (JSON of another schema, tensors of other shapes)",
    "out_of_range": "a value out of range (an id beyond the vocabulary, a size, a length)",
    "wrong_dtype": "tensors of another dtype (integers where weights are)",
    "non_finite": "weights with NaN or infinity",
    "tokenizer": "a tokenizer the model cannot use (another vocabulary, a special token missing)",
    # where it came from
    "foreign": "the same file of another model or run",
    "swapped": "two files of the folder exchanged",
    "mixed": "half of one folder, half of another",
    # how it was named (transformers' loaders)
    "subfolder": "found through `subfolder=`",
    "hub_cache": "found in the Hub cache (`cache_dir=`, `revision=`, a snapshot path)",
    "relative": "named by a relative path",
}

# What a command does when one of its files has a fault.
OUTCOMES = {
    "refused": "one line naming the file (and the field), exit status 2, before any output is written",
    "skipped": "skipped with a warning naming it and why; the run resumes from the last intact checkpoint",
    "left out": "named in one line and left out; the rest is read and the command goes on (exit 0)",
    "rebuilt": "a warning naming it; it is built again",
    "named line": "one line naming the file and the line, exit status 2; a line is never taken half-read",
}


@dataclass(frozen=True)
class FileRow:
    """One kind of file nezha_hf reads: where it lies, who reads it, through which reader (`module.function`, each
    in `READERS`), what it must hold, and what happens otherwise (`OUTCOMES`). `excused`: the faults (`FAULTS`) the
    row cannot meet, each with the reason."""

    id: str
    file: str
    read_by: str
    readers: tuple[str, ...]
    holds: str
    outcome: str
    excused: dict[str, str] = field(default_factory=dict)


_NOT_TENSORS = {"wrong_dtype": "holds no tensors", "non_finite": "holds no tensors"}
_NOT_A_TOKENIZER = {"tokenizer": "is not a tokenizer file"}
_NOT_NAMED = {"subfolder": "a command reads local folders only; `from_pretrained` rows are tried so",
              "hub_cache": "a command reads local folders only; `from_pretrained` rows are tried so"}
_OWN_FOLDER_RELATIVE = {"relative": "named by its folder, which the `config` row tries relative"}
_JSON = {**_NOT_TENSORS, **_NOT_A_TOKENIZER}
# A model folder from elsewhere carries no record of which files belong together (a folder nezha_hf writes as one
# piece carries its manifest): a file of another model of the same shapes loads, as that model's.
_NO_RECORD = ("no record in a model folder from elsewhere says which files belong together: another model's file of "
              "the same shapes loads as that model's (files of other shapes are the `foreign` case)")
_A_TEXT = {"flipped": "a changed byte in a text is another text, read as such (or a line that no longer parses, "
                      "named and skipped)"}
_RUN_STATE = {**_NOT_A_TOKENIZER, **_NOT_NAMED, **_OWN_FOLDER_RELATIVE,
              "link_out": "a checkpoints folder is the run's own: a link is followed as any file the run wrote, and "
                          "the manifest checks its bytes"}

FILES = (
    # --- a model folder (convert's source, pretrain's and train-summarizer's base, export's model, from_pretrained)
    FileRow("config", "`<model>/config.json`", "every command that loads a model; `from_pretrained`",
            ("checkpoints.model_folder", "named_files.check_links", "loading_nezha._check_json_files",
             "json_files.read_json", "configuration_nezha.NezhaConfig"),
            "a JSON object of at most 16 MiB: a NEZHA (or BERT) config whose every value `NezhaConfig` accepts",
            "refused", {**_JSON, "swapped": "the only file of its kind in the folder", "mixed": _NO_RECORD}),
    FileRow("weights", "`<model>/model.safetensors`, `pytorch_model.bin`, shards", "every command that loads a model",
            ("readers.check_weights_file", "readers.read_weights", "loading_nezha._check_weight_files",
             "conversion.read_pytorch_checkpoint"),
            "a whole safetensors or torch file of floating tensors (no code in a pickle), shapes that fit the config, "
            "finite values", "refused",
            {**_NOT_A_TOKENIZER, "flipped": "a changed byte in a weight's value is another number: no format check "
             "sees it in a folder from elsewhere (a folder nezha_hf wrote as one piece has a manifest)",
             "out_of_range": "a weight has no range: any finite number is a weight (`non_finite` is tried)",
             "swapped": "the only weights file (sharded weights: the `weight_index` row)", "mixed": _NO_RECORD}),
    FileRow("weight_index", "`<model>/model.safetensors.index.json` (and `.bin` and variant indexes)",
            "every command that loads a model", ("named_files.weight_files",),
            "a `weight_map` naming regular files inside the folder", "refused",
            {**_JSON, "mixed": "an index only names files: another folder's index is the `foreign` case"}),
    FileRow("generation_config", "`<model>/generation_config.json`", "generation, summarising, export",
            ("loading_nezha._check_json_files", "generation_nezha.NezhaUniLMGenerationMixin._check_special_ids"),
            "a JSON object; padding, start and end ids integers below `vocab_size`", "refused",
            {**_JSON, "missing": "optional: the model's defaults apply (a summariser's manifest requires it)",
             "swapped": "the only file of its kind", "mixed": _NO_RECORD}),
    FileRow("tokenizer_files", "`<model>/tokenizer_config.json`, `tokenizer.json`, `special_tokens_map.json`, "
            "`added_tokens.json`, `vocab.txt`, chat templates", "every command that reads text",
            ("checkpoints.check_tokenizer_files", "checkpoints.load_tokenizer", "checkpoints.check_tokenizer",
             "documents.read_text"),
            "regular files inside the folder, JSON bounded in size and depth; the tokenizer of the model's vocabulary "
            "with [CLS], [SEP] and its padding id", "refused", {**_NOT_TENSORS, **_NOT_NAMED}),
    # --- a summariser folder (train-summarizer's output, export onnx's output)
    FileRow("summarizer_settings", "`<summariser>/summarizer.json`", "summarize, export onnx",
            ("summarization.summarizer_settings",), "`threshold` in [0, 1], `token_budget` and `num_beams` whole "
            "numbers (beams at most 64), no other key", "refused",
            {**_JSON, **_NOT_NAMED, "swapped": "the only file of its kind", "foreign": "any valid settings are "
             "this summariser's (the manifest leaves the file out so that it may be edited)",
             "mixed": "any valid settings are this summariser's"}),
    FileRow("summarizer_manifest", "`<summariser>/nezha_manifest.json` (and every file it lists)",
            "summarize, export onnx", ("readers.manifest_problem", "readers.check_manifest", "readers.file_digest",
                                       "readers._covered_files"),
            "the size and SHA-256 of every file of the folder as it was written; no file added", "refused",
            {**_NOT_TENSORS, **_NOT_NAMED, "swapped": "the only file of its kind",
             "missing": "required for an exported summariser; a trained one saved by an older nezha_hf has none: a "
                        "warning says so and the other checks apply"}),
    FileRow("export_manifest", "`<exported summariser>/<part>/export.json`", "summarize (an exported summariser)",
            ("summarization.check_export", "summarization.load_exported_summarizer"),
            "ONNX components named by plain file names in the folder, a `prefill` and a `decode` with a cache, a "
            "static cache of 1 to 2^20 positions that fits in memory", "refused", {**_JSON, **_NOT_NAMED}),
    FileRow("onnx_program", "`<exported summariser>/<part>/*.onnx` and `*.onnx.data`", "summarize",
            ("readers.check_onnx_program", "summarization.programs_of"),
            "an ONNX model ONNX's checker accepts, its weights in regular files inside the folder holding every byte "
            "it reads; the bytes the export wrote (the manifest)", "refused", {**_JSON, **_NOT_NAMED}),
    # --- a training run: pretrain's and train-summarizer's `<output>.checkpoints/`
    FileRow("run_record", "`<output>.checkpoints/nezha_run.json`", "pretrain, train-summarizer (a rerun)",
            ("checkpoints.RunRecord.read", "checkpoints.prepare_checkpoints", "checkpoints.fingerprint"),
            "the record of the run: command, base and data (paths and digests), settings", "refused",
            {**_JSON, **_RUN_STATE, "swapped": "the only file of its kind"}),
    FileRow("checkpoint", "`<output>.checkpoints/checkpoint-N/`: `trainer_state.json`, `model.safetensors`, "
            "`optimizer/.metadata` and its pieces, `scheduler.pt`, `rng_state*.pth`, `nezha_run.json`, "
            "`nezha_manifest.json`", "pretrain, train-summarizer (a rerun)",
            ("checkpoints.checkpoint_problem", "checkpoints.last_complete_checkpoint", "readers.manifest_problem",
             "readers.distributed_checkpoint_problem", "readers.load_state_file"),
            "every file as its save wrote it (the manifest), a trainer state Trainer takes, loadable state files, the "
            "record of this run", "skipped", _RUN_STATE),
    FileRow("journal", "`.<output>.progress/record.json` and `done-*.jsonl` (summarize's finished batches)",
            "summarize (a rerun)", ("distributed._open_journal", "distributed._read_journal"),
            "the record of the same work; lines of results, each the record of the judgment it claims",
            "named line", {**_RUN_STATE, "wrong_dtype": "holds no tensors", "non_finite": "holds no tensors"}),
    # --- inputs
    FileRow("judgments", "judgments: `.jsonl` / `.json` (CAIL2020) and `.txt` files, or folders of them",
            "summarize, train-summarizer, evaluate", ("cail.read_judgments", "documents.read_text",
                                                       "documents._input_bytes", "documents._walk",
                                                       "json_files.parse_json"),
            "UTF-8 (or UTF-16, or `--encoding`) text; JSON lines with an `id` and a `text`; named directly, a file "
            "that cannot be read is refused in one line", "left out",
            {**_JSON, **_NOT_NAMED, **_A_TEXT, "swapped": "one file", "foreign": "any judgment is an input",
             "mixed": "any judgments are inputs"}),
    FileRow("predictions", "`evaluate --predictions` JSONL", "evaluate", ("cail.read_predictions",),
            "one line per judgment with a reference: an `id` and a `summary` string", "refused",
            {**_JSON, **_NOT_NAMED, **_A_TEXT, "fifo": "named directly, a pipe is read (`<(command)`)",
             "swapped": "one file", "mixed": "lines are matched by id: lines of two files are the `foreign` case"}),
    FileRow("corpus", "pretrain's corpus and `convert --add-characters`: `.txt` / `.jsonl` files or folders",
            "pretrain, convert", ("documents.read_documents", "documents.read_text", "documents._input_bytes",
                                  "documents._walk"),
            "text as judgments are read", "left out",
            {**_JSON, **_NOT_NAMED, **_A_TEXT, "swapped": "one file", "foreign": "any text is a corpus",
             "mixed": "any texts are a corpus", "out_of_range": "any length of text is a corpus"}),
    # --- conversion sources
    FileRow("tf_checkpoint", "`convert tf`: a TensorFlow checkpoint (`.index`, `.data-*`) and `bert_config.json`",
            "convert tf", ("conversion.read_tf_checkpoint",),
            "a checkpoint TensorFlow reads, of BERT's or NEZHA's variables", "refused",
            {**_NOT_A_TOKENIZER, **_NOT_NAMED, "flipped": "a changed byte in a weight's value is another number",
             "non_finite": "converted as it is, then refused where a NEZHA loads it",
             "wrong_dtype": "not tried: Google's and Huawei's checkpoints hold float32 variables; another dtype is "
                            "written as it is, and refused where the converted folder is verified",
             "mixed": "an index and its data of two checkpoints is the `foreign` case: TensorFlow's checksums refuse it",
             "relative": "a prefix is named as the user types it; the `foreign` and `swapped` cases name it so too"}),
    # --- caches
    FileRow("kernel_cache", "`$TORCH_EXTENSIONS_DIR/nezha_hf_fused_attention_*/`: the built kernel and "
            "`nezha_build.json`", "the fused attention engine, on first use in a process",
            ("fused_attention._load_kernel", "fused_attention.built_kernel_problem"),
            "the library this environment built (its SHA-256 in `nezha_build.json`)", "rebuilt",
            {**_JSON, **_NOT_NAMED, "relative": "its place is fixed", "swapped": "one file",
             "link_out": "a cache of the user's own: a link is followed as any file, and its digest checked",
             "wrong_shape": "a library has no shape", "out_of_range": "a library has no values",
             "foreign": "another build's library is caught by its digest (the `flipped` case)",
             "mixed": "one file"}),
    FileRow("triton_cache_archive", "the GPU check's carried Triton cache: `.gpu/triton-cache.tar.gz` or its parts "
            "`.00`, `.01`, ...", "`benchmarks/gpu/gpu_check.py` on the device machine",
            ("benchmarks/gpu/gpu_check.restore_cache", "benchmarks/gpu/gpu_check._read_part"),
            "a gzip tar of regular files and folders inside the cache (no link of any kind, device or FIFO)",
            "rebuilt", {**_JSON, **_NOT_NAMED, "relative": "its place is fixed", "swapped": "parts are read in "
                        "their order, a swap is the `garbage` case", "wrong_shape": "an archive of other files is a "
                        "cache Triton does not use: its kernels compile", "out_of_range": "no values",
                        "foreign": "another machine's cache: Triton keys its kernels by their source and target",
                        "mixed": "parts of two archives do not unpack (the `garbage` case)"}),
)

# Functions that read files (or list folders) without being a row's reader, and why that is not reading one: the
# package's own files, the outputs a command writes and checks, the system's.
NOT_INPUTS = {
    "regular_files.open_regular_file": "the one place every reader opens a file",
    "fused_attention._cpu_signature": "the system's /proc/cpuinfo",
    "fused_attention.kernel_name": "the kernel's source, shipped with the package",
    "fused_attention._source_in": "its own copy of the kernel's source in the build folder",
    "fused_attention.compile_kernel": "PyTorch's build of the package's source",
    "demo.write_example_inputs": "the demo's data, shipped with the package",
    "hub.build_model_card": "model-card templates, shipped with the package",
    "version.package_version": "the package's own pyproject.toml",
    "checkpoints.RunRecord.create": "a deep copy of settings through JSON, no file",
    "export.export_onnx": "onnxruntime on the file the export just wrote, to check it before it is put in place",
    "summarization.write_summaries": "the output just written, checked before it is put in place",
    "distributed.run_batches": "the journal it appends to (an output)",
    "safe_output": "outputs: staging, locks, swaps (the module)",
}


@dataclass(frozen=True)
class OutputRow:
    """One output a command writes, who writes it and how it is kept whole."""

    id: str
    output: str
    written_by: str
    writer: str


OUTPUTS = (
    OutputRow("converted", "a converted model folder", "convert bert / nezha / tf", "safe_output.staged_folder"),
    OutputRow("pretrained", "a model folder and its `.checkpoints/`", "pretrain",
              "checkpoints.TrainingRun.staged_output, DistributedCheckpointTrainer"),
    OutputRow("summarizer", "a summariser folder and its `.checkpoints/`", "train-summarizer",
              "checkpoints.TrainingRun.staged_output, DistributedCheckpointTrainer"),
    OutputRow("summaries", "a `.jsonl` / `.txt` file and its `.progress/` journal", "summarize",
              "safe_output.staged_file, distributed.run_batches"),
    OutputRow("onnx", "an `.onnx` file or an exported summariser folder", "export onnx",
              "safe_output.staged_file, safe_output.staged_folder"),
)
# What can happen to an output while it is written. Each ends in one line naming the output (and, for room, the file
# system and what is free on it), nothing in place of the destination, and the destination as it was.
WRITE_FAULTS = {
    "disk_full": "the file system has no room (or a file may not grow: EFBIG)",
    "read_only": "the destination's folder refuses new files (EROFS)",
    "killed": "the process is killed (SIGKILL) at a write; the next run cleans what it left and can go on",
}


def readers() -> set[str]:
    """Every function a row names as its reader."""
    return {reader for row in FILES for reader in row.readers}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown() -> str:
    """The tables as docs/robustness.md shows them."""
    lines = ["| file | read by | reader | must hold | otherwise | faults excused, and why |", "|---|---|---|---|---|---|"]
    for row in FILES:
        excused = "; ".join(f"{fault}: {why}" for fault, why in row.excused.items()) or "none"
        readers_cell = ", ".join(f"`{reader}`" for reader in row.readers)
        lines.append("| " + " | ".join(_cell(cell) for cell in (
            f"{row.file} ({row.id})", row.read_by, readers_cell, row.holds, f"{row.outcome}: {OUTCOMES[row.outcome]}",
            excused)) + " |")
    lines += ["", "| output | written by | writer |", "|---|---|---|"]
    lines += [f"| {_cell(row.output)} ({row.id}) | {_cell(row.written_by)} | `{row.writer}` |" for row in OUTPUTS]
    lines += ["", "Faults tried on every file (each row meets it or says why not above): "
              + "; ".join(f"`{name}` ({what})" for name, what in FAULTS.items()) + ".",
              "", "Faults tried on every output: "
              + "; ".join(f"`{name}` ({what})" for name, what in WRITE_FAULTS.items()) + "."]
    return "\n".join(lines) + "\n"


__all__ = ["FAULTS", "FILES", "NOT_INPUTS", "OUTCOMES", "OUTPUTS", "WRITE_FAULTS", "FileRow", "OutputRow", "markdown",
           "readers"]
