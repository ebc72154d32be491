"""What each process of a multi-process test runs: `torchrun --standalone --nproc_per_node 2 distributed_worker.py ...`.

    distributed_worker.py SCENARIO MODEL_DIR OUT_DIR [ATTENTION]

Each scenario loads MODEL_DIR through transformers 5's own `from_pretrained(..., distributed_config=...)`:
- `fsdp-train`: FSDP2 over the processes; writes the names of the FSDP units (`units.json`), trains `STEPS` AdamW
  steps on this process's share of `training_batch()`, then saves with `save_pretrained` (`model/`), pushes to a
  stand-in Hub (`pushed-by-<rank>/`, from the process that uploads), saves as a distributed checkpoint (`dcp/`) and
  the optimizer state with transformers' DCP helper (`optimizer/`).
- `tp-train`: tensor parallel over the processes with ATTENTION: the local shapes of the sharded weights
  (`shapes.json`), the logits (`logits.pt`) and the weights after one AdamW step (`weights.pt`), gathered.
- `fsdp-resume`: FSDP2 from MODEL_DIR with the optimizer state in OUT_DIR/optimizer (written by any number of
  processes); one more step on this process's share, then `save_pretrained` to `resumed/`.
- `fsdp-meta`: the FSDP2 way to build a large model without transformers' loader: built on the meta device,
  `fully_shard`, `to_empty`, the weights of MODEL_DIR loaded with `set_model_state_dict`; writes the largest
  difference of its logits from MODEL_DIR loaded whole (`meta.json`). New memory is NaN (torch's deterministic mode),
  so a buffer left uninitialised shows.

The single-process side of each comparison is `train` below, run by the tests.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers.distributed import DistributedConfig
from transformers.distributed.checkpoint import load_optimizer_distributed, save_optimizer_distributed

from nezha_hf import NezhaForMaskedLM

STEPS, LEARNING_RATE = 3, 1e-3


def training_batch(vocab: int = 99, rows: int = 4, length: int = 24) -> dict[str, torch.Tensor]:
    """Every position labelled and rows of one length: each process's equal share has as many targets as the
    others, so the mean of the shares' mean losses is the whole batch's mean loss."""
    generator = torch.Generator().manual_seed(7)
    input_ids = torch.randint(5, vocab, (rows, length), generator=generator)
    return {"input_ids": input_ids, "labels": torch.randint(5, vocab, (rows, length), generator=generator)}


def share(batch: dict, rank: int, processes: int) -> dict:
    """This process's rows of `batch`."""
    rows = len(batch["input_ids"]) // processes
    return {key: value[rank * rows : (rank + 1) * rows] for key, value in batch.items()}


def full_state(model) -> dict[str, torch.Tensor]:
    """Every weight as a full tensor (shards gathered: every process must call this)."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}


def train(model, batch, steps, optimizer=None):
    """`steps` AdamW steps on `batch`; returns the optimizer."""
    optimizer = optimizer or torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    for _ in range(steps):
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return optimizer


def push_to_a_folder(model, folder: Path) -> None:
    """`push_to_hub` with the Hub replaced by a copy of the uploaded folder into `folder` (no network)."""
    import shutil
    from types import SimpleNamespace
    from unittest import mock

    class Hub:
        def __init__(self, token=None):
            pass

        def create_repo(self, repo_id, **kwargs):
            return SimpleNamespace(repo_id=f"user/{repo_id}")

        def upload_folder(self, repo_id, folder_path, **kwargs):
            shutil.copytree(folder_path, folder)

    with mock.patch("nezha_hf.hub.HfApi", Hub):
        model.push_to_hub("tiny")


def fsdp_from_meta(model_dir: Path, out: Path) -> None:
    """The `fsdp-meta` scenario (see the module's documentation)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    torch.use_deterministic_algorithms(True)  # torch.empty fills with NaN
    whole = NezhaForMaskedLM.from_pretrained(model_dir).eval()
    with torch.device("meta"):
        model = NezhaForMaskedLM(whole.config)
    for layer in model.nezha.encoder.layer:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")
    set_model_state_dict(model, whole.state_dict(), options=StateDictOptions(full_state_dict=True))
    input_ids = training_batch()["input_ids"]
    with torch.no_grad():
        difference = (model.eval()(input_ids).logits - whole(input_ids).logits).abs().max().item()
    if dist.get_rank() == 0:
        (out / "meta.json").write_text(json.dumps({"difference": difference}))


def main():
    scenario, model_dir, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    if scenario == "fsdp-meta":
        return fsdp_from_meta(model_dir, out)
    if scenario == "tp-train":
        attention = sys.argv[4]
        model = NezhaForMaskedLM.from_pretrained(model_dir, distributed_config=DistributedConfig(tp_size=2),
                                                 attn_implementation=attention)
        batch = training_batch(length=600 if attention == "nezha_three_regions" else 24)
        shapes = {name: list(getattr(parameter, "to_local", lambda p=parameter: p)().shape)
                  for name, parameter in model.named_parameters()}
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"]).logits
        train(model, batch, 1)
        weights = full_state(model)
        if dist.get_rank() == 0:
            (out / "shapes.json").write_text(json.dumps(shapes))
            torch.save(logits, out / "logits.pt")
            torch.save(weights, out / "weights.pt")
        return
    from torch.distributed.fsdp import FSDPModule

    model = NezhaForMaskedLM.from_pretrained(model_dir, distributed_config=DistributedConfig(fsdp_size=2))
    rank, processes = dist.get_rank(), dist.get_world_size()  # the process group is up once the model is sharded
    mine = share(training_batch(), rank, processes)
    if scenario == "fsdp-train":
        if rank == 0:
            units = [name for name, module in model.named_modules() if isinstance(module, FSDPModule)]
            (out / "units.json").write_text(json.dumps(units))
        optimizer = train(model, mine, STEPS)
        model.save_pretrained(out / "model")
        push_to_a_folder(model, out / f"pushed-by-{rank}")
        model.save_pretrained(out / "dcp", distributed_checkpoint=True)
        save_optimizer_distributed(model, optimizer, str(out / "optimizer"))
    elif scenario == "fsdp-headless":  # from a checkpoint without an MLM head: a converted BertModel's layout
        on_meta = [name for name, parameter in model.named_parameters() if parameter.device.type == "meta"]
        bias = model.cls.predictions.bias
        report = {"on_meta": on_meta, "bias_is_zero": not on_meta and bool((full_state(model)["cls.predictions.bias"]
                                                                             == 0).all()),
                  "bias_tied": model.cls.predictions.decoder.bias is bias}
        train(model, mine, 1)
        if rank == 0:
            (out / "headless.json").write_text(json.dumps(report))
    elif scenario == "fsdp-resume":
        optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
        load_optimizer_distributed(model, optimizer, str(out / "optimizer"))
        train(model, mine, 1, optimizer)
        model.save_pretrained(out / "resumed")
    else:
        raise SystemExit(f"unknown scenario {scenario}")


if __name__ == "__main__":
    main()
    # Shut gloo down before exit: left running, its threads can abort the interpreter at teardown.
    dist.barrier()
    dist.destroy_process_group()
