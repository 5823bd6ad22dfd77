"""The Trainer feature matrix: each row a set of ``TrainingArguments`` (and Trainer extras) run
with the plain ``transformers.Trainer`` (its own DDP through Accelerate), with ``GraphTrainer``
eagerly, and with ``GraphTrainer`` on the CPU engine capturing, on 2 gloo ranks; every logged
entry (losses, grad norms, learning rates, eval metrics, epochs), the final parameters and the
optimizer's state must be equal to the bit, and the captured run must have replayed. The eager
run is compared with the plain Trainer; the captured one steps the optimizer as on CUDA
(capturable, foreach, the LR a float32 tensor), so it is compared with the plain Trainer whose
optimizer steps that arithmetic (``trainer_workers.REFERENCE``).

A process pair runs a whole group of rows (starting one costs more than a short run). The rows
of ``MORE`` run when ``DDPGRAPH_TRAINER_MATRIX=full`` (a skip says so otherwise): they repeat
what ``CORE`` covers with other values. Tested with transformers 5.25 and accelerate 1.16.
"""

from __future__ import annotations

import os

import pytest

from ddpgraph.testing import run_distributed

from . import trainer_workers as workers

pytest.importorskip("transformers")

RUN_S = 2100  # a group of ~10 rows, four runs each, on a loaded 2-core machine
EVAL = {"eval_strategy": "steps", "eval_steps": 4}
BEST = {"save_strategy": "steps", "save_steps": 4, "load_best_model_at_end": True}
TAIL = {"max_steps": -1, "num_train_epochs": 2}  # 120 rows: 15 batches an epoch, k=2

# one process pair each; labels read as the feature they check
CORE: dict[str, dict[str, dict]] = {
    "training": {
        "accumulation 2, clipping, linear warm-up": {},
        "no accumulation": {"args": {"gradient_accumulation_steps": 1}},
        "accumulation 4": {"args": {"gradient_accumulation_steps": 4}},
        "no clipping": {"args": {"max_grad_norm": 0.0}},
        "cosine schedule": {"args": {"lr_scheduler_type": "cosine"}},
        "warm-up as a ratio, constant": {
            "args": {"lr_scheduler_type": "constant_with_warmup", "warmup_steps": 0.2}
        },
        "weight decay, Adam betas": {
            "args": {
                "weight_decay": 0.1,
                "adam_beta1": 0.8,
                "adam_beta2": 0.99,
                "adam_epsilon": 1e-6,
            }
        },
        "label smoothing": {"args": {"label_smoothing_factor": 0.1}},
        "gradient checkpointing": {"args": {"gradient_checkpointing": True}},
        "bf16": {"args": {"bf16": True}},
        "fp16 (fp32 on the CPU, as Accelerate trains it there)": {"args": {"fp16": True}},
        "compute_loss_func": {"loss_func": True},
        "torch_compile (eager backend)": {
            "args": {"torch_compile": True, "torch_compile_backend": "eager"}
        },
    },
    "data and epochs": {
        "epochs instead of max_steps": {"args": {"max_steps": -1, "num_train_epochs": 2}},
        "epoch tail (15 batches, k=2)": {"rows": 120, "args": TAIL},
        "epoch tail, k=4 (14 batches)": {
            "rows": 112,
            "args": {"max_steps": -1, "num_train_epochs": 4, "gradient_accumulation_steps": 4},
        },
        "drop_last": {"rows": 124, "args": {"dataloader_drop_last": True}},
        "group_by_length sampling": {"args": {"train_sampling_strategy": "group_by_length"}},
        "seed and data_seed": {"args": {"seed": 42, "data_seed": 7}},
        "logging every 3 steps, first step": {
            "args": {"logging_steps": 3, "logging_first_step": True}
        },
        "input tokens seen": {"args": {"include_num_input_tokens_seen": True}},
        "pin_memory off, persistent workers off": {
            "args": {"dataloader_pin_memory": False, "dataloader_persistent_workers": False}
        },
    },
    "evaluation": {
        "eval every 4 steps": {"args": EVAL, "eval_rows": 16},
        "eval with metrics, eval accumulation": {
            "args": {**EVAL, "eval_accumulation_steps": 2},
            "eval_rows": 16,
            "metrics": True,
        },
        "early stopping, best model at end": {
            "args": {**EVAL, **BEST, "learning_rate": 5e-3, "max_steps": 40},
            "eval_rows": 16,
            "callbacks": ["early_stopping"],
        },
        "eval on start, per epoch": {
            "args": {"eval_strategy": "epoch", "eval_on_start": True},
            "eval_rows": 16,
        },
        "bf16 with eval (forward wrapped)": {"args": {**EVAL, "bf16": True}, "eval_rows": 16},
        "epoch tail with eval": {"rows": 120, "args": {**TAIL, **EVAL}, "eval_rows": 16},
        "saves every 4 steps, eval": {
            "args": {**EVAL, "save_strategy": "steps", "save_steps": 4, "max_steps": 22},
            "eval_rows": 16,
        },
        # the previous row's plain Trainer checkpoint, resumed with eval on (18 steps: it
        # captures), then evaluated and its model card written: ends as that run did
        "resume the Trainer's checkpoint, eval": {
            "args": {**EVAL, "save_strategy": "steps", "save_steps": 4, "max_steps": 22},
            "eval_rows": 16,
            "resume_from": ("saves every 4 steps, eval", "checkpoint-4"),
            "then_evaluate": True,
        },
        "run_clm.py (corpus)": {
            "corpus": "run_clm",
            "args": {**EVAL, "max_steps": -1, "num_train_epochs": 2},
            "then_evaluate": True,
        },
    },
}

