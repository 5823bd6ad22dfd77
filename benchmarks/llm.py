"""LLM fine-tuning, plain against graphed: TRL's SFTTrainer, SFT packed, and a PEFT LoRA Trainer.

Each workload trains a Llama built here (no hub access: a word-level tokenizer over ``w0`` …,
random texts) with AdamW, a cosine schedule, ``max_grad_norm=1.0`` and ``logging_steps=10``,
in bf16 on CUDA; the plain trainer and its graphed form (``graphed(SFTTrainer)``,
``GraphTrainer``) take turns in one process. A rate is optimizer steps per second between step
``--measure-from`` (past warm-up and capture) and the end, each end behind a device sync;
tokens/s counts the batch's padded positions (``batch × max_length`` a step; packed: the
packed length). The JSON has each run's rates, its last logged loss, the graphed run's report
and replayed fraction (replays / step calls), the ratios, and whether the logged losses are
equal (``losses_equal``; for ``sft-packed`` the plain run's packed rows are not padded to the
graphed run's fixed capacity, so its losses may differ in the last bits: tests/ compare with a
plain run padded the same).

    python benchmarks/llm.py --model small --out benchmarks/results/llm-small.json   # CUDA
    python benchmarks/llm.py --model small --cpu --out /tmp/llm-small-cpu.json   # CPU trial
    python benchmarks/llm.py --smoke --out /tmp/llm-smoke.json    # CPU: tiny, CPU graph engine

``--cpu`` tries any model on the CPU through the CPU graph engine (fp32, fewer and shorter
steps unless given: the path end to end and the JSON's fields, never GPU figures); the JSON
says so (``"figures": "cpu-trial"``).

Workloads: ``sft`` (padded to ``--seq``: one shape), ``sft-packed`` (``packing=True``), ``lora``
(transformers' Trainer on a PEFT LoRA model, r=16 on q/v). A run that raises is recorded with its
error, and the others go on. The attention is the model's default (sdpa); on CUDA with
flash-attn installed, ``--attn flash_attention_2`` runs packed batches on its varlen kernel.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import traceback
from typing import Any

import torch
import transformers
from frameworks import Clock  # benchmarks/frameworks.py: steps/s behind device syncs

MODELS = {
    # hidden, layers, heads, kv heads, intermediate, vocab
    "tiny": (32, 2, 2, 1, 64, 64),
    "small": (512, 4, 8, 8, 1376, 32000),  # the LoRA figure's Llama (512 x 4)
    "300m": (1024, 20, 16, 8, 2816, 32000),  # ~322M parameters
}
WORKLOADS = ("sft", "sft-packed", "lora")
ATTENTION = "sdpa"  # --attn


def tokenizer(vocab: int) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {f"w{i}": i for i in range(vocab - 2)}
    words.update({"<pad>": vocab - 2, "<eos>": vocab - 1})
    wordlevel = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    wordlevel.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=wordlevel, pad_token="<pad>", eos_token="<eos>"
    )


def llama(name: str, seq: int) -> Any:
    hidden, layers, heads, kv, inter, vocab = MODELS[name]
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        attn_implementation=ATTENTION,
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=seq,
        pad_token_id=vocab - 2, eos_token_id=vocab - 1,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def texts(n: int, seq: int, vocab: int) -> Any:
    """Texts of seq/8 to seq-1 words (the tokenizer adds nothing; SFT appends eos)."""
    import datasets

    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(max(2, seq // 8), seq, (n,), generator=gen)
    rows = [
        " ".join(f"w{int(i)}" for i in torch.randint(vocab - 2, (int(k),), generator=gen))
        for k in lengths
    ]
    return datasets.Dataset.from_dict({"text": rows})


def run(workload: str, mode: str, opts: argparse.Namespace) -> dict[str, Any]:
    try:
        return _run(workload, mode, opts)
    except Exception as exc:  # recorded: the other runs go on
        return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}


def _run(workload: str, mode: str, opts: argparse.Namespace) -> dict[str, Any]:
    from ddpgraph.integrations.transformers import GraphTrainer, graphed

    vocab = MODELS[opts.model][5]
    cuda = not opts.cpu
    model = llama(opts.model, opts.seq)
    n = opts.steps * opts.batch
    common = dict(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=opts.batch,
        max_steps=opts.steps, learning_rate=2e-4, lr_scheduler_type="cosine",
        warmup_steps=opts.steps // 10, max_grad_norm=1.0, bf16=cuda, use_cpu=not cuda,
        logging_steps=10, save_strategy="no", report_to=[], disable_tqdm=True, seed=0,
        dataloader_drop_last=True,
    )  # fmt: skip
    step_options: dict[str, Any] = {}
    if not cuda:
        from ddpgraph.testing import CpuGraphs

        step_options["engine"] = CpuGraphs()
    clock = Clock(opts.measure_from)
    if workload in ("sft", "sft-packed"):
        from trl import SFTConfig, SFTTrainer

        packed = workload == "sft-packed"
        args = SFTConfig(
            **common, max_length=opts.seq, packing=packed,
            pad_to_multiple_of=None if packed else opts.seq,
        )  # fmt: skip
        kwargs = dict(
            model=model, args=args, train_dataset=texts(n * (1 + packed), opts.seq, vocab),
            processing_class=tokenizer(vocab), callbacks=[clock],
        )  # fmt: skip
        if mode == "plain":
            trainer = SFTTrainer(**kwargs)
        else:
            trainer = graphed(SFTTrainer)(**kwargs, step_options=step_options)
    else:
        import peft

        lora = peft.get_peft_model(
            model, peft.LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"])
        )
        tok = tokenizer(vocab)
        data = texts(n, opts.seq, vocab).map(
            lambda row: tok(row["text"], truncation=True, max_length=opts.seq),
            remove_columns=["text"],
        )
        collator = transformers.DataCollatorForLanguageModeling(
            tok, mlm=False, pad_to_multiple_of=opts.seq
        )
        args = transformers.TrainingArguments(**common)
        kwargs = dict(
            model=lora, args=args, train_dataset=data, data_collator=collator, callbacks=[clock]
        )
        if mode == "plain":
            trainer = transformers.Trainer(**kwargs)
        else:
            trainer = GraphTrainer(**kwargs, step_options=step_options)
    trainer.train()
    logged = [e for e in trainer.state.log_history if "loss" in e]
    rate = clock.rate
    result: dict[str, Any] = {
        "steps_per_s": rate,
        "tokens_per_s": rate * opts.batch * opts.seq,
        "last_loss": logged[-1]["loss"] if logged else None,
        "losses": [e["loss"] for e in logged],
    }
    if isinstance(trainer, GraphTrainer):
        report = trainer.report()
        assert report.step is not None
        result["report"] = str(report)
        result["replays"] = report.step.replays
        result["step_calls"] = report.step.steps
        result["replayed_fraction"] = report.step.replays / max(1, report.step.steps)
        result["fallbacks"] = report.step.fallbacks
    del trainer, model
    if cuda:
        torch.cuda.empty_cache()
    return result


def versions() -> dict[str, str]:
    import importlib.metadata as metadata

    # torch's own string names its build (2.14.1+cu130); a wheel's metadata may not
    found = {"torch": torch.__version__}
    for name in ("transformers", "trl", "peft", "accelerate", "flash-attn"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="small")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--steps", type=int, help="optimizer steps (CUDA 200, CPU 20)")
    parser.add_argument("--measure-from", type=int, help="the first timed step (40; CPU 14)")
    parser.add_argument("--batch", type=int, help="rows a step (8; CPU 2)")
    parser.add_argument("--seq", type=int, help="max_length (512; CPU 64)")
    parser.add_argument("--cpu", action="store_true", help="a trial on the CPU (CPU graph engine)")
    parser.add_argument("--smoke", action="store_true", help="--cpu with the tiny model")
    parser.add_argument("--attn", default="sdpa", help="sdpa, or flash_attention_2 where installed")
    parser.add_argument("--out", default=None)
    opts = parser.parse_args()
    if opts.smoke:
        opts.cpu, opts.model = True, "tiny"
        shape = {"steps": 16, "measure_from": 13, "batch": 4, "seq": 32}
    elif opts.cpu:
        # past the warm-up and the capture (replays from about step 13), in minutes on 2 cores
        shape = {"steps": 20, "measure_from": 14, "batch": 2, "seq": 64}
    elif torch.cuda.is_available():
        shape = {"steps": 200, "measure_from": 40, "batch": 8, "seq": 512}
    else:
        parser.error(
            "no CUDA device: this benchmark measures the GPU (bf16, CUDA graphs); pass --cpu "
            "(any model) or --smoke (the tiny one) for a trial through the CPU graph engine"
        )
    for key, value in shape.items():
        if getattr(opts, key) is None:
            setattr(opts, key, value)
    if opts.measure_from >= opts.steps:
        parser.error(f"--measure-from {opts.measure_from} must be below --steps {opts.steps}")
    global ATTENTION
    ATTENTION = opts.attn
    workloads = [w for w in opts.workloads.split(",") if w]
    unknown = sorted(set(workloads) - set(WORKLOADS))
    if unknown:
        parser.error(f"--workloads has {unknown}; choose from {', '.join(WORKLOADS)}")
    runs: dict[str, dict[str, Any]] = {}
    for workload in workloads:
        runs[workload] = {mode: run(workload, mode, opts) for mode in ("plain", "graphed")}
        plain, ours = runs[workload]["plain"], runs[workload]["graphed"]
        if "error" not in plain and "error" not in ours:
            runs[workload]["speedup"] = ours["steps_per_s"] / plain["steps_per_s"]
            runs[workload]["losses_equal"] = ours["losses"] == plain["losses"]
        print(workload, {m: r.get("steps_per_s", r.get("error")) for m, r in runs[workload].items()
                         if isinstance(r, dict)}, flush=True)  # fmt: skip
    on_gpu = not opts.cpu
    result = {
        "commit": commit(),
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
        "figures": "gpu" if on_gpu else "cpu-trial",  # a CPU trial's rates are not GPU figures
        "precision": "bf16" if on_gpu else "fp32",
        "engine": "CUDA graphs" if on_gpu else "ddpgraph.testing.CpuGraphs",
        "versions": versions(),
        "config": vars(opts),
        "parameters": sum(p.numel() for p in llama(opts.model, opts.seq).parameters()),
        "runs": runs,
    }
    text = json.dumps(result, indent=2)
    if opts.out:
        with open(opts.out, "w") as f:
            f.write(text + "\n")
        print("wrote", opts.out, flush=True)


if __name__ == "__main__":
    main()
