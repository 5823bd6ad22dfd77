"""``GraphTrainer``: transformers' Trainer with a graphed TrainStep trains bit for bit as the
Trainer's own DDP run (2 gloo ranks, the real capture policy on the CPU): a tiny GPT-2 built
here on padded, attention-masked batches, gradient accumulation (with ``num_items_in_batch``),
clipping, a linear warm-up and decay; the same logged loss, grad norm and learning rate; a
resume from the Trainer's own checkpoint lands where the Trainer's run does. The feature matrix
(``test_trainer_matrix.py``) runs ~30 further TrainingArguments the same way."""

from __future__ import annotations

import functools
import subprocess
import sys

import pytest
import torch

from ddpgraph import ConfigError
from ddpgraph.testing import run_distributed

from . import integration_workers as workers

pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(600)

RUN_S = 540  # one Trainer run of 20 steps on 2 ranks, on a loaded 2-core machine


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The Trainer's own run (DDP by Accelerate), checkpoints every 4 steps. Its optimizer steps
    with the graphed step's arithmetic (capturable, foreach, the LR a float32 tensor:
    integration_workers.with_graph_safe_arithmetic), as the CPU engine steps it as on CUDA; with
    the Trainer's default arithmetic the runs part in the last bits (grad norm 6e-8 apart at
    step 7), and are equal on the H100 (the GPU receipt)."""
    out = tmp_path_factory.mktemp("plain")
    return out, run_distributed(workers.run_trainer, 2, args=(str(out), False), timeout=RUN_S)


@pytest.fixture
def fresh_accelerate():
    """Trainers built in this process leave Accelerate's process-wide state behind."""
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def _same(ours, theirs):
    assert ours["logs"] == theirs["logs"]  # loss, grad_norm, learning_rate: exact floats
    assert ours["lr"] == theirs["lr"]
    for name, value in theirs["params"].items():
        assert torch.equal(ours["params"][name], value), name


def test_graph_trainer_trains_bit_for_bit_as_the_trainer(plain, tmp_path):
    _, theirs = plain
    ours = run_distributed(workers.run_trainer, 2, args=(str(tmp_path), True), timeout=RUN_S)
    for rank in range(2):
        _same(ours[rank], theirs[rank])
    # the schedule really drove the update: warm-up from 0, linear decay after 4 steps
    rates = [entry["learning_rate"] for entry in theirs[0]["logs"]]
    assert rates[0] == 0.0 and max(rates) == 1e-3 and rates[-1] < rates[4]
    report = ours[0]["report"]
    assert "mode=graphed" in report and "replays=16" in report, report
    assert "num_items_in_batch: () float32" in report  # a graph input, not a constant


def test_resume_from_the_trainers_own_checkpoint_is_exact(plain, tmp_path):
    out, theirs = plain
    checkpoint = str(out / "checkpoint-4")
    ours = run_distributed(
        workers.run_trainer, 2, args=(str(tmp_path), True, checkpoint), timeout=RUN_S
    )
    for rank in range(2):
        _same(ours[rank], theirs[rank])  # steps 1-4 from the checkpoint's trainer state
    assert "replays=8" in ours[0]["report"], ours[0]["report"]


def test_options_the_training_arguments_set_are_refused_in_step_options():
    from ddpgraph.integrations.transformers import GraphTrainer

    with pytest.raises(ConfigError, match=r"\['accumulate_calls', 'amp'\].*set them there"):
        GraphTrainer(step_options={"amp": "bf16", "accumulate_calls": 2})


def test_torch_compile_set_twice_is_refused_at_construction(tmp_path, fresh_accelerate):
    from ddpgraph.integrations.transformers import GraphTrainer

    args = workers.trainer_args(str(tmp_path), torch_compile=True, torch_compile_backend="eager")
    with pytest.raises(ConfigError, match=r"torch_compile=True\) and step_options=.*one place"):
        GraphTrainer(model=workers.tiny_gpt2(), args=args, step_options={"compile": True})


def test_graphed_makes_any_trainer_subclass_a_graph_trainer():
    import transformers

    from ddpgraph.integrations.transformers import GraphTrainer, graphed

    class MyTrainer(transformers.Trainer):
        pass

    made = graphed(MyTrainer)
    assert made.__mro__[1:3] == (GraphTrainer, MyTrainer) and made.__name__ == "GraphedMyTrainer"
    assert graphed(made) is made
    with pytest.raises(
        ConfigError, match=r"takes a transformers\.Trainer subclass, got <class 'int'>"
    ):
        graphed(int)


