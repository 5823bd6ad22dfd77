"""``ddpgraph bench --varlen --hf``: real transformers models fed what users feed them.

Each architecture (small config, SDPA attention, the model's own loss) trains on the same
variable-length batches: every step a new length (32..256), every row its own length inside it,
right-padded with ``attention_mask == 0`` (labels -100) as a collator pads, then
``pad_batch(multiple=64)`` into buckets. Modes, in one process: eager DDP written by hand (the
speed reference), ``TrainStep(graph="never")`` with the same graph-safe optimizer (the numeric
reference) and ``TrainStep`` with ``on_new_shape="capture"``. Recorded: which graphed, why not,
ms/step (second pass, CUDA events), ratios measured in the same run, max parameter difference.
"""

from __future__ import annotations

import random
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..data import pad_batch
from ..distributed import runtime
from ..step import TrainStep
from ..step.optim import make_graph_safe
from . import _fresh, _step_times, _summary, _write_json, environment

Batch = dict[str, torch.Tensor]

HF_MODES = ("eager_ddp", "train_step_never", "train_step")
SMALL = {"hidden": 256, "layers": 4, "heads": 4, "vocab": 8192}


def _transformers() -> Any:
    """transformers as an untyped module: its configs take **kwargs that its stubs reject."""
    import importlib

    return importlib.import_module("transformers")


class _Lazy:
    """transformers, imported when a model is built: the architectures' names (checked by the
    command line before anything runs) are known without it."""

    def __getattr__(self, name: str) -> Any:
        return getattr(_transformers(), name)


def _causal(kind: str) -> Callable[[], Any]:
    tf = _Lazy()

    h, n, a, v = SMALL["hidden"], SMALL["layers"], SMALL["heads"], SMALL["vocab"]
    common = {"vocab_size": v, "num_hidden_layers": n, "num_attention_heads": a}
    configs: dict[str, Callable[[], Any]] = {
        "gpt2": lambda: tf.GPT2LMHeadModel(
            tf.GPT2Config(n_layer=n, n_embd=h, n_head=a, vocab_size=v, n_positions=512)
        ),
        "llama": lambda: tf.LlamaForCausalLM(
            tf.LlamaConfig(hidden_size=h, intermediate_size=688, num_key_value_heads=a, **common)
        ),
        "qwen2": lambda: tf.Qwen2ForCausalLM(
            tf.Qwen2Config(hidden_size=h, intermediate_size=688, num_key_value_heads=2, **common)
        ),
        "mistral": lambda: tf.MistralForCausalLM(
            tf.MistralConfig(hidden_size=h, intermediate_size=688, num_key_value_heads=2, **common)
        ),
        "mistral_no_cache": lambda: tf.MistralForCausalLM(
            tf.MistralConfig(
                hidden_size=h,
                intermediate_size=688,
                num_key_value_heads=2,
                use_cache=False,
                **common,
            )
        ),
        "gpt_neox": lambda: tf.GPTNeoXForCausalLM(
            tf.GPTNeoXConfig(hidden_size=h, intermediate_size=1024, **common)
        ),
        "opt": lambda: tf.OPTForCausalLM(
            tf.OPTConfig(
                hidden_size=h,
                ffn_dim=1024,
                word_embed_proj_dim=h,
                max_position_embeddings=512,
                **common,
            )
        ),
    }
    return configs[kind]


def _classifier(kind: str) -> Callable[[], Any]:
    tf = _Lazy()

    h, n, a, v = SMALL["hidden"], SMALL["layers"], SMALL["heads"], SMALL["vocab"]
    common = {"vocab_size": v, "num_hidden_layers": n, "num_attention_heads": a, "num_labels": 2}
    configs: dict[str, Callable[[], Any]] = {
        "bert_cls": lambda: tf.BertForSequenceClassification(
            tf.BertConfig(hidden_size=h, intermediate_size=1024, **common)
        ),
        "roberta_cls": lambda: tf.RobertaForSequenceClassification(
            tf.RobertaConfig(hidden_size=h, intermediate_size=1024, **common)
        ),
        "distilbert_cls": lambda: tf.DistilBertForSequenceClassification(
            tf.DistilBertConfig(dim=h, hidden_dim=1024, n_layers=n, n_heads=a, vocab_size=v)
        ),
    }
    return configs[kind]


