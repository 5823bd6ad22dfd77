"""Accelerate's own examples, each as upstream wrote its ``training_function`` and as the guide
(docs/guides/accelerate.md) ports it: ``ported=False`` runs the original loop, ``ported=True``
the same function with the guide's changed lines (marked ``# port:``).

Source: https://github.com/huggingface/accelerate at 16cb6eb80dd9aa8b4df1a63ef57863e455d53b83
(2026-07-24; accelerate 1.16 installed here): ``examples/nlp_example.py``,
``examples/by_feature/gradient_accumulation.py``, ``examples/by_feature/checkpointing.py``.
Licence: Apache-2.0, Copyright The HuggingFace Inc. team.

Shrunk only where this machine needs it, nothing else changed:
* GLUE MRPC (no downloads here) is synthetic rows of its real sizes (3668 train, 408
  validation; 115 batches of 16 a rank on 2 ranks), token ids pre-padded to one length (32; the
  example pads to the longest row of each batch): a graph replays one shape.
* ``bert-base-cased`` is a 1-layer BERT of width 16 built from its config with the seed set, as
  ``from_pretrained`` would load it after ``set_seed``.
* ``evaluate.load("glue", "mrpc")`` (a download) is the predictions and references themselves,
  recorded per epoch.
* ``accelerator.end_training()`` (it destroys the process group) keeps the group for the
  next example run in the same process (tests start one process launch for all).
* ``batch.to(accelerator.device)`` is left out: the rows are default-collated dicts, which
  the prepared loader places on the device.
* The TrainStep is ``train_step``: these loops already name their batch index ``step``.
* ``num_epochs`` 3 becomes 2 (1 at MRPC's full size), ``num_warmup_steps`` 100 becomes 10
  (the schedule's shape within fewer steps), ``lr`` 2e-5 becomes 1e-3 (a small model trained
  from scratch moves visibly, so a difference shows); ``--cpu`` is on.
"""

# ruff: noqa: B007 - upstream's loop variables, kept as written
from __future__ import annotations

import os
from typing import Any

import torch
from torch.optim import AdamW
from torch.utils.data import DataLoader

from .framework_workers import graph_safe_optimizer

MAX_GPU_BATCH_SIZE = 16
EVAL_BATCH_SIZE = 32
LENGTH = 32


