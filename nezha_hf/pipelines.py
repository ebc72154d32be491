"""Extractive question answering as a pipeline task, which transformers v5 removed.

transformers 5 dropped `pipeline("question-answering")` for every model (it raises a KeyError
pointing to chat models). Extractive QA with `NezhaForQuestionAnswering` is still useful, so
`import nezha_hf` registers it under the name `"extractive-question-answering"`:

    qa = pipeline("extractive-question-answering", model=model, tokenizer=tokenizer)
    qa(question="谁是原告？", context=judgment)   # {"answer", "score", "start", "end"}

The whole context is read in one pass (NEZHA has no length cap), so there is no striding, and the best
span is found in memory linear in the length (no table of every start/end pair).
"""

import torch
from torch import nn
from transformers import AutoModelForQuestionAnswering, Pipeline
from transformers.pipelines import PIPELINE_REGISTRY

TASK = "extractive-question-answering"


class ExtractiveQuestionAnsweringPipeline(Pipeline):
    """Finds the answer span in `context` for `question`; `max_answer_length` caps the span in tokens."""

    def _sanitize_parameters(self, max_answer_length=None, **kwargs):
        postprocess = {} if max_answer_length is None else {"max_answer_length": max_answer_length}
        return {}, {}, postprocess

    def __call__(self, question: str | None = None, context: str | None = None, **kwargs):
        if question is None or context is None:
            raise ValueError("Pass question= and context=.")
        return super().__call__({"question": question, "context": context}, **kwargs)

    def preprocess(self, inputs):
        encoded = self.tokenizer(
            inputs["question"], inputs["context"], return_tensors="pt", return_offsets_mapping=True, verbose=False
        )
        sequence_ids = encoded.sequence_ids(0)
        offsets = encoded.pop("offset_mapping")[0]
        return {**encoded, "context": inputs["context"], "offsets": offsets,
                "in_context": torch.tensor([s == 1 for s in sequence_ids])}

    def _forward(self, model_inputs):
        extras = {key: model_inputs.pop(key) for key in ("context", "offsets", "in_context")}
        outputs = self.model(**model_inputs)
        return {"start_logits": outputs.start_logits[0], "end_logits": outputs.end_logits[0], **extras}

    def postprocess(self, outputs, max_answer_length: int = 30):
        in_context = outputs["in_context"]
        if not bool(in_context.any()):
            raise ValueError("The context is empty: there is no span to take an answer from.")
        start = outputs["start_logits"].float().masked_fill(~in_context, float("-inf")).log_softmax(-1)
        end = outputs["end_logits"].float().masked_fill(~in_context, float("-inf")).log_softmax(-1)
        # The best end for each start s lies in [s, s + max_answer_length): a sliding maximum over the end
        # scores (a strided view, no copy), so the best pair costs linear memory, not a length x length table.
        width = max(1, min(max_answer_length, len(end)))
        windows = nn.functional.pad(end, (0, width - 1), value=float("-inf")).unfold(0, width, 1)
        best_end, end_offset = windows.max(-1)
        pair = start + best_end
        first = int(pair.argmax())
        last = first + int(end_offset[first])
        char_start, char_end = int(outputs["offsets"][first][0]), int(outputs["offsets"][last][1])
        return {"answer": outputs["context"][char_start:char_end], "score": float(pair[first].exp()),
                "start": char_start, "end": char_end}


def register_pipelines() -> None:
    """Register `"extractive-question-answering"` with `transformers.pipeline` (done by `import nezha_hf`)."""
    PIPELINE_REGISTRY.register_pipeline(
        TASK, pipeline_class=ExtractiveQuestionAnsweringPipeline, pt_model=AutoModelForQuestionAnswering, type="text"
    )
