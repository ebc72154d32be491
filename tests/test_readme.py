"""The README, run as a user runs it: every code block, top to bottom, in one folder, offline.

Its chain (convert a BERT, pretrain it, train a summariser, summarise a JSONL file and a .txt folder, evaluate,
export to ONNX, summarise from the exported folder, then load the results with the Auto classes and a pipeline)
runs on tiny stand-ins for the files a user has and a test cannot (`STAND_INS`); nothing in the README's text is
substituted. Shell blocks run in bash; Python blocks run in one interpreter, in order, as in a notebook; a Python
block whose first line is `# NAME.py` is written to that file, for the shell block that runs it. The blocks this
test does not run are in `RUN_ELSEWHERE`, with what runs them.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

# What the test puts where the README expects a user's files. The model hub and Google's downloads are out of reach,
# and the demo's real BERT would make the chain take an hour on two cores.
STAND_INS = {
    "demo-output/minilm-bert/": "a BERT of 2 layers, 64 wide, with a character vocabulary of the bundled judgments",
    "demo-output/judgments/, demo-output/cail2020-*.jsonl": "the bundled judgments, written by "
                                                             "`nezha_hf.demo.write_example_inputs` as `make demo` writes them",
    "chinese_L-12_H-768_A-12/": "a 2-layer BERT saved as a TensorFlow checkpoint in Google's layout",
    "nezha-old-release/": "a 2-layer NEZHA in an older release's layout (tests/fixtures/.../legacy-mlm-bert-prefix)",
}
# Blocks run by something other than `test_the_readme_runs_top_to_bottom`, found by a line they contain.
RUN_ELSEWHERE = {
    "pip install -e": "test_the_install_block_installs_into_a_fresh_environment",
    "make demo": "make test runs in CI (.ci/run), which is what runs this file; `make demo`: "
                 "test_make_demo_runs_as_the_readme_says",
}


def readme_blocks() -> list[tuple[int, str, str]]:
    """`(line, language, code)` of every fenced code block of the README."""
    blocks = []
    for match in re.finditer(r"^```(\w*)\n(.*?)^```", README.read_text(encoding="utf-8"), flags=re.M | re.S):
        line = README.read_text(encoding="utf-8")[: match.start()].count("\n") + 1
        blocks.append((line, match.group(1), match.group(2)))
    return blocks


def elsewhere(code: str) -> str | None:
    return next((runner for needle, runner in RUN_ELSEWHERE.items() if needle in code), None)


def test_every_block_is_run_by_some_test():
    """Each block is a shell or Python block, and one of the tests below runs it."""
    blocks = readme_blocks()
    assert blocks and all(language in ("bash", "python") for _, language, _ in blocks), blocks
    assert sum(elsewhere(code) is not None for _, _, code in blocks) == len(RUN_ELSEWHERE)


# --- the stand-ins -----------------------------------------------------------------------------------------------


def tiny_bert(folder: Path, judgments) -> None:
    """A BertModel (as all-MiniLM-L6-v2 is) with a character vocabulary, saved with its tokenizer."""
    folder.mkdir(parents=True)
    characters = sorted({c for j in judgments for c in j.text + (j.summary or "") if not c.isspace()})
    (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *characters]) + "\n",
                                      encoding="utf-8")
    tokenizer = transformers.BertTokenizerFast.from_pretrained(folder)
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=128, max_position_embeddings=512)
    transformers.BertModel(config).save_pretrained(folder)


def tensorflow_release(folder: Path) -> None:
    """Google's layout: bert_model.ckpt.*, bert_config.json and vocab.txt in one folder."""
    from helpers import SMALL_BERT, make_tokenizer, small_bert
    from test_conversion import tf_variables, write_tf_checkpoint

    bert = small_bert()
    write_tf_checkpoint(tf_variables(bert, "bert"), folder / "bert_model.ckpt")
    config = {k: v for k, v in bert.config.to_dict().items() if k in (*SMALL_BERT, "type_vocab_size", "hidden_act")}
    (folder / "bert_config.json").write_text(json.dumps(config))
    make_tokenizer(folder / "tokenizer")
    shutil.copy(folder / "tokenizer" / "vocab.txt", folder / "vocab.txt")
    shutil.rmtree(folder / "tokenizer")


def put_stand_ins(workdir: Path) -> None:
    from helpers import FIXTURES

    from nezha_hf.demo import held_out_split, write_example_inputs

    (workdir / "demo-output").mkdir()
    training, held_out = held_out_split()
    tiny_bert(workdir / "demo-output" / "minilm-bert", [*training, held_out])  # before: the real one is not copied
    write_example_inputs(workdir / "demo-output")
    tensorflow_release(workdir / "chinese_L-12_H-768_A-12")
    shutil.copytree(FIXTURES / "legacy-mlm-bert-prefix", workdir / "nezha-old-release")


# --- running blocks ------------------------------------------------------------------------------------------------

# A Python session fed one block at a time (a JSON string per line); after each it prints a marker and the outcome.
SESSION = r"""
import json, sys, traceback
namespace = {"__name__": "__main__"}
for line in sys.stdin:
    try:
        exec(compile(json.loads(line), "<README block>", "exec"), namespace)
        outcome = "ok"
    except BaseException:
        outcome = traceback.format_exc()
    sys.stdout.flush()
    print("\x00block-done " + json.dumps(outcome), flush=True)
"""