def test_step_options_reach_graph_trainer_in_either_class_order(tmp_path, fresh_accelerate):
    import transformers

    from ddpgraph.integrations.transformers import GraphTrainer

    class Other(transformers.Trainer):
        def __init__(self, model: object, args: object, *, extra: int = 0) -> None:
            self.extra = extra  # a subclass with its own, closed signature (as TRL's)
            super().__init__(model=model, args=args)

    class Last(Other, GraphTrainer):
        pass

    class Later(Last):
        pass

    args = workers.trainer_args(str(tmp_path))
    for cls in (Last, Later):
        trainer = cls(workers.tiny_gpt2(), args, extra=3, step_options={"warmup": 13})
        assert trainer.step_options == {"warmup": 13} and trainer.extra == 3
    with pytest.raises(ConfigError, match=r"\['amp'\].*set them there"):
        Last(workers.tiny_gpt2(), args, step_options={"amp": "bf16"})


# ---------------------------------------------------------------- the Trainer's own FSDP2
# TrainingArguments(fsdp="full_shard", fsdp_config={"fsdp_version": 2}): Accelerate shards the
# blocks, embeddings and head with fully_shard (integration_workers.fsdp2_on_the_cpu gives the
# CPU the Accelerator it builds on CUDA); checkpoints as DCP shards (SHARDED_STATE_DICT)
SHARDED = [
    "",
    "transformer.wte",
    "transformer.h.0",
    "transformer.h.1",
    "transformer.ln_f",
    "lm_head",
]


@pytest.fixture(scope="module")
def plain_fsdp2(tmp_path_factory):
    """The Trainer's own FSDP2 run (its optimizer stepping the graphed arithmetic, its FSDP2
    clipping with foreach as on CUDA), checkpoints every 4 steps."""
    out = tmp_path_factory.mktemp("plain_fsdp2")
    return out, run_distributed(workers.run_fsdp2_trainer, 2, args=(str(out), False), timeout=RUN_S)


@pytest.fixture(scope="module")
def graphed_fsdp2(tmp_path_factory):
    """GraphTrainer with the same TrainingArguments, checkpoints every 4 steps."""
    out = tmp_path_factory.mktemp("graphed_fsdp2")
    return out, run_distributed(workers.run_fsdp2_trainer, 2, args=(str(out), True), timeout=RUN_S)


def test_the_trainers_own_fsdp2_is_graphed_and_trains_bit_for_bit_as_the_trainer(
    plain_fsdp2, graphed_fsdp2
):
    """Both accumulate a window's unsharded gradients and reduce-scatter them once, at its
    last micro-batch (the Trainer through Accelerate's FSDP2 ``no_sync``, GraphTrainer through
    the step): losses, grad norms, learning rates and parameters equal to the bit, replays
    included."""
    (_, theirs), (_, ours) = plain_fsdp2, graphed_fsdp2
    for rank in range(2):
        assert theirs[rank]["sharded"] == SHARDED and ours[rank]["sharded"] == SHARDED
        assert theirs[rank]["fsdp2_no_sync"] and ours[rank]["fsdp2_no_sync"]
        _same(ours[rank], theirs[rank])
    report = ours[0]["report"]
    assert "mode=graphed" in report and "replays=16" in report, report  # 40 calls, 24 warm-up


def test_graph_trainer_resumes_the_trainers_own_fsdp2_checkpoint(plain_fsdp2, tmp_path):
    out, theirs = plain_fsdp2
    checkpoint = str(out / "checkpoint-4")  # DCP shards of the model and optimizer, saved by it
    ours = run_distributed(
        workers.run_fsdp2_trainer, 2, args=(str(tmp_path), True, checkpoint), timeout=RUN_S
    )
    for rank in range(2):
        _same(ours[rank], theirs[rank])  # steps 1-4 from the checkpoint's trainer state
    assert "mode=graphed" in ours[0]["report"] and "replays=8" in ours[0]["report"]


