"""FSDP2 (fully_shard) under TrainStep on CPU ranks (gloo): bit for bit equal to the plain FSDP2
loop, the graphed policy path through the CPU stand-in engine, checkpoints, refusals."""

from __future__ import annotations

import pytest
import torch

from ddpgraph.errors import CaptureError, ConfigError
from ddpgraph.step.options import StepOptions
from ddpgraph.testing import run_distributed

from . import fsdp2_workers as w
from .test_objects import assert_same_error_everywhere

pytest.importorskip("torch.distributed.fsdp")
pytestmark = pytest.mark.timeout(240)


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y), (x - y).abs().max()


@pytest.mark.parametrize(
    ("calls", "split", "clip"),
    [(1, 1, 1.0), (2, 1, 0.5), (1, 2, None)],
    ids=["clip", "accumulate_calls", "accumulate"],
)
def test_train_step_on_a_user_sharded_model_is_bitwise_the_plain_fsdp2_loop(calls, split, clip):
    steps = 6
    plain = run_distributed(w.plain_loop, 2, args=(steps, calls, split, clip), timeout=200)
    graphed = run_distributed(w.train_step_run, 2, args=(steps, calls, split, clip), timeout=200)
    for rank in range(2):
        assert graphed[rank]["wrapper"] == "FSDP2"
        assert graphed[rank]["model_is_root"]  # used as it is: never wrapped in DDP
        assert graphed[rank]["phase"] == "graphed", graphed[rank]["fallbacks"]
        assert graphed[rank]["replays"] > 0
        assert graphed[rank]["losses"] == plain[rank]["losses"]
        _same(graphed[rank]["params"], plain[rank]["params"])


def test_sync_every_call_on_fsdp2_is_bitwise_the_loop_that_never_turns_the_sync_off():
    """A script that accumulates by hand on FSDP2 without set_requires_gradient_sync(False)
    reduce-scatters every micro-batch's gradients; sync_every_call=True does the same."""
    steps, calls = 6, 2
    plain = run_distributed(w.plain_loop, 2, args=(steps, calls, 1, None, True), timeout=200)
    kwargs = (steps, calls, 1, None, True, True, None, 3, True)
    graphed = run_distributed(w.train_step_run, 2, args=kwargs, timeout=200)
    for rank in range(2):
        assert graphed[rank]["phase"] == "graphed", graphed[rank]["fallbacks"]
        assert graphed[rank]["replays"] > 0
        assert graphed[rank]["losses"] == plain[rank]["losses"]
        _same(graphed[rank]["params"], plain[rank]["params"])


def test_parallel_fsdp2_shards_each_block_then_the_root_and_trains_as_the_plain_loop():
    plain = run_distributed(w.plain_loop, 2, args=(5,), timeout=200)
    mine = run_distributed(w.train_step_run, 2, args=(5, 1, 1, None, True, False), timeout=200)
    for rank in range(2):
        assert mine[rank]["sharded"] == ["", "blocks.0", "blocks.1"]
        assert mine[rank]["losses"] == plain[rank]["losses"]
        _same(mine[rank]["params"], plain[rank]["params"])


def test_a_capture_failing_on_one_rank_sends_every_rank_eager_with_the_same_numbers():
    plain = run_distributed(w.plain_loop, 2, args=(6,), timeout=200)
    failed = run_distributed(w.train_step_run, 2, args=(6, 1, 1, None, True, True, 1), timeout=200)
    for rank in range(2):
        assert failed[rank]["phase"] == "eager"
        (fallback,) = failed[rank]["fallbacks"]  # rank 1's own cause, on every rank
        assert fallback.startswith("rank 1 could not capture its step: capture failed: ")
        assert failed[rank]["losses"] == plain[rank]["losses"]
        _same(failed[rank]["params"], plain[rank]["params"])


def test_grad_norm_over_dtensor_gradients_is_a_plain_tensor_and_eval_matches_the_forward():
    results = run_distributed(w.grad_norm_and_eval, 2, timeout=200)
    for r in results:
        assert r["norm_is_plain"]
        assert torch.equal(r["norm"], r["reference"])
        assert r["eval_replays"] == 2
        for out in r["evaluated"]:
            assert torch.equal(out, r["expected"])


@pytest.mark.parametrize(
    ("case", "kind", "fragment"),
    [
        ("sgd", CaptureError, "SGD on FSDP2's DTensor shards"),
        ("fp16", CaptureError, "amp='fp16' with FSDP2"),
        ("accumulate_calls_3", CaptureError, "use accumulate=k"),
        ("offload", CaptureError, "CPUOffloadPolicy"),
        ("ddp_on_sharded", ConfigError, "got a model sharded with fully_shard"),
        ("root_not_sharded", ConfigError, "call fully_shard(model) last"),
        ("fsdp1", ConfigError, "FSDP1's FullyShardedDataParallel"),
        ("ddp_inside_sharded", ConfigError, "also holds a DistributedDataParallel"),
    ],
)
def test_what_fsdp2_cannot_do_is_refused_on_every_rank(case, kind, fragment):
    results = run_distributed(w.refuse, 2, args=(case,), timeout=200, return_exceptions=True)
    assert_same_error_everywhere(results, kind, fragment)


