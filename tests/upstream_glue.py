"""transformers' ``run_glue_no_trainer.py`` (pinned in ../shared/upstream/), run as written and as
the Accelerate guide ports it, on 2 gloo ranks (workers of tests/test_upstream_scripts.py).

The script runs unchanged through ``runpy`` with local inputs the test makes (a tiny BERT saved
with ``save_pretrained``, its tokenizer, CSV files, and an ``accuracy`` metric script in the
working directory, which ``evaluate.load("accuracy")`` loads before looking for a hub). What is
compared is recorded from outside the script: at each prepared scheduler's ``step()`` (the
script steps it after each optimizer step) the LR and every parameter; each training loss (the
model's output in the original, ``train_step``'s return in the port); each evaluation forward's
logits and every ``metric.compute()``; and the files ``save_state`` and ``save_pretrained``
wrote. The port runs with ``CpuGraphs`` (the TrainStep's engine patched in, the script
unchanged apart from the guide's lines).
"""

from __future__ import annotations

import logging
import os
import re
import runpy
import sys
from pathlib import Path
from typing import Any

import torch

from .framework_workers import tensors_of
from .upstream import (
    PREPARE_ALL,
    PREPARE_THE_REST,
    final_report,
    graph_safe_at_prepare,
    graphs_on_the_cpu_engine,
    ported,
    ready_to_run,
    record_step_losses,
    record_updates,
    stamp_updates,
)

FOLDER, NAME = "transformers_run_glue_no_trainer", "run_glue_no_trainer.py"
ROWS, EVAL_ROWS = 96, 16  # 12 batches of 4 a rank: at k = 2 windows of 1, 2, ..., 2, 1 calls

_WORDS = ["good", "bad", "fine", "awful", "great", "poor", "nice", "ugly", "happy", "sad"]

METRIC = """import datasets
import evaluate


class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="accuracy", citation="", inputs_description="",
            features=datasets.Features(
                {"predictions": datasets.Value("int32"), "references": datasets.Value("int32")}
            ),
        )

    def _compute(self, predictions, references):
        right = sum(int(p == r) for p, r in zip(predictions, references))
        return {"accuracy": right / len(references)}
"""

# the script's training lines the guide's diffs replace
_SCRIPT_FORWARD = (
    "            outputs = model(**batch)\n"
    "            loss = outputs.loss\n"
    "            # We keep track of the loss at each epoch\n"
    "            if args.with_tracking:\n"
    "                total_loss += loss.detach().float()\n"
)
_SCRIPT_UPDATE = (
    "            loss = loss / args.gradient_accumulation_steps\n"
    "            accelerator.backward(loss)\n"
    "            if step % args.gradient_accumulation_steps == 0 or step == len(train_dataloader) - 1:\n"
    "                optimizer.step()\n"
    "                lr_scheduler.step()\n"
    "                optimizer.zero_grad()\n"
)

# the guide's "A loop that accumulates by hand" (docs/guides/accelerate.md), line for line
HAND_PORT = [
    (
        "from transformers.utils import check_min_version\n",
        "from transformers.utils import check_min_version\n\nfrom ddpgraph.integrations.accelerate import from_accelerator\n",
    ),
    (
        PREPARE_ALL,
        PREPARE_THE_REST + "    train_step = from_accelerator(\n"
        "        accelerator, model, optimizer, accumulate_calls=args.gradient_accumulation_steps\n"
        "    )\n"
        "    model = train_step.model\n"
        "    k = args.gradient_accumulation_steps\n",
    ),
    (
        _SCRIPT_FORWARD + _SCRIPT_UPDATE,
        "            last = step % k == 0 or step == len(train_dataloader) - 1\n"
        "            loss = train_step(batch, last=last)\n"
        "            # We keep track of the loss at each epoch\n"
        "            if args.with_tracking:\n"
        "                total_loss += loss.detach().float()\n"
        "            if last:\n"
        "                lr_scheduler.step()\n",
    ),
]

