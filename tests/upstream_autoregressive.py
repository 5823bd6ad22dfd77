"""Accelerate's ``gradient_accumulation_for_autoregressive_models.py`` (pinned in
../shared/upstream/), run as written and as the Accelerate guide ports it, on 2 gloo ranks
(workers of tests/test_upstream_scripts.py).

The script runs unchanged through ``runpy``. What it would download is found here instead:
``HuggingFaceTB/SmolLM-360M`` (tokenizer and model) is a tiny Llama and a word-level tokenizer
saved into a Hugging Face hub cache the test makes (``HF_HUB_CACHE``, ``HF_HUB_OFFLINE=1``:
transformers resolves the name to that snapshot, as it would a downloaded one), and
``load_dataset("Salesforce/wikitext", "wikitext-2-v1")`` is redirected, outside the script, to
local JSON files with wikitext's ``text`` column (500 training rows, as the script selects, most
of them empty lines as in wikitext: 116 remain after its filter, 29 batches of 2 a rank, so
``--gradient_accumulation_steps`` 2, 3 and 4 end each epoch with a short window of 1, 2 and 1,
and k = 4 replays 38 of its 87 calls after the 12-window warm-up). Every text of an even row is
9 words and the odd ones shorter, so each batch pads to one shape and its labels hold -100s
(``num_items_in_batch`` varies). The graph-safe variant of the original makes its AdamW
graph-safe at ``accelerator.prepare`` (outside the script), where the port's TrainStep makes it.

Recorded from outside the script: each micro-batch's loss (the model's output times k and the
world size, as the script scales it, in the original; ``train_step``'s return in the port), at
each prepared scheduler's ``step()`` (once per optimizer step) the LR and every parameter, the
logits of each evaluation forward (through the prepared model, or ``train_step.model``), and
every line the script printed (grad norm and train loss per update, eval perplexity per epoch).
"""

from __future__ import annotations

import contextlib
import io
import os
import runpy
import sys
from pathlib import Path
from typing import Any

import torch

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

FOLDER = "accelerate_gradient_accumulation_autoregressive"
NAME = "gradient_accumulation_for_autoregressive_models.py"
HUB_NAME = "HuggingFaceTB/SmolLM-360M"
TRAIN_ROWS, KEPT = 500, 116  # the script selects 500 rows; 116 are not empty
_WORDS = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran", "far", "away", "big", "red"]

_SCRIPT_BACKWARD = (
    "                    outputs = model(**batch, use_cache=False, num_items_in_batch=num_items_in_batch)\n"
    "                    loss = outputs.loss\n"
)
_SCRIPT_SCALE = (
    "                    loss = loss * gradient_accumulation_steps * accelerator.num_processes\n"
    "                    accelerator.backward(loss)\n"
)
_SCRIPT_UPDATE = (
    "            grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)\n"
    "            optimizer.step()\n"
    "            lr_scheduler.step()\n"
    "            optimizer.zero_grad()\n"
)

# the Accelerate guide's "A loop that accumulates by hand with no_sync" (docs/guides/accelerate.md),
# line for line: the step takes the script's loss scaling as its loss_fn, the window from the
# script's own no_sync() on train_step.model and last= at each window's last micro-batch
PORT = [
    (
        "from accelerate import Accelerator, DistributedType\n",
        "from accelerate import Accelerator, DistributedType\n\nfrom ddpgraph.integrations.accelerate import from_accelerator\n",
    ),
    (
        PREPARE_ALL,
        PREPARE_THE_REST + "    model.config.use_cache = False\n"
        "    train_step = from_accelerator(\n"
        "        accelerator, model, optimizer, clip_grad_norm=max_grad_norm,\n"
        "        loss_fn=lambda outputs, batch: outputs.loss * gradient_accumulation_steps * accelerator.num_processes,\n"
        "    )\n"
        "    model = train_step.model\n",
    ),
    (
        _SCRIPT_BACKWARD,
        '                    batch["num_items_in_batch"] = torch.tensor(num_items_in_batch)\n'
        "                    loss = train_step(batch, last=i == len(batch_samples) - 1)\n",
    ),
    (_SCRIPT_SCALE, ""),
    (
        _SCRIPT_UPDATE,
        "            grad_norm = train_step.grad_norm\n            lr_scheduler.step()\n",
    ),
]


def _texts(length: int = 9) -> list[str]:
    """500 rows: a text every 4th row (``length`` words on even texts, 3 to ``length`` - 1 on
    odd ones), else empty."""
    gen = torch.Generator().manual_seed(5)
    rows = [""] * TRAIN_ROWS
    for i in range(KEPT):
        n = length if i % 2 == 0 else 3 + int(torch.randint(length - 3, (), generator=gen))
        words = [_WORDS[int(w)] for w in torch.randint(len(_WORDS), (n,), generator=gen)]
        rows[i * 4] = " ".join(words)
    return rows


