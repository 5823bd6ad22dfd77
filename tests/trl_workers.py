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


def sft_prompt_completions(n: int = 96, seed: int = 6) -> Any:
    """Prompt-completion rows (TRL's completion_only_loss format): a prompt of 2-10 words, a
    completion of 2-10."""
    import datasets

    gen = torch.Generator().manual_seed(seed)
    rows = [{"prompt": _words(gen, 2, 10), "completion": _words(gen, 2, 10)} for _ in range(n)]
    return datasets.Dataset.from_list(rows)


def sft_conversations(n: int = 96, seed: int = 7) -> Any:
    """Conversational rows (TRL's assistant_only_loss format): a user turn, an assistant turn."""
    import datasets

    gen = torch.Generator().manual_seed(seed)
    rows = [
        {
            "messages": [
                {"role": "user", "content": _words(gen, 2, 9)},
                {"role": "assistant", "content": _words(gen, 2, 9)},
            ]
        }
        for _ in range(n)
    ]
    return datasets.Dataset.from_list(rows)


# a chat template whose assistant turns (and their end of turn) are in {% generation %} markers,
# the form TRL's assistant_only_loss reads the assistant mask from
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}{% generation %}"
    "{{ message['content'] }} <eos>{% endgeneration %} {% else %}{{ message['content'] }} "
    "{% endif %}{% endfor %}"
)

DATASETS = {"text": sft_texts, "prompt-completion": sft_prompt_completions,
            "conversational": sft_conversations}  # fmt: skip


def _words(gen: torch.Generator, low: int, high: int) -> str:
    count = int(torch.randint(low, high + 1, (1,), generator=gen))
    return " ".join(f"w{int(i)}" for i in torch.randint(_WORDS, (count,), generator=gen))


def _graph_safe_sft() -> Any:
    """SFTTrainer whose optimizer has the graphed step's arithmetic (the reference of a
    graphed run: ``mode="safe"``)."""
    from trl import SFTTrainer

    from .integration_workers import with_graph_safe_arithmetic

    return with_graph_safe_arithmetic(SFTTrainer)


class CompactChooser:
    """Stands for ``trl.trainer.utils._use_triton``: answers True (TRL's CUDA branch, the
    compact ``hidden_states[mask]``) and counts the questions."""

    def __init__(self) -> None:
        self.asked = 0

    def __call__(self, device: Any) -> bool:
        self.asked += 1
        return True


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