# the guide's first diff alone (no accumulate_calls): 13 changed lines
FIRST_DIFF_PORT = [
    HAND_PORT[0],
    (
        HAND_PORT[1][0],
        PREPARE_THE_REST + "    train_step = from_accelerator(accelerator, model, optimizer)\n"
        "    model = train_step.model\n",
    ),
    (
        _SCRIPT_UPDATE,
        "            if step % args.gradient_accumulation_steps == 0 or step == len(train_dataloader) - 1:\n"
        "                lr_scheduler.step()\n",
    ),
    (
        "            outputs = model(**batch)\n            loss = outputs.loss\n            # We keep",
        "            loss = train_step(batch)\n            # We keep",
    ),
]


def make_inputs(
    folder: Path,
    varied: bool = False,
    config: dict[str, int] | None = None,
    rows: tuple[int, int] = (ROWS, EVAL_ROWS),
) -> None:
    """The tiny model (or one of ``config``'s sizes, random weights), tokenizer, data (``rows``
    to train and to validate) and metric the script reads (no hub): sentences of 5 words, or
    (``varied``) of 2 to 8, so that dynamic padding gives batches of several lengths."""
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizer

    model_dir = folder / "model"
    model_dir.mkdir(parents=True)
    vocab = model_dir / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *_WORDS]) + "\n")
    BertTokenizer(str(vocab)).save_pretrained(model_dir)
    torch.manual_seed(0)
    sizes = config or dict(
        vocab_size=len(_WORDS) + 5, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=32,
    )  # fmt: skip
    BertForSequenceClassification(BertConfig(**sizes, num_labels=2)).save_pretrained(model_dir)
    gen = torch.Generator().manual_seed(3)
    for name, count in zip(("train.csv", "validation.csv"), rows):
        lines = ["sentence,label"]
        for _ in range(count):
            n = 2 + int(torch.randint(7, (), generator=gen)) if varied else 5
            words = [_WORDS[int(i)] for i in torch.randint(len(_WORDS), (n,), generator=gen)]
            # labels as words: the script sets config.label2id from them, and transformers 5.17's
            # strict config refuses int keys there ("Field 'label2id' with value {0: 0, 1: 1}
            # doesn't match any type in (dict[str, int], ...)"); sorted, no/yes are 0/1 as before
            label = ("no", "yes")[sum(_WORDS.index(w) < 5 for w in words) > 2]
            lines.append(f"{' '.join(words)},{label}")
        (folder / name).write_text("\n".join(lines) + "\n")
    (folder / "accuracy").mkdir()
    (folder / "accuracy" / "accuracy.py").write_text(METRIC)


