"""Workers for the Trainer feature matrix (``test_trainer_matrix.py``): one row is a set of
``TrainingArguments`` (and Trainer extras), run with the plain ``transformers.Trainer``, with
``GraphTrainer`` eagerly, with the plain Trainer stepping the graphed step's arithmetic ("safe")
and with ``GraphTrainer`` on the CPU engine capturing (compared with "safe"); each run
returns what the Trainer logged, the final parameters and the optimizer's state, so the test can
compare them bit for bit. One process pair runs several rows (starting processes is slow)."""

from __future__ import annotations

import os
from typing import Any

import torch

from .integration_workers import gpt2_data, tiny_gpt2, trainer_args, with_graph_safe_arithmetic

MODES = ("plain", "eager", "safe", "graphed")
# what each GraphTrainer mode is compared with: the eager step steps the Trainer's optimizer as
# the Trainer does; the graphed one as on CUDA (capturable, foreach, the LR a float32 tensor),
# so its reference is the plain Trainer stepping that arithmetic
REFERENCE = {"eager": "plain", "graphed": "safe"}
_TIMING = ("runtime", "per_second")  # wall-time entries of the logs: never equal


def base_args(output_dir: str, **overrides: Any) -> Any:
    """A short run that still captures: 14 updates (the warm-up DDP allows is 12), k=2."""
    options: dict[str, Any] = dict(
        per_device_eval_batch_size=4, warmup_steps=3, max_steps=14, save_strategy="no"
    )
    options.update(overrides)
    return trainer_args(output_dir, **options)


def _callbacks(names: list[str]) -> list[Any]:
    import transformers

    made: list[Any] = []
    for name in names:
        if name == "early_stopping":  # stops after 3 evaluations that did not improve
            made.append(transformers.EarlyStoppingCallback(early_stopping_patience=3))
    return made


def _accuracy(prediction: Any) -> dict[str, float]:
    logits, labels = prediction.predictions, prediction.label_ids
    hits = (logits[:, :-1].argmax(-1) == labels[:, 1:]) & (labels[:, 1:] != -100)
    return {"token_accuracy": float(hits.sum() / max(1, (labels[:, 1:] != -100).sum()))}


def _scaled_loss(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None) -> Any:
    """A ``compute_loss_func``: the token-summed loss over the window's tokens, times 1000 (so
    that fp16's first loss scales overflow and their updates are skipped)."""
    logits = outputs.logits[:, :-1].float()
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), reduction="sum"
    )
    return loss / num_items_in_batch * 1000.0


def build_trainer(out: str, mode: str, row: dict[str, Any]) -> Any:
    """The Trainer a row describes: ``args`` (TrainingArguments overrides), ``rows`` (data set
    size), ``eval_rows``, ``callbacks``, ``metrics`` (a compute_metrics), ``loss_func``,
    ``step_options``; ``corpus`` builds one of trainer_corpus.py's upstream scripts instead."""
    import transformers

    from ddpgraph.testing import CpuGraphs

    args = base_args(out, **row.get("args", {}))
    if row.get("corpus"):
        from . import trainer_corpus

        common = trainer_corpus.ENTRIES[row["corpus"]](args)
    else:
        common = dict(
            model=tiny_gpt2(),
            args=args,
            train_dataset=gpt2_data(row.get("rows", 128)),
            callbacks=_callbacks(row.get("callbacks", [])),
        )
    if row.get("eval_rows"):
        common["eval_dataset"] = gpt2_data(row["eval_rows"], seed=7)
    if row.get("metrics"):
        common["compute_metrics"] = _accuracy
    if row.get("loss_func"):
        common["compute_loss_func"] = _scaled_loss
    if mode == "plain":
        return transformers.Trainer(**common)
    if mode == "safe":
        return with_graph_safe_arithmetic(transformers.Trainer)(**common)
    from ddpgraph.integrations.transformers import GraphTrainer

    options = dict(row.get("step_options", {}))
    if mode == "graphed":
        options["engine"] = CpuGraphs()
    else:
        options["graph"] = "never"
    return GraphTrainer(**common, step_options=options)


def run_row(out: str, mode: str, row: dict[str, Any]) -> dict[str, Any]:
    """One row's run; what it logged and ended with, or the error it raised (as text)."""
    trainer = build_trainer(out, mode, row)
    trainer.train(resume_from_checkpoint=row.get("resume"))
    if row.get("then_evaluate"):  # run_clm.py's end: evaluate, save, write the model card
        trainer.evaluate()
        trainer.save_model()
        trainer.create_model_card()
    return outcome(trainer, mode)


def outcome(trainer: Any, mode: str) -> dict[str, Any]:
    logs = [
        {k: v for k, v in entry.items() if not any(t in k for t in _TIMING)}
        for entry in trainer.state.log_history
    ]
    optimizer = trainer.optimizer
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return {
        "logs": logs,
        "params": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
        "optimizer": optimizer.state_dict()["state"],
        "global_step": trainer.state.global_step,
        "report": str(trainer.report()) if hasattr(trainer, "report") else None,
    }


def run_rows(out: str, rows: dict[str, dict[str, Any]], modes: tuple[str, ...] = MODES) -> Any:
    """Every row in every mode, in one process pair: {label: {mode: outcome or error text}}."""
    results: dict[str, dict[str, Any]] = {}
    for label, row in rows.items():
        results[label] = {}
        for mode in modes:
            where = os.path.join(out, label, mode)
            if (
                "resume_from" in row
            ):  # (row, checkpoint): the plain Trainer's run of that row saved it
                saved_by, checkpoint = row["resume_from"]
                row = {**row, "resume": os.path.join(out, saved_by, "plain", checkpoint)}
            try:
                results[label][mode] = run_row(where, mode, row)
            except Exception as exc:  # the test reads the error
                results[label][mode] = f"{type(exc).__name__}: {exc}"
    return results


def differences(theirs: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    """Where two outcomes differ (empty: bit for bit equal)."""
    if isinstance(theirs, str) or isinstance(ours, str):
        return [] if theirs == ours else [f"plain: {theirs!s:.300} / ours: {ours!s:.300}"]
    found = []
    if theirs["logs"] != ours["logs"]:
        for a, b in zip(theirs["logs"], ours["logs"]):
            if a != b:
                found.append(f"logs differ: {a} vs {b}")
                break
        else:
            found.append(f"{len(theirs['logs'])} log entries vs {len(ours['logs'])}")
    if theirs["global_step"] != ours["global_step"]:
        found.append(f"global_step {theirs['global_step']} vs {ours['global_step']}")
    for name, value in theirs["params"].items():
        if not torch.equal(value, ours["params"][name]):
            gap = (value.float() - ours["params"][name].float()).abs().max().item()
            found.append(f"param {name} differs by {gap:.3g}")
            break
    for index, state in theirs["optimizer"].items():
        for key, value in state.items():
            other = ours["optimizer"][index][key]
            same = torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
            if not same:
                found.append(f"optimizer state {index}.{key} differs")
                break
    return found
