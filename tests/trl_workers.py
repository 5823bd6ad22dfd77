"""Workers for TRL's trainers through GraphTrainer (``test_integrations_trl.py``), on 2 gloo ranks:
a tiny Llama and a word-level tokenizer built here (no hub access), SFT data of varying lengths."""

from __future__ import annotations

from typing import Any

import torch

_WORDS = 60


def tokenizer() -> Any:
    """A word-level tokenizer over ``w0`` … ``w59``, with pad and eos tokens."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(_WORDS)}
    vocab.update({"<pad>": _WORDS, "<eos>": _WORDS + 1})
    words = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=words, pad_token="<pad>", eos_token="<eos>"
    )


def tiny_llama() -> Any:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=_WORDS + 2, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        pad_token_id=_WORDS, eos_token_id=_WORDS + 1,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def sft_texts(n: int = 96, seed: int = 5) -> Any:
    """Texts of 3 to 20 words: pad-to-longest batches of many lengths."""
    import datasets

    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 21, (n,), generator=gen)
    texts = [
        " ".join(f"w{int(i)}" for i in torch.randint(_WORDS, (int(k),), generator=gen))
        for k in lengths
    ]
    return datasets.Dataset.from_dict({"text": texts})


def sft_config(out: str, **overrides: Any) -> Any:
    from trl import SFTConfig

    options: dict[str, Any] = dict(
        output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        max_grad_norm=0.5, learning_rate=1e-3, lr_scheduler_type="cosine", warmup_steps=2,
        max_steps=14, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
        disable_tqdm=True, dataloader_num_workers=0, max_length=24,
    )  # fmt: skip
    options.update(overrides)
    return SFTConfig(**options)


def run_sft(out: str, mode: str, order: str = "graphed", **overrides: Any) -> dict[str, Any]:
    """SFTTrainer (``mode="plain"``), or graphed: ``order`` "graphed" is ``graphed(SFTTrainer)``,
    "first" is ``class T(GraphTrainer, SFTTrainer)``, "last" ``class T(SFTTrainer, GraphTrainer)``;
    ``mode`` "graphed" captures with the CPU stand-in engine, "eager" does not."""
    from trl import SFTTrainer

    from ddpgraph.testing import CpuGraphs

    common = dict(
        model=tiny_llama(), args=sft_config(out, **overrides), train_dataset=sft_texts(),
        processing_class=tokenizer(),
    )  # fmt: skip
    if mode == "plain":
        trainer = SFTTrainer(**common)
    else:
        options: dict[str, Any] = {"engine": CpuGraphs()} if mode == "graphed" else {}
        if mode == "eager":
            options["graph"] = "never"
        trainer = _graphed_class(order)(**common, step_options=options)
    trainer.train()
    from .trainer_workers import outcome

    return outcome(trainer, mode)


def _graphed_class(order: str) -> Any:
    from trl import SFTTrainer

    from ddpgraph.integrations.transformers import GraphTrainer, graphed

    if order == "graphed":
        return graphed(SFTTrainer)
    if order == "first":

        class GraphFirst(GraphTrainer, SFTTrainer):
            pass

        return GraphFirst

    class GraphLast(SFTTrainer, GraphTrainer):
        pass

    return GraphLast


def run_sft_modes(out: str, cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each case (``order``, ``mode`` list, SFTConfig overrides) in one process pair."""
    import os

    results: dict[str, Any] = {}
    for label, case in cases.items():
        case = dict(case)
        modes = case.pop("modes", ("plain", "eager", "graphed"))
        order = case.pop("order", "graphed")
        plain_args = case.pop("plain_args", {})  # what the plain run sets that GraphTrainer chose
        results[label] = {}
        for mode in modes:
            overrides = {**case, **(plain_args if mode == "plain" else {})}
            where = os.path.join(out, label, mode)
            results[label][mode] = run_sft(where, mode, order, **overrides)
    return results


def dpo_pairs(n: int = 64, seed: int = 9) -> Any:
    """Preference rows: a prompt of 2-6 words, a chosen and a rejected answer of 2-8."""
    import datasets

    gen = torch.Generator().manual_seed(seed)

    def words(low: int, high: int) -> str:
        count = int(torch.randint(low, high + 1, (1,), generator=gen))
        return " ".join(f"w{int(i)}" for i in torch.randint(_WORDS, (count,), generator=gen))

    rows = [
        {"prompt": words(2, 6), "chosen": words(2, 8), "rejected": words(2, 8)} for _ in range(n)
    ]
    return datasets.Dataset.from_list(rows)


def run_dpo(out: str, mode: str) -> dict[str, Any]:
    """DPOTrainer (the reference model built as the policy is), plain or ``graphed(DPOTrainer)``."""
    from trl import DPOConfig, DPOTrainer

    from ddpgraph.integrations.transformers import graphed
    from ddpgraph.testing import CpuGraphs

    from .trainer_workers import outcome

    args = DPOConfig(
        output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        max_grad_norm=0.5, learning_rate=1e-3, warmup_steps=2, max_steps=14, logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
        dataloader_num_workers=0, max_length=24, pad_to_multiple_of=24,
    )  # fmt: skip
    common = dict(
        model=tiny_llama(), ref_model=tiny_llama(), args=args, train_dataset=dpo_pairs(),
        processing_class=tokenizer(),
    )  # fmt: skip
    if mode == "plain":
        trainer = DPOTrainer(**common)
    else:
        options: dict[str, Any] = {"engine": CpuGraphs()} if mode == "graphed" else {}
        trainer = graphed(DPOTrainer)(**common, step_options=options)
    trainer.train()
    return outcome(trainer, mode)


def run_dpo_modes(out: str) -> dict[str, Any]:
    import os

    return {mode: run_dpo(os.path.join(out, mode), mode) for mode in ("plain", "graphed")}


def run_sft_on_the_cuda_branch(out: str) -> dict[str, Any]:
    """``graphed(SFTTrainer)`` with TRL's loss on the branch it takes on CUDA: TRL chooses the
    compact path (``hidden_states[mask] if compact``, trl/trainer/utils.py) when
    ``_use_triton(device)`` says the device runs Triton (trl/kernels/chunked_logprob.py: CUDA or
    XPU with triton installed). The name is rebound where the loss reads it; the kernel itself
    keeps its torch implementation."""
    import trl.trainer.utils as trl_utils

    trl_utils._use_triton = lambda device: True  # type: ignore[attr-defined]
    return run_sft(out, "graphed", pad_to_multiple_of=8, max_steps=16, logging_steps=8)
