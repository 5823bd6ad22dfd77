"""Classic recipes as written (issue 44): a script's evaluation through the model it keeps
(``step.model``) and its own accumulation, equal to the framework's own run bit for bit on 2 gloo
ranks, eagerly and with CpuGraphs capturing and replaying, or refused on every rank.
Workers: tests/recipe_workers.py."""

from __future__ import annotations

import pytest
import torch

from ddpgraph.testing import run_distributed

from . import recipe_workers as workers

pytestmark = pytest.mark.timeout(600)
RUN_S = 500  # a launch of 2 ranks on a loaded 2-core machine


def _assert_equal(ours: dict, theirs: dict, what: tuple[str, ...], label: str) -> None:
    assert "error" not in theirs, theirs
    assert "error" not in ours, (label, ours)
    for key in what:
        a, b = ours[key], theirs[key]
        if isinstance(a, list) and a and isinstance(a[0], torch.Tensor):
            assert len(a) == len(b), (label, key)
            for i, (x, y) in enumerate(zip(a, b)):
                assert torch.equal(x, y), (label, key, i)
        else:
            assert a == b, (label, key)


def _assert_ports_equal(results: list[dict], what: tuple[str, ...]) -> None:
    """On every rank, the port eagerly and graphed (replaying) equal to the framework's run."""
    for rank, rows in enumerate(results):
        for variant in ("eager", "graphs"):
            _assert_equal(rows[variant], rows["framework"], what, f"rank {rank} {variant}")
        assert "replays=0 " not in rows["graphs"]["report"], rows["graphs"]["report"]


@pytest.mark.parametrize("how", ["inference_mode", "no_grad"])
def test_eval_through_step_model_uses_rank_0s_buffers_as_ddps_eval_forward(how):
    results = run_distributed(workers.eval_rows, 2, args=(how,), timeout=RUN_S)
    _assert_ports_equal(results, ("losses", "outputs", "params"))
    # the check can fail: on rank 1, its own statistics give other outputs than rank 0's
    theirs = results[1]["framework"]
    assert not torch.equal(theirs["own_outputs"][0], theirs["outputs"][0])


def test_eval_through_fsdp2s_root_is_fsdp2s_own_eval_forward():
    """FSDP2 broadcasts no buffers: each rank evaluates with its own, in the port as in FSDP2."""
    results = run_distributed(workers.eval_rows, 2, args=("inference_mode", True), timeout=RUN_S)
    _assert_ports_equal(results, ("losses", "outputs", "params"))


def test_lightning_validation_is_lightnings_own_ddp_validation():
    pytest.importorskip("lightning")
    results = run_distributed(workers.lightning_rows, 2, timeout=RUN_S)
    _assert_ports_equal(results, ("outputs", "params"))