def make_inputs(folder: Path, config: dict[str, Any] | None = None, length: int = 9) -> None:
    """The hub cache with the tiny model (or one of ``config``'s sizes, random weights) and
    tokenizer under the script's name, and the data (even texts of ``length`` words)."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    repo = folder / "hub" / f"models--{HUB_NAME.replace('/', '--')}"
    commit = "0" * 40
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    vocab = {w: i for i, w in enumerate(["<|endoftext|>", "<unk>", *_WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    sizes = config or dict(
        vocab_size=len(vocab), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
    )  # fmt: skip
    PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", unk_token="<unk>",
        model_max_length=sizes["max_position_embeddings"],
    ).save_pretrained(snapshot)  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**sizes, tie_word_embeddings=True)).save_pretrained(snapshot)
    data = folder / "wikitext"
    data.mkdir()
    for name, rows in (("train", _texts(length)), ("validation", _texts(length)[:200])):
        lines = [json.dumps({"text": text}) for text in rows]
        (data / f"{name}.jsonl").write_text("\n".join(lines) + "\n")


def run(
    folder: str,
    script: str,
    variant: str,
    k: int,
    flags: tuple[str, ...] = (),
    device: str = "cpu",
    keep: str = "all",
) -> dict[str, Any]:
    """One rank of the script (``variant`` "original"; "graph_safe": its AdamW made graph-safe
    as the port's is, outside the script) or of its port ("port") at
    ``--gradient_accumulation_steps k`` and the script's other ``flags``; what it recorded. On
    ``device`` "cuda" Accelerate takes this rank's GPU and the port real CUDA graphs (on the
    CPU: Accelerate there, the port on ``CpuGraphs``); ``keep="times"``: only a timestamp after
    each update and the port's final report (benchmarks/upstream_ports.py)."""
    base = Path(folder)
    text = Path(script).read_text(encoding="utf-8")
    if variant == "port":
        text = ported(text, PORT)
    name = "_".join([variant, str(k), *(flag.lstrip("-") for flag in flags)])
    path = base / f"{name}_{NAME}"
    ready_to_run(base, path, text, device)
    os.environ["HF_HUB_CACHE"] = str(base / "hub")  # the script's model name is found here
    os.environ["HF_DATASETS_CACHE"] = str(base / "cache" / name)
    record: dict[str, Any] = {"losses": [], "lrs": [], "updates": [], "logits": []}
    if keep == "times":
        from accelerate.scheduler import AcceleratedScheduler

        _local_wikitext(base / "wikitext")
        stamp_updates(record, AcceleratedScheduler, "step")
        if variant == "graph_safe":
            graph_safe_at_prepare(device)
    else:
        _record(record, base / "wikitext", variant == "port", variant == "graph_safe", device)
    if variant == "port" and device == "cpu":
        graphs_on_the_cpu_engine()
    sys.argv = [str(path), "--gradient_accumulation_steps", str(k), *flags]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        runpy.run_path(str(path), run_name="__main__")
    record["printed"] = printed.getvalue().splitlines()
    if keep == "times":
        record["report"] = final_report()
    return record


def _local_wikitext(data: Path) -> None:
    """The script's ``load_dataset`` of wikitext redirected to the local files in ``data``."""
    import datasets

    load_dataset = datasets.load_dataset

    def local_wikitext(path: str, *args: Any, **kwargs: Any) -> Any:
        """The script's one hub data set, from local files with its column ("text")."""
        assert (path, args) == ("Salesforce/wikitext", ("wikitext-2-v1",)), (path, args)
        files = {split: str(data / f"{split}.jsonl") for split in ("train", "validation")}
        return load_dataset("json", data_files=files, **kwargs)

    datasets.load_dataset = local_wikitext  # the script imports it by name after this


def _record(record: dict[str, Any], data: Path, port: bool, graph_safe: bool, device: str) -> None:
    from transformers import AutoModelForCausalLM

    _local_wikitext(data)
    record_updates(record)
    loading = AutoModelForCausalLM.from_pretrained

    def from_pretrained(*args: Any, **kwargs: Any) -> Any:
        model = loading(*args, **kwargs)

        def hook(module: Any, inputs: Any, output: Any) -> None:
            if not module.training:  # the script's evaluation forwards (through its DDP)
                record["logits"].append(output.logits.detach().clone())

        model.register_forward_hook(hook)
        return model

    AutoModelForCausalLM.from_pretrained = from_pretrained  # type: ignore[method-assign]
    if port:
        record_step_losses(record)
    else:
        from accelerate import Accelerator

        if graph_safe:
            graph_safe_at_prepare(device)
        backward = Accelerator.backward

        def backward_recorded(self: Any, loss: torch.Tensor, **kwargs: Any) -> Any:
            record["losses"].append(loss.detach().clone())
            return backward(self, loss, **kwargs)

        Accelerator.backward = backward_recorded  # type: ignore[method-assign]