def test_a_checkpoint_graph_trainer_saved_under_fsdp2_resumes_bit_for_bit(graphed_fsdp2, tmp_path):
    """GraphTrainer saves the FSDP2 model and optimizer through the Trainer (Accelerate's
    save_fsdp_model / save_fsdp_optimizer on DCP); resumed, it lands where its own uninterrupted
    run did, to the bit (its replays equal its eager steps)."""
    out, whole = graphed_fsdp2
    checkpoint = str(out / "checkpoint-4")
    resumed = run_distributed(
        workers.run_fsdp2_trainer, 2, args=(str(tmp_path), True, checkpoint), timeout=RUN_S
    )
    for rank in range(2):
        _same(resumed[rank], whole[rank])
        for index, state in whole[rank]["optimizer"].items():
            for key, value in state.items():
                assert torch.equal(resumed[rank]["optimizer"][index][key], value), (index, key)


def test_the_trainers_fsdp1_is_refused_on_every_rank_naming_the_way_out(tmp_path):
    from .test_objects import assert_same_error_everywhere

    # sync_module_states off: FSDP1's plugin refuses it on the CPU at construction
    fsdp1 = {"fsdp": True, "fsdp_config": {"version": 1, "sync_module_states": "false"}}
    errors = run_distributed(
        functools.partial(workers.build_trainer_with_fsdp, **fsdp1), 2, args=(str(tmp_path),),
        timeout=RUN_S, return_exceptions=True,
    )  # fmt: skip
    assert_same_error_everywhere(errors, ConfigError, "runs the Trainer's FSDP2 only")
    assert "version 1" in str(errors[0]) and "fsdp_config={'version': 2}" in str(errors[0])


def test_fp16_with_the_trainers_fsdp2_is_refused_on_every_rank_naming_bf16(tmp_path):
    from .test_objects import assert_same_error_everywhere

    fp16 = {"fp16": True, "scale_fp16": True, **workers.FSDP2_ARGS}
    errors = run_distributed(
        functools.partial(workers.build_trainer_with_fsdp, **fp16), 2, args=(str(tmp_path),),
        timeout=RUN_S, return_exceptions=True,
    )  # fmt: skip
    assert_same_error_everywhere(errors, ConfigError, "the Trainer's FSDP2 and fp16=True")
    assert "use bf16=True" in str(errors[0])


def test_a_model_the_script_sharded_is_refused_on_every_rank_naming_the_way_out(tmp_path):
    from .test_objects import assert_same_error_everywhere

    errors = run_distributed(
        workers.build_trainer_with_sharded_model, 2, args=(str(tmp_path),), timeout=RUN_S,
        return_exceptions=True,
    )  # fmt: skip
    assert_same_error_everywhere(
        errors, ConfigError, "sharded with fully_shard (FSDPGPT2LMHeadModel)"
    )
    assert "ddpgraph.TrainStep" in str(errors[0])


def test_a_packed_batch_not_padded_to_the_fixed_capacity_is_refused_with_the_reason():
    """GraphTrainer's training loader pads packed batches to a fixed capacity (max lengths =
    max_length); one that reaches the step otherwise (a collator swapped in later) would change
    the graph's constants, so it is refused, naming the values."""
    from types import SimpleNamespace

    from ddpgraph.integrations.transformers import GraphTrainer

    trainer = SimpleNamespace(_packed_max_length=24)
    with pytest.raises(ConfigError, match=r"packed batch with \{'max_length_q': 5\}.*24"):
        GraphTrainer._check_fixed(trainer, {"max_length_q": 5})  # type: ignore[arg-type]
    GraphTrainer._check_fixed(trainer, {"max_length_q": 24, "max_length_k": 24})


def test_collators_padding_to_the_longest_row_pad_to_length_buckets():
    import transformers

    from ddpgraph.integrations.transformers import _bucketed

    longest = transformers.DataCollatorWithPadding(tokenizer=None)
    bucketed = _bucketed(longest, 16)
    assert bucketed.pad_to_multiple_of == 16 and longest.pad_to_multiple_of is None  # a copy
    chosen = transformers.DataCollatorWithPadding(tokenizer=None, pad_to_multiple_of=8)
    assert _bucketed(chosen, 16) is chosen  # the script's own choice stays
    assert _bucketed(transformers.default_data_collator, 16) is transformers.default_data_collator
    assert _bucketed(longest, None) is longest


def test_import_ddpgraph_loads_no_framework():
    code = (
        "import sys, ddpgraph, ddpgraph.integrations; print(sorted(m for m in ('transformers', "
        "'accelerate', 'lightning', 'pytorch_lightning') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
