"""transformers' own common test mixins, imported from the files `tests/fetch_transformers_tests.py` fetched.

`test_modeling_common.py` and `test_configuration_common.py` come unchanged from the transformers
source distribution of the installed version. Three modules they import are not in that
distribution; these are the smallest stand-ins that let them run:

- `generation.test_utils.GenerationTesterMixin`: an empty class, there because `test_modeling_common` imports it
  and asks the tester of a model that generates to inherit it. The real mixin runs `generate()` in every decoding
  mode; neither the wheel nor the source distribution has it (the 5.24.0 sdist's tests/ has no generation/ or
  exporters/ folder), so `tests/test_generation_nezha.py` checks each mode itself, against plain greedy.
- `exporters.test_export.ExportTesterMixin`: `test_torch_export`, which exports every head with
  `torch.export` and compares the exported program with eager mode, and `test_onnx_export` (slow), every head
  through transformers' `OnnxExporter` under static shapes, its named outputs and values against eager mode's.
- `utils.test_configuration_utils.config_common_kwargs`: non-default values of every field of
  transformers' own `PreTrainedConfig`.

`add_nezha_to_name_tables()` adds NEZHA's classes to transformers' static name tables
(`MODEL_FOR_*_MAPPING_NAMES`), which the mixins consult; the tests remove them again afterwards.
"""

import copy
import importlib
import sys
import types

import pytest
import torch
import transformers.models.auto.modeling_auto as modeling_auto
import transformers.testing_utils as testing_utils
from fetch_transformers_tests import target_directory

import nezha_hf

PACKAGE = "transformers_common_tests"
# The static table each Auto class's names live in.
NAME_TABLES = {
    "AutoModel": "MODEL_MAPPING_NAMES",
    "AutoModelForPreTraining": "MODEL_FOR_PRETRAINING_MAPPING_NAMES",
    "AutoModelForMaskedLM": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "AutoModelForNextSentencePrediction": "MODEL_FOR_NEXT_SENTENCE_PREDICTION_MAPPING_NAMES",
    "AutoModelForSequenceClassification": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "AutoModelForMultipleChoice": "MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES",
    "AutoModelForTokenClassification": "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
    "AutoModelForQuestionAnswering": "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES",
    "AutoModelForCausalLM": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
}


class GenerationTesterMixin:
    """Stand-in (see the module docstring): marks a tester whose models generate."""


class ExportTesterMixin:
    """Stand-in (see the module docstring): every head through `torch.export` and ONNX, against eager mode."""

    def test_torch_export(self):
        if not self.test_torch_exportable:
            self.skipTest("test_torch_exportable is False for this tester")
        from transformers.exporters.exporter_dynamo import (
            register_cache_pytrees_for_model,
        )

        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        for model_class in self.all_model_classes:
            model = model_class(config).eval()
            register_cache_pytrees_for_model(model)  # as transformers' exporter does: caches are model outputs
            kwargs = self._prepare_for_class(inputs, model_class)
            program = torch.export.export(model, (), kwargs)
            with torch.no_grad():
                expected = model(**kwargs)
            got = program.module()(**kwargs)
            for name, value in expected.items():
                if isinstance(value, torch.Tensor):
                    torch.testing.assert_close(got[name], value, atol=1e-5, rtol=0, msg=f"{model_class.__name__}.{name}")

    @pytest.mark.slow
    def test_onnx_export(self):
        """Every head through transformers' `OnnxExporter`, static shapes: eager's named outputs, a cache's
        `cache.layers.N.keys` / `.values` included (named as transformers' exporter names them), and eager's values.
        Dynamic shapes: `tests/test_export.py::test_transformers_onnx_exporter_exports_every_head` (exported at one
        length, run at another), so the two do not export every head twice."""
        if not self.test_torch_exportable:
            self.skipTest("test_torch_exportable is False for this tester")
        pytest.importorskip("onnxruntime", reason="the [onnx] extra is not installed")
        from transformers.exporters import OnnxConfig, OnnxExporter
        from transformers.exporters.utils import get_leaf_tensors

        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        for model_class in self.all_model_classes:
            model = model_class(config).eval()
            kwargs = self._prepare_for_class(inputs, model_class)
            with torch.no_grad():
                expected = get_leaf_tensors(model(**copy.deepcopy(kwargs)))
            label = model_class.__name__
            exported = OnnxExporter().export(model, copy.deepcopy(kwargs), OnnxConfig(dynamic=False))
            got = get_leaf_tensors(exported(**copy.deepcopy(kwargs)))
            self.assertEqual(set(got), set(expected), label)
            for name, value in expected.items():
                torch.testing.assert_close(torch.as_tensor(got[name]), value, atol=1e-5, rtol=0, msg=f"{label}: {name}")


config_common_kwargs = {
    "return_dict": False,
    "output_hidden_states": True,
    "dtype": "float16",
    "chunk_size_feed_forward": 5,
    "architectures": ["NezhaForMaskedLM"],
    "problem_type": "regression",
    "id2label": {0: "LABEL_0", 1: "LABEL_1", 2: "LABEL_2"},
    "label2id": {"LABEL_0": 0, "LABEL_1": 1, "LABEL_2": 2},
}


def _module(name: str, **attributes) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    sys.modules[name] = module
    return module


def load(name: str) -> types.ModuleType:
    """`test_modeling_common` or `test_configuration_common`, imported from the fetched files."""
    directory = target_directory()
    if not (directory / f"{name}.py").is_file():
        raise RuntimeError(
            f"transformers' common tests are not in {directory}: run `python tests/fetch_transformers_tests.py` "
            "(the install step of `make test` does)."
        )
    if PACKAGE not in sys.modules:
        # As RUN_SLOW=1 does for transformers' own CI: its slow tests (e.g. compiled training) run too.
        testing_utils._run_slow_tests = True
        _module(PACKAGE, __path__=[str(directory)])
        for part, attributes in (("exporters", {}), ("generation", {}), ("utils", {})):
            _module(f"{PACKAGE}.{part}", __path__=[], **attributes)
        _module(f"{PACKAGE}.exporters.test_export", ExportTesterMixin=ExportTesterMixin)
        _module(f"{PACKAGE}.generation.test_utils", GenerationTesterMixin=GenerationTesterMixin)
        _module(f"{PACKAGE}.utils.test_configuration_utils", config_common_kwargs=config_common_kwargs)
    return importlib.import_module(f"{PACKAGE}.{name}")


def add_nezha_to_name_tables() -> list:
    """Add `"nezha"` to each static table NEZHA has an Auto class for; returns what to remove afterwards."""
    added = []
    for head in nezha_hf.NEZHA_HEADS:
        if head.auto_class is not None:
            table = getattr(modeling_auto, NAME_TABLES[head.auto_class])
            if "nezha" not in table:
                table["nezha"] = head.model_class.__name__
                added.append(table)
    return added