def run_sft(
    out: str,
    mode: str,
    order: str = "graphed",
    data: str = "text",
    step_options: dict[str, Any] | None = None,
    texts: int = 96,
    keep: list[Any] | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """SFTTrainer (``mode="plain"``; "safe": its optimizer with the graphed step's arithmetic),
    or graphed: ``order`` "graphed" is ``graphed(SFTTrainer)``, "first" is ``class
    T(GraphTrainer, SFTTrainer)``, "last" ``class T(SFTTrainer, GraphTrainer)``; ``mode``
    "graphed" captures with the CPU graph engine, "eager" does not. ``data``: a DATASETS key
    (``texts`` rows); ``keep`` receives the trainer."""
    from trl import SFTTrainer

    from ddpgraph.testing import CpuGraphs

    processing_class = tokenizer()
    if data == "conversational":
        processing_class.chat_template = CHAT_TEMPLATE
    common = dict(
        model=tiny_llama(), args=sft_config(out, **overrides), train_dataset=DATASETS[data](texts),
        processing_class=processing_class,
    )  # fmt: skip
    if mode == "plain":
        trainer = SFTTrainer(**common)
    elif mode == "safe":
        trainer = _graph_safe_sft()(**common)
    else:
        options: dict[str, Any] = {"engine": CpuGraphs()} if mode == "graphed" else {}
        if mode == "eager":
            options["graph"] = "never"
        options.update(step_options or {})
        trainer = _graphed_class(order)(**common, step_options=options)
    trainer.train()
    if keep is not None:
        keep.append(trainer)
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
        modes = case.pop("modes", ("plain", "eager", "safe", "graphed"))
        order = case.pop("order", "graphed")
        plain_args = case.pop("plain_args", {})  # what the plain run sets that GraphTrainer chose
        results[label] = {}
        for mode in modes:
            overrides = {**case, **(plain_args if mode in ("plain", "safe") else {})}
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


def run_sft_cases_on_the_cuda_branch(out: str, cases: dict[str, dict[str, Any]]) -> Any:
    """Each case (``data``, SFTConfig overrides) as the graphed-arithmetic plain SFTTrainer
    ("safe") and ``graphed(SFTTrainer)``, with TRL's CUDA branch chosen (:class:`CompactChooser`):
    {label: {mode: outcome, and how often the mode asked TRL's chooser}}."""
    import os

    import trl.trainer.utils as trl_utils

    results: dict[str, Any] = {}
    for label, case in cases.items():
        case = dict(case)
        options = case.pop("step_options", {})
        results[label] = {}
        for mode in ("safe", "graphed"):
            chooser = CompactChooser()
            trl_utils._use_triton = chooser  # type: ignore[attr-defined]
            where = os.path.join(out, label, mode)
            outcome = run_sft(where, mode, step_options=options, **case)
            results[label][mode] = {**outcome, "compact_asked": chooser.asked}
    return results


def run_sft_masking_itself(out: str) -> dict[str, Any]:
    """``graphed(SFTTrainer)`` with a ``compute_loss_func`` that selects the tokens that count
    with a boolean mask itself (``logits[mask]``): no fixed-shape path to choose, refused at
    capture naming that line, and the run continues eagerly."""
    from trl import SFTTrainer

    from ddpgraph.integrations.transformers import graphed
    from ddpgraph.testing import CpuGraphs

    from .trainer_workers import outcome

    def masked_loss(outputs: Any, labels: Any, num_items_in_batch: Any = None) -> Any:
        logits, targets = outputs.logits[:, :-1], labels[:, 1:]
        mask = targets != -100
        return torch.nn.functional.cross_entropy(logits[mask], targets[mask])  # masks itself

    trainer = graphed(SFTTrainer)(
        model=tiny_llama(),
        args=sft_config(out, pad_to_multiple_of=24, max_steps=14, gradient_accumulation_steps=1),
        train_dataset=sft_texts(), processing_class=tokenizer(), compute_loss_func=masked_loss,
        step_options={"engine": CpuGraphs()},
    )  # fmt: skip
    trainer.train()
    return outcome(trainer, "graphed")


PACKED = {"packing": True, "max_length": 48, "gradient_accumulation_steps": 1, "max_steps": 16}


def run_sft_packed(out: str) -> dict[str, Any]:
    """SFT with ``packing=True`` (TRL's BFD packing, its padding-free collator, sdpa with the
    documents told apart by ``position_ids``): the plain run (graph-safe arithmetic), the plain
    run with TRL's own padding of the packed row to the capacity (``pad_to_multiple_of``), and
    ``graphed(SFTTrainer)``; with the graphed run's padding over an epoch of its batches."""
    import os

    from ddpgraph.integrations import transformers as integration

    texts = 384  # enough documents that the packs fill
    capacity = 4 * PACKED["max_length"]  # per_device_train_batch_size x max_length
    runs = {
        "plain": run_sft(os.path.join(out, "plain"), "safe", texts=texts, **PACKED),
        "padded": run_sft(
            os.path.join(out, "padded"), "safe", texts=texts, pad_to_multiple_of=capacity, **PACKED
        ),
    }
    trainer: list[Any] = []
    runs["graphed"] = run_sft(
        os.path.join(out, "graphed"), "graphed", texts=texts, keep=trainer, **PACKED
    )
    real = padded = 0
    for batch in trainer[0].get_train_dataloader():
        real += int(batch[integration.REAL_TOKENS])
        padded += batch["input_ids"].shape[1]
    runs["padding"] = 1 - real / padded
    return runs
