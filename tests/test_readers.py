"""Issue 69: every read of a file goes through the reader its row in `nezha_hf.inventory` names. A call that opens,
loads, lists or parses a file anywhere else in the package (`open`, `torch.load`, `safe_open`, `InferenceSession`,
`json.load(s)`, a glob of a folder, ...) fails this test, naming the place, until it moves into a reader or the table
says why it reads no input (`NOT_INPUTS`)."""

import ast
from pathlib import Path

from nezha_hf import inventory

REPO = Path(__file__).resolve().parents[1]
# Calls that read a file or list a folder: by the name called (`open(...)`, `safe_open(...)`) or the attribute
# (`path.read_bytes()`, `torch.load(...)`, `folder.glob(...)`).
READING_NAMES = {"open", "safe_open", "load_file", "InferenceSession", "FileSystemReader", "ZipFile"}
READING_ATTRIBUTES = {"open", "load", "loads", "safe_open", "load_file", "InferenceSession", "glob", "rglob", "iterdir",
                      "listdir", "scandir", "walk", "read_text", "read_bytes", "load_checkpoint", "FileSystemReader",
                      "load_model", "load_model_from_string", "ZipFile", "fromfile", "read_metadata", "file_digest"}
# Triton's `tl.load` reads GPU memory, not a file.
NOT_FILES = {"tl"}


def reading_calls(path: Path) -> list[tuple[str, str, int]]:
    """`(function, call, line)` for each call in `path` that reads a file: the function as `module.function` (a
    method as `module.Class.method`)."""
    module = path.stem
    found = []

    def visit(node, scope):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, [*scope, child.name])
                continue
            if isinstance(child, ast.Call):
                function = child.func
                if isinstance(function, ast.Name) and function.id in READING_NAMES:
                    found.append((".".join([module, *scope]), ast.unparse(function), child.lineno))
                elif (isinstance(function, ast.Attribute) and function.attr in READING_ATTRIBUTES
                      and not (isinstance(function.value, ast.Name) and function.value.id in NOT_FILES)):
                    found.append((".".join([module, *scope]), ast.unparse(function), child.lineno))
            visit(child, scope)

    visit(ast.parse(path.read_text(encoding="utf-8")), [])
    return found


def package_files() -> list[Path]:
    return sorted([*(REPO / "nezha_hf").glob("*.py"), REPO / "nezha_hf_cli.py"])


def allowed(function: str) -> bool:
    """Whether `function` may read files: a reader a row names, or a place `NOT_INPUTS` names (a whole module, or a
    function and what it encloses)."""
    places = inventory.readers() | set(inventory.NOT_INPUTS)
    return any(function == place or function.startswith(place + ".") for place in places)


def test_no_file_is_read_outside_the_readers_the_inventory_names():
    stray = [f"{path.relative_to(REPO)}:{line} {function}: {call}(...)"
             for path in package_files() for function, call, line in reading_calls(path) if not allowed(function)]
    assert not stray, ("files read outside a reader; route them through one, or name the reader in "
                       "nezha_hf/inventory.py:\n" + "\n".join(stray))


def test_every_reader_the_inventory_names_exists_and_reads():
    """A reader named in the table is a function of the package (a stale name would let any read pass)."""
    import importlib

    for place in sorted(inventory.readers() | set(inventory.NOT_INPUTS)):
        module, _, name = place.partition(".")
        if "/" in module:  # a script of the repository's: benchmarks/gpu/gpu_check
            module = module.replace("/", ".")
        else:
            module = f"nezha_hf.{module}" if module != "nezha_hf_cli" else module
        target = importlib.import_module(module)
        for part in filter(None, name.split(".")):
            assert hasattr(target, part), f"{place}: no such function"
            target = getattr(target, part)


def test_the_scan_sees_each_kind_of_read():
    """The scan itself: each kind of call it looks for is found, in a function and at a module's top."""
    source = ("import json, torch\nfrom safetensors import safe_open\nCONFIG = json.loads(open('x').read())\n"
              "def f(path):\n    torch.load(path)\n    safe_open(path, 'pt')\n    path.read_bytes()\n"
              "    path.parent.glob('*')\n    tl.load(path)\n")
    sample = REPO / "tests" / "_scan_sample.py"
    try:
        sample.write_text(source, encoding="utf-8")
        calls = [(function, call) for function, call, _ in reading_calls(sample)]
    finally:
        sample.unlink()
    assert calls == [("_scan_sample", "json.loads"), ("_scan_sample", "open"), ("_scan_sample.f", "torch.load"),
                     ("_scan_sample.f", "safe_open"), ("_scan_sample.f", "path.read_bytes"),
                     ("_scan_sample.f", "path.parent.glob")]


def test_the_inventory_page_shows_the_tables_as_the_code_holds_them():
    page = (REPO / "docs" / "robustness.md").read_text(encoding="utf-8")
    assert inventory.markdown() in page, "docs/robustness.md: paste nezha_hf.inventory.markdown() into its table section"