def mrpc_rows(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Sentence pairs as the tokenizer gives them (ids, token types, mask), padded to LENGTH."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 100, (n, LENGTH), generator=gen)
    lengths = torch.randint(8, LENGTH + 1, (n,), generator=gen)
    split = lengths // 2
    position = torch.arange(LENGTH)
    mask = (position < lengths[:, None]).long()
    types = ((position >= split[:, None]) & (mask == 1)).long()
    labels = torch.randint(2, (n,), generator=gen)
    return [
        {
            "input_ids": ids[i] * mask[i],
            "token_type_ids": types[i],
            "attention_mask": mask[i],
            "labels": labels[i],
        }
        for i in range(n)
    ]


def get_dataloaders(
    accelerator: Any, batch_size: int = 16, rows: int = 3668
) -> tuple[DataLoader, DataLoader]:
    train_dataloader = DataLoader(mrpc_rows(rows, 0), shuffle=True, batch_size=batch_size)
    eval_dataloader = DataLoader(mrpc_rows(408, 1), shuffle=False, batch_size=EVAL_BATCH_SIZE)
    return train_dataloader, eval_dataloader


def sequence_classifier() -> Any:
    import transformers

    config = transformers.BertConfig(
        vocab_size=100, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=LENGTH, num_labels=2,
    )  # fmt: skip
    return transformers.BertForSequenceClassification(config)


class Record:
    """What a run did: every micro-batch's loss, the LR after each scheduler step, the
    evaluation's predictions per epoch, and the end state."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.lrs: list[float] = []
        self.predictions: list[list[int]] = []
        self.step: Any = None

    def result(self, model: Any, optimizer: Any) -> dict[str, Any]:
        from .framework_workers import tensors_of

        inner = getattr(model, "module", model)
        return {
            "losses": self.losses,
            "lrs": self.lrs,
            "predictions": self.predictions,
            "params": tensors_of(inner.state_dict()),
            "optimizer": tensors_of(optimizer.state_dict()["state"]),
            "report": None if self.step is None else str(self.step.report()),
        }


def end_training(accelerator: Any) -> None:
    """``accelerator.end_training()`` without destroying the process group: the next example
    runs in this process (one launch for the whole corpus); these runs have no trackers."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state()  # the next Accelerator may set another mixed_precision
    GradientState._reset_state()


def evaluation(accelerator: Any, model: Any, eval_dataloader: Any, record: Record) -> None:
    model.eval()
    predicted: list[int] = []
    for step, batch in enumerate(eval_dataloader):
        with torch.no_grad():
            outputs = model(**batch)
        predictions = outputs.logits.argmax(dim=-1)
        predictions, _references = accelerator.gather_for_metrics((predictions, batch["labels"]))
        predicted += predictions.tolist()
    record.predictions.append(predicted)


def nlp_example(config: dict[str, Any], ported: bool, options: dict[str, Any]) -> dict[str, Any]:
    """examples/nlp_example.py's training_function."""
    from accelerate import Accelerator, DistributedType
    from transformers import get_linear_schedule_with_warmup, set_seed

    from ddpgraph.integrations.accelerate import from_accelerator

    accelerator = Accelerator(cpu=True, mixed_precision=config.get("mixed_precision", "no"))
    lr = config["lr"]
    num_epochs = int(config["num_epochs"])
    seed = int(config["seed"])
    batch_size = int(config["batch_size"])
    record = Record()
    gradient_accumulation_steps = 1
    if batch_size > MAX_GPU_BATCH_SIZE and accelerator.distributed_type != DistributedType.XLA:
        gradient_accumulation_steps = batch_size // MAX_GPU_BATCH_SIZE
        batch_size = MAX_GPU_BATCH_SIZE
    set_seed(seed)
    train_dataloader, eval_dataloader = get_dataloaders(
        accelerator, batch_size, config.get("rows", 3668)
    )
    model = sequence_classifier()
    model = model.to(accelerator.device)
    # changed from upstream: graph-safe as written (capturable, the LR in a tensor), so that
    # Accelerate's own run steps the optimizer the graphed port steps
    optimizer = graph_safe_optimizer(AdamW, model.parameters(), lr)
    lr_scheduler = get_linear_schedule_with_warmup(
        optimizer=optimizer,
        num_warmup_steps=10,
        num_training_steps=(len(train_dataloader) * num_epochs) // gradient_accumulation_steps,
    )
    if ported:  # port: prepare the loaders and the scheduler; the TrainStep takes the rest
        train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
            train_dataloader, eval_dataloader, lr_scheduler
        )
        train_step = from_accelerator(accelerator, model, optimizer, **options)
        record.step = train_step
    else:
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
            model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
        )
    for epoch in range(num_epochs):
        model.train()
        for step, batch in enumerate(train_dataloader):
            if ported:  # port: the step divides by gradient_accumulation_steps itself
                loss = train_step(batch)
            else:
                outputs = model(**batch)
                loss = outputs.loss
                loss = loss / gradient_accumulation_steps
                accelerator.backward(loss)
            record.losses.append(loss.item())
            if step % gradient_accumulation_steps == 0:
                if not ported:
                    optimizer.step()
                lr_scheduler.step()
                if not ported:
                    optimizer.zero_grad()
                record.lrs.append(float(lr_scheduler.get_last_lr()[0]))
        evaluation(accelerator, model, eval_dataloader, record)
    end_training(accelerator)
    return record.result(model, optimizer)


def gradient_accumulation(
    config: dict[str, Any], ported: bool, options: dict[str, Any]
) -> dict[str, Any]:
    """examples/by_feature/gradient_accumulation.py's training_function (``--cpu
    --gradient_accumulation_steps k``)."""
    from accelerate import Accelerator, DistributedType
    from transformers import get_linear_schedule_with_warmup, set_seed

    from ddpgraph.integrations.accelerate import from_accelerator

    gradient_accumulation_steps = int(config["gradient_accumulation_steps"])
    accelerator = Accelerator(
        cpu=True, mixed_precision=config.get("mixed_precision", "no"),
        gradient_accumulation_steps=gradient_accumulation_steps,
    )  # fmt: skip
    if accelerator.distributed_type == DistributedType.XLA and gradient_accumulation_steps > 1:
        raise NotImplementedError("Gradient accumulation on TPUs is currently not supported.")
    lr = config["lr"]
    num_epochs = int(config["num_epochs"])
    seed = int(config["seed"])
    batch_size = int(config["batch_size"])
    record = Record()
    set_seed(seed)
    train_dataloader, eval_dataloader = get_dataloaders(
        accelerator, batch_size, config.get("rows", 3668)
    )
    model = sequence_classifier()
    model = model.to(accelerator.device)
    # changed from upstream: graph-safe as written (capturable, the LR in a tensor), so that
    # Accelerate's own run steps the optimizer the graphed port steps
    optimizer = graph_safe_optimizer(AdamW, model.parameters(), lr)
    lr_scheduler = get_linear_schedule_with_warmup(
        optimizer=optimizer,
        num_warmup_steps=10,
        num_training_steps=(len(train_dataloader) * num_epochs),
    )
    if ported:  # port
        train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
            train_dataloader, eval_dataloader, lr_scheduler
        )
        train_step = from_accelerator(accelerator, model, optimizer, **options)
        record.step = train_step
    else:
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
            model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
        )
    for epoch in range(num_epochs):
        model.train()
        for step, batch in enumerate(train_dataloader):
            with accelerator.accumulate(model):
                if ported:  # port
                    loss = train_step(batch)
                else:
                    output = model(**batch)
                    loss = output.loss
                    accelerator.backward(loss)
                    optimizer.step()
                lr_scheduler.step()
                if not ported:
                    optimizer.zero_grad()
            record.losses.append(loss.item())
            record.lrs.append(float(lr_scheduler.get_last_lr()[0]))
        evaluation(accelerator, model, eval_dataloader, record)
    end_training(accelerator)
    return record.result(model, optimizer)