MORE: dict[str, dict[str, dict]] = {
    "more": {
        "polynomial schedule with kwargs": {
            "args": {"lr_scheduler_type": "polynomial", "lr_scheduler_kwargs": {"power": 2.0}}
        },
        "SGD": {"args": {"optim": "sgd"}},
        "fused AdamW": {"args": {"optim": "adamw_torch_fused"}},
        "no NaN/inf filter": {"args": {"logging_nan_inf_filter": False}},
        "tokens not averaged across ranks": {"args": {"average_tokens_across_devices": False}},
        "ddp_find_unused_parameters": {"args": {"ddp_find_unused_parameters": True}},
        "reduce LR on plateau": {
            "args": {**EVAL, "lr_scheduler_type": "reduce_lr_on_plateau"},
            "eval_rows": 16,
        },
        "fp16 with eval": {"args": {**EVAL, "fp16": True}, "eval_rows": 16},
        "prediction loss only": {"args": {**EVAL, "prediction_loss_only": True}, "eval_rows": 16},
    },
}


def _check_group(rows: dict[str, dict], tmp_path) -> list[dict]:
    results = run_distributed(workers.run_rows, 2, args=(str(tmp_path), rows), timeout=RUN_S)
    failures = []
    for label in rows:
        for rank in range(2):
            runs = results[rank][label]
            for reference in ("plain", "safe"):  # every row is one the Trainer trains
                if isinstance(runs[reference], str):
                    failures.append(
                        f"{label} [{reference} Trainer, rank {rank}]: {runs[reference]:.300}"
                    )
            for mode, reference in workers.REFERENCE.items():
                found = workers.differences(runs[reference], runs[mode])
                if found:
                    failures.append(f"{label} [{mode}, rank {rank}]: {found[:2]}")
        graphed = results[0][label]["graphed"]
        if not isinstance(graphed, str) and "mode=graphed" not in graphed["report"]:
            failures.append(f"{label}: never captured: {graphed['report']}")
    assert not failures, "\n".join(failures)
    return results


@pytest.mark.timeout(RUN_S + 60)
@pytest.mark.parametrize(
    "group",
    sorted(CORE),
)
def test_trainer_features_train_bit_for_bit_as_the_trainer(group, tmp_path):
    results = _check_group(CORE[group], tmp_path)
    if group == "evaluation":  # the evaluations ran inside train() and were logged
        logs = results[0]["eval every 4 steps"]["plain"]["logs"]
        # every 4 steps, and at the run's last step (14), where the Trainer evaluates too
        assert [e["step"] for e in logs if "eval_loss" in e] == [4, 8, 12, 14]
        stopped = results[0]["early stopping, best model at end"]["plain"]["global_step"]
        assert stopped < 40  # EarlyStoppingCallback ended the run


@pytest.mark.timeout(RUN_S + 60)
@pytest.mark.skipif(
    os.environ.get("DDPGRAPH_TRAINER_MATRIX") != "full",
    reason="the matrix's further rows run with DDPGRAPH_TRAINER_MATRIX=full",
)
def test_more_trainer_features_train_bit_for_bit_as_the_trainer(tmp_path):
    _check_group(MORE["more"], tmp_path)


def test_the_matrix_has_at_least_30_rows():
    assert sum(len(rows) for rows in CORE.values()) >= 30