def test_compile_with_parallel_fsdp2_is_refused_at_construction():
    with pytest.raises(ConfigError, match="compile each block before fully_shard"):
        StepOptions(compile=True, parallel="fsdp2")
    with pytest.raises(ConfigError, match="parallel='dp'"):
        StepOptions(parallel="dp")  # type: ignore[arg-type]


def test_resume_from_a_sharded_checkpoint_is_exact(tmp_path):
    path = str(tmp_path / "ckpt")
    whole = run_distributed(w.checkpoint_run, 2, args=(path + "-unused", 7, 0, True, 3))
    run_distributed(w.checkpoint_run, 2, args=(path, 4, 0, True, 3), timeout=200)
    resumed = run_distributed(w.checkpoint_run, 2, args=(path, 4, 3, False, 3), timeout=200)
    for rank in range(2):
        assert resumed[rank]["steps"] == 7
        _same(resumed[rank]["params"], whole[rank]["params"])


def test_a_checkpoint_of_two_ranks_loads_onto_three(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = run_distributed(w.checkpoint_run, 2, args=(path, 4, 0, True, 3), timeout=200)
    loaded = run_distributed(w.load_params, 3, args=(path,), timeout=200)
    for r in loaded:
        _same(r["loaded"], saved[0]["params"])  # the whole parameters, resharded over 3
        assert r["steps"] == 5  # four saved, one more after loading
        assert r["exp_avg"].abs().sum() > 0
    # loaded then stepped once: the whole parameters are equal on the three ranks
    for r in loaded[1:]:
        _same(r["params"], loaded[0]["params"])


def test_an_unshard_left_pending_by_the_script_is_undone_before_each_step_and_capture():
    """Was refused ("FSDP2 is not idle"); an unshard before a step is the script's prefetch."""
    results = run_distributed(w.capture_while_unsharding, 2, timeout=200)
    for result in results:
        assert result["mode"] == "graphed" and result["replays"] > 0
        _same(result["ours"], result["theirs"])


@pytest.mark.parametrize("calls", [1, 2])
def test_explicit_prefetch_and_the_scripts_sync_flag_replay_every_call_after_the_warmup(calls):
    """The GPU test's count on the CPU stand-in: with unshard() before each call and the script's
    own sync flag, the warm-up's 3 * calls calls are the only eager ones, and the numbers are the
    plain FSDP2 loop's."""
    steps = 7
    plain = run_distributed(w.plain_loop, 2, args=(steps, calls, 1, 1.0), timeout=200)
    ours = run_distributed(w.prefetch_and_sync_flag, 2, args=(steps, calls), timeout=200)
    for rank in range(2):
        r = ours[rank]
        assert r["not_replayed"] == list(range(3 * calls)), r["report"]
        assert r["replays"] == (steps - 3) * calls, r["report"]
        assert r["losses"] == plain[rank]["losses"]
        _same(r["params"], plain[rank]["params"])


def test_expandable_segments_with_nccl_graph_registration_is_refused_with_the_fix(monkeypatch):
    from ddpgraph.distributed import runtime
    from ddpgraph.step import parallel

    monkeypatch.setattr(parallel, "_uses_nccl", lambda: True)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64,expandable_segments:True")
    monkeypatch.delenv("NCCL_GRAPH_REGISTER", raising=False)
    with pytest.raises(ConfigError, match="NCCL_GRAPH_REGISTER=0"):
        parallel.check_graph_registration(torch.device("cuda", 0))
    parallel.check_graph_registration(torch.device("cpu"))  # gloo on CPU: no NCCL, no graphs
    # ddpgraph.init() sets it before it creates an NCCL group, unless the user chose
    runtime._no_graph_registration_with_expandable_segments()
    assert runtime.os.environ["NCCL_GRAPH_REGISTER"] == "0"
    parallel.check_graph_registration(torch.device("cuda", 0))
    monkeypatch.setenv("NCCL_GRAPH_REGISTER", "1")
    runtime._no_graph_registration_with_expandable_segments()
    assert runtime.os.environ["NCCL_GRAPH_REGISTER"] == "1"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    parallel.check_graph_registration(torch.device("cuda", 0))


def test_bench_parallel_fsdp2_takes_its_configs_and_refuses_the_ddp_ones(monkeypatch, tmp_path):
    from click.testing import CliRunner

    from ddpgraph import cli
    from ddpgraph.bench import fsdp2

    seen = {}
    monkeypatch.setattr(fsdp2, "run_fsdp2", lambda names, **kw: seen.update(names=names, **kw))
    out = str(tmp_path / "b.json")
    args = ["bench", "--parallel", "fsdp2", "--config", "transformer"]
    result = CliRunner().invoke(cli.cli, [*args, "--config", "transformer-large", "--out", out])
    assert result.exit_code == 0, result.output
    assert seen["names"] == ["transformer", "transformer-large"]
    refused = CliRunner().invoke(cli.cli, ["bench", "--parallel", "fsdp2", "--config", "mlp"])
    assert refused.exit_code == 2 and "--parallel fsdp2 runs" in refused.output
    refused = CliRunner().invoke(cli.cli, ["bench", "--config", "transformer-large"])
    assert refused.exit_code == 2 and "add --parallel fsdp2" in refused.output