def checkpointing(config: dict[str, Any], ported: bool, options: dict[str, Any]) -> dict[str, Any]:
    """examples/by_feature/checkpointing.py's training_function (``--cpu --checkpointing_steps
    {epoch,N} --output_dir DIR [--resume_from_checkpoint DIR/epoch_0]``)."""
    from accelerate import Accelerator, DistributedType
    from transformers import get_linear_schedule_with_warmup, set_seed

    from ddpgraph.integrations.accelerate import from_accelerator

    args = config["args"]
    accelerator = Accelerator(cpu=True, mixed_precision=config.get("mixed_precision", "no"))
    lr = config["lr"]
    num_epochs = int(config["num_epochs"])
    seed = int(config["seed"])
    batch_size = int(config["batch_size"])
    record = Record()
    if args["checkpointing_steps"] == "epoch":
        checkpointing_steps: Any = "epoch"
    else:
        checkpointing_steps = int(args["checkpointing_steps"])
    set_seed(seed)
    train_dataloader, eval_dataloader = get_dataloaders(
        accelerator, batch_size, config.get("rows", 3668)
    )
    gradient_accumulation_steps = 1
    if batch_size > MAX_GPU_BATCH_SIZE and accelerator.distributed_type != DistributedType.XLA:
        gradient_accumulation_steps = batch_size // MAX_GPU_BATCH_SIZE
        batch_size = MAX_GPU_BATCH_SIZE
    model = sequence_classifier()
    model = model.to(accelerator.device)
    # changed from upstream: graph-safe as written (capturable, the LR in a tensor), so that
    # Accelerate's own run steps the optimizer the graphed port steps
    optimizer = graph_safe_optimizer(AdamW, model.parameters(), lr)
    lr_scheduler = get_linear_schedule_with_warmup(
        optimizer=optimizer,
        num_warmup_steps=10,
        num_training_steps=(len(train_dataloader) * num_epochs) // gradient_accumulation_steps,
    )
    if ported:  # port
        train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
            train_dataloader, eval_dataloader, lr_scheduler
        )
        train_step = from_accelerator(accelerator, model, optimizer, **options)
        record.step = train_step
    else:
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
            model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
        )
    overall_step = 0
    starting_epoch = 0
    resume_step = None
    if args.get("resume_from_checkpoint"):
        accelerator.load_state(args["resume_from_checkpoint"])
        path = os.path.basename(args["resume_from_checkpoint"])
        training_difference = os.path.splitext(path)[0]
        if "epoch" in training_difference:
            starting_epoch = int(training_difference.replace("epoch_", "")) + 1
            resume_step = None
        else:
            resume_step = int(training_difference.replace("step_", ""))
            starting_epoch = resume_step // len(train_dataloader)
            resume_step -= starting_epoch * len(train_dataloader)
    for epoch in range(starting_epoch, num_epochs):
        model.train()
        if args.get("resume_from_checkpoint") and epoch == starting_epoch and resume_step:
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
            overall_step += resume_step
        else:
            active_dataloader = train_dataloader
        for step, batch in enumerate(active_dataloader):
            if ported:  # port
                loss = train_step(batch)
            else:
                outputs = model(**batch)
                loss = outputs.loss
                loss = loss / gradient_accumulation_steps
                accelerator.backward(loss)
            record.losses.append(loss.item())
            if step % gradient_accumulation_steps == 0:
                if not ported:
                    optimizer.step()
                lr_scheduler.step()
                if not ported:
                    optimizer.zero_grad()
            overall_step += 1
            if isinstance(checkpointing_steps, int):
                output_dir = f"step_{overall_step}"
                if overall_step % checkpointing_steps == 0:
                    accelerator.save_state(os.path.join(args["output_dir"], output_dir))
        evaluation(accelerator, model, eval_dataloader, record)
        if checkpointing_steps == "epoch":
            accelerator.save_state(os.path.join(args["output_dir"], f"epoch_{epoch}"))
    end_training(accelerator)
    return record.result(model, optimizer)