@pytest.mark.parametrize("k", [2, 3])
def test_a_scripts_own_accumulation_on_a_plain_accelerator_trains_as_the_script(k):
    """run_glue_no_trainer.py's loop: the port passes accumulate_calls=k and last= the script's
    condition; losses, LRs, every update's parameters, evaluation through step.model, the end
    state: bit for bit, on both ranks."""
    pytest.importorskip("accelerate")
    results = run_distributed(workers.glue_rows, 2, args=(k,), timeout=RUN_S)
    _assert_ports_equal(results, ("losses", "lrs", "outputs", "updates", "params", "optimizer"))
    assert len(results[0]["framework"]["lrs"]) == 3 * (1 + 12 // k)  # the script's updates


@pytest.mark.parametrize(
    ("case", "says"),
    [
        ("no_block", "called outside any `with accelerator.accumulate(model):` block, at"),
        ("optimizer_step", "the script calls optimizer.step() itself, at"),
    ],
)
def test_what_the_step_cannot_follow_is_refused_on_every_rank_naming_the_line(case, says):
    pytest.importorskip("accelerate")
    from ddpgraph.errors import ConfigError

    from .test_objects import assert_same_error_everywhere

    results = run_distributed(
        workers.refused_script_accumulation, 2, args=(case,), timeout=RUN_S,
        return_exceptions=True,
    )  # fmt: skip
    line = "step(x, y)  # no accumulate() block" if case == "no_block" else "optimizer.step()  #"
    extra = (
        ["says nowhere where its accumulation window ends", "last=<"] if case == "no_block" else []
    )
    assert_same_error_everywhere(results, ConfigError, says, "recipe_workers.py:", line, *extra)


def test_a_fabric_ports_own_optimizer_step_is_refused_on_every_rank_naming_the_line():
    pytest.importorskip("lightning")
    from ddpgraph.errors import ConfigError

    from .test_objects import assert_same_error_everywhere

    results = run_distributed(workers.fabric_script_steps, 2, timeout=RUN_S, return_exceptions=True)
    assert_same_error_everywhere(
        results, ConfigError, "the script calls optimizer.step() itself, at",
        "from_fabric", "recipe_workers.py:", "optimizer.step()  #",
    )  # fmt: skip


def test_accumulate_calls_with_accelerates_own_accumulation_is_refused():
    accelerate = pytest.importorskip("accelerate")
    from ddpgraph.errors import ConfigError
    from ddpgraph.integrations.accelerate import from_accelerator

    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match=r"accumulate_calls=2\) with Accelerator\(grad"):
        from_accelerator(accelerator, model, optimizer, accumulate_calls=2)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_fabric_evaluation_through_step_model_is_fabrics_own(precision):
    """bf16-mixed: the script's forwards through step.model run inside Fabric's precision plugin
    (autocast, float32 outputs) as through the model fabric.setup returned (issue 52 item 4)."""
    pytest.importorskip("lightning")
    results = run_distributed(workers.fabric_eval_rows, 2, args=(precision,), timeout=RUN_S)
    _assert_ports_equal(results, ("losses", "outputs", "params"))
    if precision != "32-true":
        assert all(o.dtype == torch.float32 for o in results[0]["graphs"]["outputs"])


def test_evaluation_through_step_model_keeps_accelerates_bf16_autocast():
    """run_glue_no_trainer.py's loop under mixed_precision="bf16" (issue 52 item 4): its
    evaluation through the prepared model ran under Accelerate's autocast with float32 outputs;
    through step.model it does too: outputs, losses and the end state bit for bit."""
    pytest.importorskip("accelerate")
    results = run_distributed(workers.glue_rows, 2, args=(2, "bf16"), timeout=RUN_S)
    _assert_ports_equal(results, ("losses", "lrs", "outputs", "updates", "params", "optimizer"))


def test_hand_accumulation_the_port_did_not_say_is_refused_in_the_first_window():
    """The Accelerate guide's first diff applied to run_glue_no_trainer.py at k = 2 (issue 52
    item 2): its scheduler steps after call 1 and not after call 2, so call 3 (the end of its
    first two-call window) is refused on every rank, naming accumulate_calls and last=."""
    pytest.importorskip("accelerate")
    from ddpgraph.errors import ConfigError

    from .test_objects import assert_same_error_everywhere

    results = run_distributed(
        workers.unsaid_accumulation, 2, args=("glue13",), timeout=RUN_S, return_exceptions=True
    )
    assert_same_error_everywhere(
        results, ConfigError, "(after call 1, not after call 2)", "accumulate_calls=k",
        "last=<that condition>", "recipe_workers.py:", "train_step(x, y)  # the port's line",
    )  # fmt: skip


@pytest.mark.parametrize("case", ["per_step", "per_epoch"])
def test_a_scheduler_stepped_every_call_or_every_epoch_is_not_hand_accumulation(case):
    pytest.importorskip("accelerate")
    results = run_distributed(workers.unsaid_accumulation, 2, args=(case,), timeout=RUN_S)
    assert all(r["calls"] == 15 for r in results), results
