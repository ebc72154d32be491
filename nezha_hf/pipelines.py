"""Extractive question answering as a pipeline task, which transformers v5 removed.

transformers 5 dropped `pipeline("question-answering")` for every model (it raises a KeyError
pointing to chat models). Extractive QA with `NezhaForQuestionAnswering` is still useful, so
`import nezha_hf` registers it under the name `"extractive-question-answering"`:

    qa = pipeline("extractive-question-answering", model=model, tokenizer=tokenizer)
    qa(question="谁是原告？", context=judgment)   # {"answer", "score", "start", "end"}

The whole context is read in one pass (NEZHA has no length cap), so there is no striding.
"""

import torch
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
        start = outputs["start_logits"].float().masked_fill(~in_context, float("-inf")).log_softmax(-1)
        end = outputs["end_logits"].float().masked_fill(~in_context, float("-inf")).log_softmax(-1)
        pair = start[:, None] + end[None, :]
        length = torch.arange(len(start))
        valid = (length[None, :] >= length[:, None]) & (length[None, :] - length[:, None] < max_answer_length)
        pair = pair.masked_fill(~valid, float("-inf"))
        best = int(pair.argmax())
        first, last = divmod(best, len(start))
        char_start, char_end = int(outputs["offsets"][first][0]), int(outputs["offsets"][last][1])
        return {"answer": outputs["context"][char_start:char_end], "score": float(pair.view(-1)[best].exp()),
                "start": char_start, "end": char_end}


def register_pipelines() -> None:
    """Register `"extractive-question-answering"` with `transformers.pipeline` (done by `import nezha_hf`)."""
    PIPELINE_REGISTRY.register_pipeline(
        TASK, pipeline_class=ExtractiveQuestionAnsweringPipeline, pt_model=AutoModelForQuestionAnswering, type="text"
    )