class Session:
    def __init__(self, workdir, environment):
        self.process = subprocess.Popen([sys.executable, "-u", "-c", SESSION], cwd=workdir, env=environment,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def run(self, code: str) -> tuple[str, str]:
        """`(printed, outcome)`: what the block printed, and "ok" or its traceback."""
        self.process.stdin.write(json.dumps(code) + "\n")
        self.process.stdin.flush()
        printed = []
        for line in self.process.stdout:
            if line.startswith("\x00block-done "):
                return "".join(printed), json.loads(line.removeprefix("\x00block-done "))
            printed.append(line)
        return "".join(printed), f"the session ended (exit status {self.process.wait()})"

    def close(self):
        self.process.stdin.close()
        self.process.wait(timeout=60)


def environment(workdir: Path) -> dict:
    """The README's environment: its commands on the PATH, nothing from the model hub, caches inside the test."""
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            "HF_HUB_OFFLINE": "1", "HF_HOME": str(workdir / ".hf-home"), "TOKENIZERS_PARALLELISM": "false"}


def ids(path: Path) -> list[str]:
    return [json.loads(line)["id"] for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.mark.slow
def test_the_readme_runs_top_to_bottom(tmp_path):
    """Every block not in `RUN_ELSEWHERE`, in order; then what the chain wrote is what the README says."""
    put_stand_ins(tmp_path)
    env = environment(tmp_path)
    session = Session(tmp_path, env)
    outputs = {}
    try:
        for line, language, code in readme_blocks():
            if elsewhere(code):
                continue
            if language == "bash":
                done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", code], cwd=tmp_path, env=env,
                                      capture_output=True, text=True, timeout=1800)
                assert done.returncode == 0, f"README.md:{line}\n{code}\n{done.stderr[-3000:]}"
                outputs[line] = done.stdout
            elif (name := re.fullmatch(r"# (\S+\.py)", code.splitlines()[0])) is not None:
                (tmp_path / name.group(1)).write_text(code, encoding="utf-8")
            else:
                printed, outcome = session.run(code)
                assert outcome == "ok", f"README.md:{line}\n{code}\n{outcome}"
                outputs[line] = printed
    finally:
        session.close()

    # The chain: each step's output is what the next one needs, and what the README says it is.
    adapted = json.loads((tmp_path / "nezha-adapted" / "config.json").read_text())
    assert adapted["use_cache"] is True  # Trainer's training value (False) was saved, and the export failed
    test_ids = ids(tmp_path / "demo-output" / "cail2020-test.jsonl")
    assert ids(tmp_path / "summaries.jsonl") == test_ids
    files = sorted(p.stem for p in (tmp_path / "demo-output" / "judgments").glob("*.txt"))
    assert ids(tmp_path / "folder-summaries.jsonl") == ids(tmp_path / "served.jsonl") == files
    extracted = [[json.loads(line)["extracted"] for line in (tmp_path / name).read_text().splitlines()]
                 for name in ("folder-summaries.jsonl", "served.jsonl", "summaries-2.jsonl")]
    assert extracted[0] == extracted[1] == extracted[2]  # the exported extractor, and two processes, agree
    assert (tmp_path / "my-summarizer-onnx" / "generator" / "export.json").is_file()
    assert (tmp_path / "nezha-adapted.onnx").is_file() and (tmp_path / "nezha-from-tf" / "config.json").is_file()
    assert (tmp_path / "nezha-mlm" / "model.safetensors").is_file() and (tmp_path / "nezha-fsdp").is_dir()
    assert "| predictions | char |" in "".join(outputs.values())


# --- the blocks run elsewhere ---------------------------------------------------------------------------------------


def block_with(needle: str) -> str:
    return next(code for _, _, code in readme_blocks() if needle in code)


@pytest.mark.slow
def test_the_install_block_installs_into_a_fresh_environment(tmp_path):
    """The install block, as written, in a copy of the repository: a new virtual environment, then the package with
    the extras the chain needs; its command answers."""
    copy = tmp_path / "nezha_hf"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".git", ".venv*", "demo-output", "*.egg-info",
                                                              "__pycache__", "build"))
    python = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    env = {key: value for key, value in os.environ.items() if key not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = f"{python.parent}{os.pathsep}{env['PATH']}"
    script = block_with("pip install -e") + "\nnezha-hf --version\npython -c 'import nezha_hf, onnxruntime'\n"
    done = subprocess.run(["bash", "-e", "-c", script], cwd=copy, env=env, capture_output=True, text=True,
                          timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1].startswith("nezha-hf ")


@pytest.mark.slow
def test_make_demo_runs_as_the_readme_says():
    """`make demo` in the repository, as the README's second block says; it ends by listing what it wrote, which
    the chain above starts from."""
    assert "make demo" in block_with("make demo")
    done = subprocess.run(["make", "demo"], cwd=ROOT, capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.findall(r"^\[(\d)\]", done.stdout, flags=re.M) == ["1", "2", "3"]
    for path in ("minilm-bert/config.json", "cail2020-train.jsonl", "cail2020-test.jsonl", "minilm-nezha/config.json"):
        assert (ROOT / "demo-output" / path).is_file(), path
    assert list((ROOT / "demo-output" / "judgments").glob("*.txt"))