def run(
    folder: str,
    script: str,
    variant: str,
    flags: list[str],
    precision: str = "no",
    out: str = "",
    pad: bool = True,
    device: str = "cpu",
    keep: str = "all",
) -> dict[str, Any]:
    """One rank of the script (``variant`` "original"; "graph_safe": its AdamW made graph-safe
    at ``accelerator.prepare``, outside the script), or of its port ("hand" or "first_diff"),
    with ``flags``, under ``accelerate launch --mixed_precision precision`` (the script has no
    flag of its own: its ``Accelerator()`` reads what the launcher exports), writing into
    ``folder/out`` (``folder/variant`` by default), every batch padded to 12 tokens (``pad``,
    ``--pad_to_max_length``) or to its longest sentence (the script's default); what it
    recorded. On ``device`` "cuda" Accelerate takes this rank's GPU and the port real CUDA
    graphs (on the CPU: Accelerate there, the port on ``CpuGraphs``); ``keep="times"``: only a
    timestamp after each update and the port's final report (benchmarks/upstream_ports.py)."""
    base = Path(folder)
    output_dir = base / (out or variant)
    os.environ["ACCELERATE_MIXED_PRECISION"] = precision  # as accelerate launch exports it
    text = Path(script).read_text(encoding="utf-8")
    if variant in ("hand", "first_diff"):
        text = ported(text, HAND_PORT if variant == "hand" else FIRST_DIFF_PORT)
    path = base / f"{variant}_{NAME}"
    ready_to_run(base, path, text, device)
    os.environ["HF_DATASETS_CACHE"] = str(base / "cache" / variant)
    os.environ["HF_MODULES_CACHE"] = str(base / "modules")
    record: dict[str, Any] = {"losses": [], "lrs": [], "updates": [], "logits": [], "metrics": []}
    record["printed"] = []
    # the port's losses are train_step's returns; not for the refused first diff, whose error
    # names the line that called the step (the script's, not a wrapper's)
    script = variant in ("original", "graph_safe")
    if keep == "times":
        from accelerate.scheduler import AcceleratedScheduler

        stamp_updates(record, AcceleratedScheduler, "step")
        logging.getLogger("__main__").addHandler(_Printed(record["printed"]))
    else:
        _record(record, training_losses=script, step_losses=variant == "hand")
    if device == "cpu":
        graphs_on_the_cpu_engine()
    if variant == "graph_safe":
        graph_safe_at_prepare(device)
    sys.argv = [
        str(path), "--model_name_or_path", "model", "--train_file", "train.csv",
        "--validation_file", "validation.csv", "--per_device_train_batch_size", "4",
        "--per_device_eval_batch_size", "4", "--max_length", "12",
        "--seed", "0", "--output_dir", str(output_dir), *flags,
    ]  # fmt: skip
    if pad:
        sys.argv.append("--pad_to_max_length")
    runpy.run_path(str(path), run_name="__main__")
    if keep == "times":
        record["report"] = final_report()
    return record


def _record(record: dict[str, Any], training_losses: bool, step_losses: bool) -> None:
    import evaluate
    from transformers import AutoModelForSequenceClassification

    record_updates(record)
    loading = AutoModelForSequenceClassification.from_pretrained

    def from_pretrained(*args: Any, **kwargs: Any) -> Any:
        model = loading(*args, **kwargs)

        def hook(module: Any, inputs: Any, output: Any) -> None:
            if not module.training:
                record["logits"].append(output.logits.detach().clone())
            elif training_losses:
                record["losses"].append(output.loss.detach().clone())

        model.register_forward_hook(hook)
        return model

    AutoModelForSequenceClassification.from_pretrained = from_pretrained  # type: ignore[method-assign]
    compute = evaluate.EvaluationModule.compute

    def computed(self: Any, *args: Any, **kwargs: Any) -> Any:
        """Compute (evaluate copies this function and appends to its docstring)."""
        result = compute(self, *args, **kwargs)
        record["metrics"].append(result)
        return result

    evaluate.EvaluationModule.compute = computed  # type: ignore[method-assign]
    if step_losses:
        record_step_losses(record)
    logging.getLogger("__main__").addHandler(_Printed(record["printed"]))


class _Printed(logging.Handler):
    """The lines the script logs on rank 0 with its evaluation ("epoch 0: {'accuracy': ...}",
    through Accelerate's logger on the script's ``__main__`` logger)."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__()
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        line = record.getMessage()  # accelerate 1.16 starts it with "[RANK 0] "
        if re.match(r"(\[RANK \d+\] )?epoch \d+: ", line):
            self.lines.append(line)


def saved(out: Path) -> dict[str, Any]:
    """Every tensor of each file ``save_state`` / ``save_pretrained`` wrote under ``out``, by
    relative path, and the bytes of each rank's RNG states (``random_states_<rank>.pkl``: what a
    resume restores) (read once every rank has finished)."""
    from safetensors.torch import load_file

    found: dict[str, Any] = {}
    for path in sorted(out.rglob("*")):
        name = str(path.relative_to(out))
        if path.suffix == ".safetensors":
            found[name] = tensors_of(load_file(path))
        elif path.suffix == ".bin":
            found[name] = tensors_of(torch.load(path, weights_only=False))
        elif path.name.startswith("random_states_"):
            found[name] = path.read_bytes()
    return found
