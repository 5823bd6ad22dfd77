"""Upstream scripts that train with ``transformers.Trainer``, kept as corpus entries for the
Trainer matrix (``test_trainer_matrix.py``): each builds the Trainer's arguments the way the script
does, on data made here (no hub access in CI); the port is the guide's: ``Trainer`` ->
``GraphTrainer``, nothing else.

run_clm: huggingface/transformers, examples/pytorch/language-modeling/run_clm.py at commit
00d481d18f914b55e65faa31e82321629691eadb (check_min_version("4.57.0.dev0")), Apache-2.0,
https://github.com/huggingface/transformers/blob/00d481d18f914b55e65faa31e82321629691eadb/examples/pytorch/language-modeling/run_clm.py
What it does, restated: tokenised texts concatenated and cut into blocks of ``block_size`` with
``labels`` a copy of ``input_ids`` ("group_texts"), ``default_data_collator``,
``preprocess_logits_for_metrics`` keeping the argmax, an accuracy over shifted labels as
``compute_metrics``, then ``train()``, ``save_model()``, ``evaluate()`` and the model card.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .integration_workers import tiny_gpt2

BLOCK = 16  # run_clm's --block_size (the tiny GPT-2 has 16 positions)


def _texts(count: int, seed: int) -> list[list[int]]:
    """Token ids of ``count`` 'documents' of 5 to 40 tokens (the tokenizer's output)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 41, (count,), generator=gen)
    return [torch.randint(100, (int(n),), generator=gen).tolist() for n in lengths]


def group_texts(texts: list[list[int]], block: int = BLOCK) -> list[dict[str, list[int]]]:
    """run_clm's chunking: all texts end to end, cut into whole blocks (the remainder dropped),
    labels equal to the inputs (the model shifts them)."""
    stream = [token for text in texts for token in text]
    usable = len(stream) // block * block
    return [
        {"input_ids": stream[i : i + block], "labels": stream[i : i + block]}
        for i in range(0, usable, block)
    ]


def _argmax_logits(logits: Any, labels: Any) -> Any:
    """run_clm's preprocess_logits_for_metrics: the first output if a tuple, then argmax."""
    if isinstance(logits, tuple):
        logits = logits[0]
    return logits.argmax(dim=-1)


def _shifted_accuracy(prediction: Any) -> dict[str, float]:
    """run_clm's compute_metrics (accuracy of predictions against the next token)."""
    preds, labels = prediction
    labels = labels[:, 1:].reshape(-1)
    preds = preds[:, :-1].reshape(-1)
    return {"accuracy": float((preds == labels).mean())}


def run_clm(args: Any) -> dict[str, Any]:
    import transformers

    return dict(
        model=tiny_gpt2(),
        args=args,
        train_dataset=group_texts(_texts(160, seed=1)),
        eval_dataset=group_texts(_texts(24, seed=2)),
        data_collator=transformers.default_data_collator,
        compute_metrics=_shifted_accuracy,
        preprocess_logits_for_metrics=_argmax_logits,
    )


ENTRIES: dict[str, Callable[[Any], dict[str, Any]]] = {"run_clm": run_clm}
