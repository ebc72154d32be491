"""The package as users get it: no import cycles, package data in the wheel, the demo from an installed copy."""

import ast
import os
import re
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

import nezha_hf

PACKAGE = Path(nezha_hf.__file__).parent
REPO = PACKAGE.parent


def module_imports(path: Path) -> set[str]:
    """Modules of nezha_hf that `path` imports anywhere, inside functions included."""
    imported = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:
                imported.add(node.module.split(".")[0])
            elif node.level == 1:
                imported.update(alias.name for alias in node.names)
            elif node.module and node.module.startswith("nezha_hf"):
                parts = node.module.split(".")
                imported.update([parts[1]] if len(parts) > 1 else [alias.name for alias in node.names])
        elif isinstance(node, ast.Import):
            imported.update(a.name.split(".")[1] for a in node.names if a.name.startswith("nezha_hf."))
    return imported


def test_no_import_cycles_not_even_lazy_ones():
    modules = {path.stem: path for path in PACKAGE.glob("*.py") if path.stem != "__init__"}
    graph = {name: module_imports(path) & set(modules) for name, path in modules.items()}

    def visit(name, stack):
        assert name not in stack, "import cycle: " + " -> ".join([*stack, name])
        for other in graph[name]:
            visit(other, [*stack, name])

    for name in graph:
        visit(name, [])
    # The command line calls the package, never the reverse (its module lives outside it: `--help` stays light).
    assert not [path.name for path in PACKAGE.glob("*.py") if path.name != "__main__.py"
                and re.search(r"^\s*(from|import) nezha_hf_cli", path.read_text(encoding="utf-8"), re.MULTILINE)]
    # The modeling file imports only the config and its siblings for attention, generation and checkpoint loading, as
    # remote code requires; generation knows nothing of the model classes.
    assert graph["modeling_nezha"] == {"configuration_nezha", "relative_attention", "generation_nezha", "loading_nezha"}
    assert "modeling_nezha" not in graph["generation_nezha"] and graph["tokenizer_cap"] == {"json_files"}
    # Copied with the modeling file as remote code: the readers import no sibling but each other's base.
    assert not graph["regular_files"] and graph["json_files"] == {"regular_files"}
    assert graph["named_files"] == {"json_files", "regular_files"}
    assert {"tokenizer_cap", "json_files", "named_files"} <= graph["loading_nezha"]


def test_an_older_transformers_is_refused_in_words():
    """The floor the code states is pyproject.toml's, and an older transformers (a remote-code user's) gets it said."""
    import tomllib

    from nezha_hf.configuration_nezha import MINIMUM_TRANSFORMERS

    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["dependencies"]
    assert f"transformers>={MINIMUM_TRANSFORMERS},<6" in dependencies
    # transformers replaces its top module while importing its model layers: the version is set after that.
    older = subprocess.run([sys.executable, "-c", "import transformers.modeling_layers, transformers; "
                            "transformers.__version__ = '5.23.0'; import nezha_hf"],
                           capture_output=True, text=True, timeout=300)
    assert older.returncode != 0
    assert f"ImportError: NEZHA needs transformers>={MINIMUM_TRANSFORMERS}; this is 5.23.0" in older.stderr


@pytest.mark.slow
def test_installed_package_runs_the_demo_from_any_folder(tmp_path):
    """Build the wheel, install it into a fresh virtual environment, and run `nezha-hf demo --quick` from elsewhere."""
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-v", "-w",
                            str(tmp_path / "dist"), str(REPO)], check=True, capture_output=True, text=True, timeout=600)
    assert "Warning" not in built.stdout + built.stderr, [line for line in (built.stdout + built.stderr).splitlines()
                                                           if "Warning" in line]
    wheel = next((tmp_path / "dist").glob("nezha_hf-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in ("nezha_hf_cli.py", "nezha_hf/csrc/fused_attention.cpp", "nezha_hf/demo_data/cail2020-examples.jsonl",
                   "nezha_hf/demo_data/nezha-v4-mlm/model.safetensors", "nezha_hf/model_cards/converted.md"):
        assert needed in names, needed
    # A fresh environment that sees this one's dependencies (not its nezha_hf) and gets the wheel.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    site = next((venv / "lib").glob("python*/site-packages"))
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                   check=True, capture_output=True, timeout=600)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    done = subprocess.run([str(venv / "bin" / "nezha-hf"), "demo", "--quick", "--tokens", "600"], cwd=elsewhere,
                          capture_output=True, text=True, timeout=1800, env=environment)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "every weight loaded, none left over" in done.stdout and "| predictions | char |" in done.stdout
    assert str(venv) in subprocess.run([str(venv / "bin" / "python"), "-c", "import nezha_hf; print(nezha_hf.__file__)"],
                                       cwd=elsewhere, capture_output=True, text=True, env=environment).stdout


def test_the_pythons_claimed_are_those_ci_tests_and_the_dependencies_allow():
    """requires-python: no older than what transformers itself requires (3.10 was claimed while transformers 5.21+
    needs 3.11), and its oldest version and the newest one are tested by `make test` (3.11 in .venv, PYTHONS)."""
    from importlib import metadata

    def version(text):
        return tuple(int(part) for part in text.split(".")[:2])

    claimed = version(re.search(r'requires-python = ">=([\d.]+)"', (REPO / "pyproject.toml").read_text()).group(1))
    needed = version(re.search(r">=\s*([\d.]+)", metadata.metadata("transformers")["Requires-Python"]).group(1))
    assert claimed >= needed
    tested = {(3, 11), *map(version, re.search(r"^PYTHONS := (.*)$", (REPO / "Makefile").read_text(), re.M)
                                      .group(1).split())}
    assert claimed in tested and max(tested) >= (3, 13)