def _t5() -> Any:
    tf = _transformers()

    return tf.T5ForConditionalGeneration(
        tf.T5Config(
            vocab_size=SMALL["vocab"],
            d_model=256,
            d_kv=64,
            d_ff=1024,
            num_layers=4,
            num_heads=4,
            decoder_start_token_id=0,
        )
    )


def _vit() -> Any:
    tf = _transformers()

    return tf.ViTForImageClassification(
        tf.ViTConfig(
            hidden_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            intermediate_size=1024,
            image_size=64,
            patch_size=8,
            num_labels=10,
        )
    )


ARCHITECTURES: dict[str, tuple[str, Callable[[], Any]]] = {
    **{
        k: ("causal", _causal(k))
        for k in ("gpt2", "llama", "qwen2", "mistral", "mistral_no_cache", "gpt_neox", "opt")
    },
    **{k: ("classifier", _classifier(k)) for k in ("bert_cls", "roberta_cls", "distilbert_cls")},
    "t5": ("seq2seq", _t5),
    "vit": ("vision", _vit),
}
HEADLINE = ("gpt2", "llama", "bert_cls")


def masked_batches(
    kind: str, steps: int, device: torch.device, *, batch_size: int = 16
) -> list[Batch]:
    """Variable-length, right-padded, masked batches in ``pad_batch(multiple=64)`` buckets."""
    rng = random.Random(0)
    gen = torch.Generator(device=device).manual_seed(0)
    vocab = SMALL["vocab"]
    out: list[Batch] = []
    for _ in range(steps):
        if kind == "vision":
            pixels = torch.randn(batch_size, 3, 64, 64, device=device, generator=gen)
            labels = torch.randint(10, (batch_size,), device=device, generator=gen)
            out.append({"pixel_values": pixels, "labels": labels})
            continue
        length = rng.randint(32, 256)
        lengths = torch.tensor(
            [rng.randint(max(8, length // 2), length) for _ in range(batch_size)]
        )
        mask = (torch.arange(length)[None, :] < lengths[:, None]).long().to(device)
        ids = torch.randint(1, vocab, (batch_size, length), device=device, generator=gen) * mask
        batch: Batch = {"input_ids": ids, "attention_mask": mask}
        if kind == "causal":
            batch["labels"] = ids.masked_fill(mask == 0, -100)
        elif kind == "classifier":
            batch["labels"] = torch.randint(2, (batch_size,), device=device, generator=gen)
        else:  # seq2seq: the target is the source, shifted by the model itself
            batch["labels"] = ids.masked_fill(mask == 0, -100)
        out.append(pad_batch(batch, multiple=64, dim=1))
    return out


def _build(make: Callable[[], Any], device: torch.device) -> Any:
    torch.manual_seed(0)
    return make().to(device)


def _hand_written(make: Callable[[], Any], device: torch.device) -> Callable[[Batch], Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _build(make, device)
    ddp = DDP(model, device_ids=[device.index]) if torch.distributed.is_initialized() else model
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)

    def one(batch: Batch) -> Any:
        opt.zero_grad(set_to_none=True)
        loss = ddp(**batch).loss
        loss.backward()
        opt.step()
        return loss

    return one


def _train_step(make: Callable[[], Any], device: torch.device, graph: str) -> TrainStep:
    model = _build(make, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if graph == "never":
        make_graph_safe(opt, device)  # the graphed run's arithmetic, run eagerly
    return TrainStep(model, opt, graph=graph, on_new_shape="capture")  # type: ignore[arg-type]


def run_architecture(name: str, device: torch.device, steps: int) -> dict[str, Any]:
    """Every mode of one architecture on the same batches; mode, timings, ratios, differences."""
    kind, make = ARCHITECTURES[name]
    batches = masked_batches(kind, steps, device)
    result: dict[str, Any] = {"kind": kind}
    finals: dict[str, list[torch.Tensor]] = {}
    for mode in HF_MODES:
        with _fresh(device), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.manual_seed(1)
            started = time.perf_counter()
            if mode == "eager_ddp":
                one: Callable[[Batch], Any] = _hand_written(make, device)
            else:
                one = _train_step(make, device, "never" if mode == "train_step_never" else "auto")
            for batch in batches:  # cold pass: captures included
                one(batch)
            torch.cuda.synchronize(device)
            whole = (time.perf_counter() - started) / len(batches) * 1e3
            entry: dict[str, Any] = _summary(_timed_pass(one, batches, device))
            entry["whole_run_ms"] = whole
            if isinstance(one, TrainStep):
                report = one.report()
                entry |= {"mode": report.mode, "graphs": len(report.captures)}
                entry["fallbacks"] = [r.splitlines()[0][:300] for r in report.fallbacks]
                finals[mode] = [p.detach().float().clone() for p in one.model.parameters()]
            entry["warnings"] = sorted({str(w.message).splitlines()[0][:200] for w in caught})[:3]
            result[mode] = entry
    eager = result["eager_ddp"]["median_ms"]
    result["ratio_to_eager"] = {m: result[m]["median_ms"] / eager for m in HF_MODES}
    if len(finals) == 2:
        a, b = finals["train_step"], finals["train_step_never"]
        result["max_param_diff"] = _max_diff(a, b)
        result["eager_noise"] = _max_diff(b, _never_again(make, batches, device))
    return result


def _never_again(
    make: Callable[[], Any], batches: list[Batch], device: torch.device
) -> list[torch.Tensor]:
    """A second eager run of the reference: how far eager differs from itself (SDPA backward
    kernels may use atomics)."""
    with _fresh(device), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(1)
        step = _train_step(make, device, "never")
        for _ in range(2):  # the reference ran the batches twice (cold pass, timed pass)
            for batch in batches:
                step(batch)
        return [p.detach().float().clone() for p in step.model.parameters()]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def _timed_pass(
    one: Callable[[Batch], Any], batches: list[Batch], device: torch.device
) -> list[float]:
    it = iter(batches)
    return _step_times(lambda: one(next(it)), len(batches), device)


def run_hf(
    *, repeats: int, out: Path, only: list[str] | None = None, steps: int = 48
) -> dict[str, Any]:
    """Each architecture ``repeats`` times; JSON with per-run results and median ratios."""
    rt = runtime.init()
    if rt.device.type != "cuda":
        raise SystemExit("bench --varlen --hf measures CUDA graphs: it needs a GPU.")
    names = only or list(ARCHITECTURES)
    runs: list[dict[str, Any]] = []
    results: dict[str, Any] = {
        "environment": environment(),
        "world_size": rt.world_size,
        "note": "world size 1: an in-place NCCL all-reduce over one rank launches no kernel, "
        "so these times contain no communication",
        "batches": "lengths 32..256 per step, each row its own length, right-padded with "
        "attention_mask 0, pad_batch(multiple=64)",
        "steps": steps,
        "runs": runs,
    }
    for r in range(repeats):
        run: dict[str, Any] = {}
        for name in names:
            try:
                run[name] = run_architecture(name, rt.device, steps)
            except Exception as exc:  # one architecture failing must not lose the others
                run[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
            print(f"run {r + 1}/{repeats} {name}: {_line(run[name])}", flush=True)
        runs.append(run)
        _write_json(results, out)  # after every run: a timeout keeps what finished
    results["median_ratio_train_step"] = _median_ratios(runs)
    _write_json(results, out)
    runtime.shutdown()
    return results


def _line(entry: dict[str, Any]) -> str:
    if "error" in entry:
        return str(entry["error"])
    step = entry["train_step"]
    return (
        f"{step['mode']} {entry['ratio_to_eager']['train_step']:.2f}x eager "
        f"({step['median_ms']:.2f} vs {entry['eager_ddp']['median_ms']:.2f} ms), "
        f"max diff {entry.get('max_param_diff', float('nan')):.2e} "
        f"(eager vs eager {entry.get('eager_noise', float('nan')):.2e}) "
        + (f"fallback: {step['fallbacks'][0][:160]}" if step["fallbacks"] else "")
    )


def _median_ratios(runs: list[dict[str, Any]]) -> dict[str, float]:
    import statistics

    ratios: dict[str, list[float]] = {}
    for run in runs:
        for name, entry in run.items():
            if "ratio_to_eager" in entry:
                ratios.setdefault(name, []).append(entry["ratio_to_eager"]["train_step"])
    return {name: statistics.median(values) for name, values in ratios.items()}
