"""NEZHA's rows in PEFT's default target-module tables, filled in without importing PEFT.

PEFT chooses the layers an adapter wraps, when a config names no `target_modules` (`LoraConfig(task_type="SEQ_CLS")`,
`IA3Config()`, ...), from tables keyed by `config.model_type`: `TRANSFORMERS_MODELS_TO_<METHOD>_TARGET_MODULES_MAPPING`
and IA3's `TRANSFORMERS_MODELS_TO_IA3_FEEDFORWARD_MODULES_MAPPING`, all in `peft.utils.constants`. They have no
`"nezha"` rows (transformers 5 has no NEZHA), so those calls fail with "Please specify `target_modules`".
NEZHA's layers carry BERT's module names (`query`, `key`, `value`, `attention.output.dense`, `intermediate.dense`,
`output.dense`), so each table's `"nezha"` row is a copy of its `"bert"` row (LoRA: `query` and `value`).

`import nezha_hf` calls `register()`: with PEFT already imported it fills the tables at once; otherwise it puts a
finder on `sys.meta_path` that fills them the moment `peft.utils.constants` has run, before any other module of PEFT
reads or copies them (PEFT's tuners hold these very dicts, and its tables for newer methods are copies made in
`constants` itself). Importing PEFT imports every one of its tuners, which `import nezha_hf` does not do for users
who never call PEFT; where PEFT is not installed, nothing happens. A row PEFT ships itself is left as it is. Adapters saved with
these defaults record their `target_modules`, so loading them needs none of this.
"""

import copy
import importlib.abc
import sys

TABLES_MODULE = "peft.utils.constants"
# What marks this module's finder on `sys.meta_path`. `importlib.reload` (IPython's %autoreload) makes a new class and
# a new finder each time, so the finder is known by this name, never by its identity: one installed by an earlier
# load is replaced, not joined (two would ask each other for the module until the recursion limit).
HOOK_MARKER = "nezha_hf.peft_targets:FillTablesOnImport"


def is_hook(finder) -> bool:
    """Whether `finder` (on `sys.meta_path`) is this module's, from this load of it or an earlier one."""
    return getattr(finder, "nezha_hf_hook", None) == HOOK_MARKER


def is_target_table(name: str, value) -> bool:
    """Whether a module global of PEFT is a table of default module names keyed by `model_type`."""
    return (name.startswith("TRANSFORMERS_MODELS_TO_") and name.endswith("_MODULES_MAPPING")
            and isinstance(value, dict))


def fill_tables(modules) -> None:
    """Give every target-module table of `modules` (PEFT's modules) that has a `"bert"` row a `"nezha"` row equal
    to it, unless it has one."""
    for module in modules:
        for name, table in list(vars(module).items()):
            if is_target_table(name, table) and "bert" in table:
                table.setdefault("nezha", copy.copy(table["bert"]))


class FillTablesOnImport(importlib.abc.MetaPathFinder):
    """An import hook that finds nothing itself: when `peft.utils.constants` is imported, it lets the other finders
    find it and wraps the loader so that the module's tables are filled as soon as it has run."""

    nezha_hf_hook = HOOK_MARKER

    def find_spec(self, fullname, path, target=None):
        """The spec the other finders give `peft.utils.constants`, its loader filling the tables after it runs;
        None (not ours to find) for every other module."""
        if fullname != TABLES_MODULE:
            return None
        for finder in sys.meta_path:
            if is_hook(finder) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = FillAfterRunning(spec.loader)
                return spec
        return None


class FillAfterRunning(importlib.abc.Loader):
    """A module's own loader (every other attribute is the loader's), with `fill_tables` run on the module once
    its code has run. The module then gets its own loader back, so nothing after the import sees this one."""

    def __init__(self, loader):
        self.loader = loader

    def __getattr__(self, name):
        if name == "loader":  # not set yet (a copy being made): no loader to ask
            raise AttributeError(name)
        return getattr(self.loader, name)

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        fill_tables([module])
        module.__loader__ = module.__spec__.loader = self.loader


_FINDER = FillTablesOnImport()


def register() -> None:
    """NEZHA's rows in PEFT's target-module tables: at once if PEFT is imported, else when it is (see the module's
    documentation). Called by `import nezha_hf`; calling it again, or after reloading this module, leaves one hook
    (`HOOK_MARKER`) where the first was."""
    hooks = [index for index, finder in enumerate(sys.meta_path) if is_hook(finder)]
    if hooks:
        sys.meta_path[hooks[0]] = _FINDER
        for index in reversed(hooks[1:]):
            del sys.meta_path[index]
    else:
        sys.meta_path.insert(0, _FINDER)
    # Already run: fill its tables, and any copy another module of PEFT has made under a table's name.
    if TABLES_MODULE in sys.modules:
        fill_tables([module for name, module in list(sys.modules.items())
                     if (name == "peft" or name.startswith("peft.")) and module is not None])
