from __future__ import annotations

import json
import random

import pytest
import torch

import ddpgraph
from ddpgraph import CheckpointError, ConfigError, latest_checkpoint
from ddpgraph.testing import WorkerError, run_distributed

from . import checkpoint_workers as workers
from .checkpoint_workers import Job, same

pytestmark = pytest.mark.timeout(120)


# ---- one process, no process group ----


def test_a_resumed_job_continues_bitwise_like_one_that_never_stopped(tmp_path):
    reference = workers.save_at_then_finish(str(tmp_path), at=4, total=9)
    resumed = workers.load_then_finish(str(tmp_path), total=9)
    assert same(resumed["tensors"], reference["tensors"])  # params, BN buffers, Adam state
    assert torch.equal(resumed["random"], reference["random"])  # RNG states restored
    assert resumed["lr"] == reference["lr"] and resumed["steps"] == reference["steps"] == 9
    assert resumed["position"] == reference["position"] == {"epoch": 1, "batches": 4}
    assert resumed["loaded"]["step"] == 4 and resumed["loaded"]["note"] == "hello"
    assert resumed["loaded"]["path"] == reference["saved"] == str(tmp_path / "step-00000004")


def test_loading_without_the_checkpoint_would_not_match(tmp_path):
    # the equality above is not a property of the job: a job that starts over ends elsewhere
    reference = workers.save_at_then_finish(str(tmp_path), at=4, total=9)
    job = Job(seed=7)
    job.train(2)
    job.train(5)
    assert not same(job.snapshot()["tensors"], reference["tensors"])


def test_loading_keeps_every_tensor_a_graph_would_read(tmp_path):
    """Parameters, buffers, optimizer state and a device-style LR tensor keep their storage."""
    job = Job()
    job.optimizer.param_groups[0]["lr"] = torch.tensor(0.01)  # as TrainStep puts it on CUDA
    job.train(3)
    job.save(tmp_path, 3)
    expected = [t.clone() for t in job.tensors()]
    job.train(2)
    tensors = job.tensors()
    pointers = [t.data_ptr() for t in tensors]
    job.load(tmp_path)
    assert [t.data_ptr() for t in job.tensors()] == pointers
    # the optimizer holds the very same tensor objects (state_dict() makes new views of params)
    n = len(job.model.state_dict())
    assert all(a is b for a, b in zip(job.tensors()[n:], tensors[n:]))
    assert isinstance(job.optimizer.param_groups[0]["lr"], torch.Tensor)
    assert same(job.tensors(), expected)


def test_a_fresh_optimizer_gets_its_state_without_losing_its_lr_tensor(tmp_path):
    job = Job()
    job.optimizer.param_groups[0]["lr"] = torch.tensor(0.01)
    job.train(3)
    job.save(tmp_path, 3)
    expected = [t.clone() for t in job.tensors()]
    fresh = Job()  # has never stepped: no optimizer state yet
    lr = fresh.optimizer.param_groups[0]["lr"] = torch.tensor(0.02)
    params = [p.detach().clone() for p in fresh.model.parameters()]
    assert not fresh.optimizer.state
    ddpgraph.save_checkpoint(
        tmp_path / "fresh", step=0, model=fresh.model, optimizer=fresh.optimizer
    )
    assert same([p.detach() for p in fresh.model.parameters()], params)  # zero LR, zero grads
    assert fresh.optimizer.param_groups[0]["lr"] is lr and torch.equal(lr, torch.tensor(0.02))
    assert all(p.grad is None for p in fresh.model.parameters())
    fresh.load(tmp_path)
    assert fresh.optimizer.param_groups[0]["lr"] is lr
    assert same(fresh.tensors(), expected)


def test_rng_states_and_python_random_are_restored(tmp_path):
    job = Job()
    job.train(1)
    job.save(tmp_path, 1)
    expected = (torch.rand(2), random.random())
    torch.rand(5)
    random.random()
    job.load(tmp_path)
    assert torch.equal(torch.rand(2), expected[0]) and random.random() == expected[1]


def test_model_only_and_optimizer_without_train_step(tmp_path):
    job = Job()
    job.train(2)
    ddpgraph.save_checkpoint(tmp_path, step=2, model=job.model, optimizer=job.optimizer)
    expected = [t.clone() for t in job.tensors()]
    job.train(2)
    state = ddpgraph.load_checkpoint(tmp_path, model=job.model, optimizer=job.optimizer)
    assert state["step"] == 2 and same(job.tensors(), expected)
    job.train(1)
    ddpgraph.load_checkpoint(tmp_path, model=job.model)  # the model alone, optimizer left as is
    n = len(job.model.state_dict())
    assert same(job.tensors()[:n], expected[:n]) and not same(job.tensors(), expected)


def test_keep_last_prunes_and_latest_names_the_newest(tmp_path):
    job = Job()
    for step in (1, 2, 3, 4):
        job.train(1)
        job.save(tmp_path, step, keep_last=2)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["latest", "step-00000003", "step-00000004"]
    assert (tmp_path / "latest").read_text().strip() == "step-00000004"
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000004"
    manifest = json.loads((tmp_path / "step-00000004" / "ddpgraph.json").read_text())
    assert manifest["step"] == 4 and manifest["world_size"] == 1


def test_a_partial_or_damaged_directory_is_never_loaded(tmp_path):
    job = Job()
    job.train(1)
    job.save(tmp_path, 1)
    # what a crash leaves: a partial save, and a step directory without its metadata
    (tmp_path / ".step-00000009.partial-abc").mkdir()
    (tmp_path / "step-00000008").mkdir()
    (tmp_path / "step-00000008" / ".metadata").write_text("")
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000001"
    assert job.load(tmp_path)["step"] == 1
    job.save(tmp_path, 2)  # the next commit clears what crashed saves left behind
    assert not (tmp_path / ".step-00000009.partial-abc").exists()


def _truncate_a_shard(path):
    shard = sorted(path.glob("*.distcp"))[-1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    return f"{shard} is truncated ("


def _drop_metadata(path):
    (path / ".metadata").unlink()
    return f"{path / '.metadata'} (DCP's index of the saved values) is missing"


def _garble_manifest(path):
    (path / "ddpgraph.json").write_text('{"step": 4, "world_')
    return f"{path / 'ddpgraph.json'} is not readable JSON ("


@pytest.mark.parametrize("damage", [_truncate_a_shard, _drop_metadata, _garble_manifest])
def test_a_damaged_newest_checkpoint_is_skipped_by_name_for_the_older_one(tmp_path, damage, caplog):
    reference = workers.save_at_then_finish(str(tmp_path), at=4, total=9)
    job = Job()
    job.train(6)
    job.save(tmp_path, 6)
    reason = damage(tmp_path / "step-00000006")
    resumed = Job(seed=7)
    with caplog.at_level("WARNING", logger="ddpgraph"):
        state = resumed.load(tmp_path)
    assert state["step"] == 4 and state["path"] == tmp_path / "step-00000004"
    assert f"skipped checkpoint {tmp_path / 'step-00000006'}: {reason}" in caplog.text
    assert "trying the next older one" in caplog.text
    resumed.train(5)
    assert same(resumed.snapshot()["tensors"], reference["tensors"])  # as if never damaged


def test_when_no_checkpoint_loads_each_is_named_with_its_reason(tmp_path):
    job = Job()
    job.train(1)
    job.save(tmp_path, 1)
    job.save(tmp_path, 2)
    shard = _truncate_a_shard(tmp_path / "step-00000002")
    _garble_manifest(tmp_path / "step-00000001")
    with pytest.raises(CheckpointError) as info:
        Job().load(tmp_path)
    text = str(info.value)
    assert text.startswith(f"no checkpoint in {tmp_path} loads: step-00000002: {shard}")
    assert "; step-00000001: " in text and "ddpgraph.json is not readable JSON" in text
    assert text.endswith("Restore the damaged files from a copy, or start without resuming.")


def test_data_that_fails_to_load_is_skipped_too(tmp_path):
    """Damage the size check cannot see (bytes overwritten in place) fails in DCP's read: the
    CheckpointException it raises is a BaseException, caught all the same."""
    job = Job()
    job.train(2)
    job.save(tmp_path, 2)
    job.save(tmp_path, 3)
    shard = sorted((tmp_path / "step-00000003").glob("*.distcp"))[0]
    shard.write_bytes(b"\0" * shard.stat().st_size)
    assert Job().load(tmp_path)["step"] == 2


def test_saving_onto_a_file_or_where_nothing_can_be_written_is_a_checkpoint_error(tmp_path):
    job = Job()
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(CheckpointError) as info:
        job.save(blocker, 1)
    assert str(info.value) == (
        f"save_checkpoint: {blocker} is a file, not a directory; pass a directory (each "
        f"checkpoint goes in DIRECTORY/step-00000001), e.g. {tmp_path / 'checkpoints'}."
    )
    # under a file: DCP's own CheckpointException is a BaseException; it arrives as an Exception
    with pytest.raises(CheckpointError, match=r"save_checkpoint could not write .*step-00000001"):
        job.save(blocker / "sub", 1)


@pytest.mark.parametrize("where", ["write", "commit"])
def test_a_full_disk_is_one_clear_error_the_partial_removed_the_older_checkpoint_kept(
    tmp_path, where
):
    error = workers.save_into_a_full_disk(str(tmp_path), victim=0, where=where)
    _assert_full_disk_handled(tmp_path, error, where)


def _assert_full_disk_handled(tmp_path, error, where):
    from ddpgraph.checkpoint import CheckpointWriteError

    assert isinstance(error, CheckpointWriteError), error
    text = str(error)
    if where == "write":
        assert "could not write the checkpoint of step 4 in" in text
        assert "no space left on the device" in text and "older checkpoints are kept" in text
    else:
        assert "could not commit the checkpoint of step 4" in text
        assert "No space left on device" in text and "older checkpoints are kept" in text
    assert "MiB free" in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000002"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000002"
    assert (tmp_path / "latest").read_text() == "step-00000002\n"


def test_reshard_at_the_same_world_size_restores_the_rng_and_data_position_too(tmp_path):
    # the FSDP2 guide's promise: only another world size leaves them as they are
    job = Job()
    job.train(2)
    job.save(tmp_path, 2)
    expected = (torch.rand(3), job.batches.state_dict())
    job.train(3)
    ddpgraph.load_checkpoint(tmp_path, train_step=job.step, loader=job.batches, reshard=True)
    assert torch.equal(torch.rand(3), expected[0])
    assert job.batches.state_dict() == expected[1]


def test_saving_a_step_again_replaces_it(tmp_path):
    job = Job()
    job.train(1)
    job.save(tmp_path, 1)
    job.train(1)
    job.save(tmp_path, 1)  # e.g. a resumed run passing the same step again
    expected = [t.clone() for t in job.tensors()]
    job.train(1)
    job.load(tmp_path)
    assert same(job.tensors(), expected)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000001"]


def test_async_save_returns_a_future_of_the_committed_directory(tmp_path):
    job = Job()
    job.train(2)
    expected = [t.clone() for t in job.tensors()]
    future = job.save_async(tmp_path, 2)
    job.train(2)  # training goes on while the copy is written
    assert future.result(timeout=60) == tmp_path / "step-00000002"
    job.load(tmp_path)
    assert same(job.tensors(), expected)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP, single process
def test_save_checkpoint_with_async_save_still_saves_in_the_background_but_warns(tmp_path):
    job = Job()
    job.train(1)
    with pytest.warns(DeprecationWarning, match=r"call ddpgraph.save_checkpoint_async\(\.\.\.\)"):
        future = job.save(tmp_path, 1, async_save=True)
    assert future.result(timeout=60) == tmp_path / "step-00000001"


def test_what_a_checkpoint_takes_fits_the_stateful_protocol_of_dcp():
    from torch.distributed.checkpoint.stateful import Stateful as DcpStateful

    job = Job()
    for part in (job.batches, job.scheduler):
        assert isinstance(part, DcpStateful)  # DCP's protocol is runtime-checkable; ours mirrors it
        assert callable(part.state_dict) and callable(part.load_state_dict)


def test_another_model_is_refused_naming_the_mismatch(tmp_path):
    job = Job()
    job.train(1)
    job.save(tmp_path, 1)
    error = workers.load_expecting_error(str(tmp_path), width=32)
    assert isinstance(error, CheckpointError)
    text = str(error)
    assert (
        "does not fit this model: shapes differ: model.0.bias (checkpoint (16,), here (32,))"
        in text
    )
    assert "model.0.weight (checkpoint (16, 8), here (32, 8))" in text
    assert "Build the model" in text

    other = torch.nn.Linear(8, 4)
    with pytest.raises(CheckpointError) as info:
        ddpgraph.load_checkpoint(tmp_path, model=other)
    assert "keys missing from the checkpoint: model.bias, model.weight; keys in the checkpoint" in (
        str(info.value)
    )
    assert "model.0.bias, model.0.weight, model.1.bias, model.1.num_batches_tracked and 5 more" in (
        str(info.value)
    )


def test_no_checkpoint_is_a_clear_error(tmp_path):
    job = Job()
    with pytest.raises(CheckpointError, match=r"no checkpoint in .*start without resuming"):
        job.load(tmp_path / "empty")


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"step": -1}, "step=-1 must be an integer >= 0"),
        ({"step": 1.5}, "step=1.5 must be an integer"),
        ({"step": 1, "keep_last": 0}, "keep_last=0 must be an integer >= 1"),
        ({"step": 1, "async_save": "yes"}, "async_save='yes' must be True or False"),
        ({"step": 1, "loss": torch.ones(1)}, "extra value loss=Tensor is not JSON"),
        ({"step": 1, "path": "x"}, "extra key 'path' is reserved"),
    ],
)
def test_bad_save_options_are_refused(tmp_path, kwargs, fragment):
    job = Job()
    with pytest.raises(ConfigError, match=None) as info:
        ddpgraph.save_checkpoint(tmp_path, train_step=job.step, **kwargs)
    assert fragment in str(info.value)
    assert not list(tmp_path.iterdir())  # refused before anything was written


def test_what_to_save_must_be_unambiguous(tmp_path):
    job = Job()
    with pytest.raises(ConfigError, match="pass train_step= or model=/optimizer=, not both"):
        ddpgraph.save_checkpoint(tmp_path, step=0, train_step=job.step, model=job.model)
    with pytest.raises(ConfigError, match="nothing to checkpoint"):
        ddpgraph.save_checkpoint(tmp_path, step=0)
    with pytest.raises(ConfigError, match="loader=list has no state_dict"):
        ddpgraph.save_checkpoint(tmp_path, step=0, model=job.model, loader=[1, 2])


# ---- two gloo ranks ----


@pytest.mark.parametrize("async_save", [False, True])
def test_two_ranks_resume_exactly_each_with_its_own_rng(tmp_path, async_save):
    directory = str(tmp_path)
    reference = run_distributed(
        workers.save_at_then_finish, 2, args=(directory, 4, 9, async_save), timeout=90
    )
    resumed = run_distributed(workers.load_then_finish, 2, args=(directory, 9), timeout=90)
    for rank in (0, 1):
        assert same(resumed[rank]["tensors"], reference[rank]["tensors"]), rank
        assert torch.equal(resumed[rank]["random"], reference[rank]["random"]), rank
        assert resumed[rank]["pointers_kept"] and resumed[rank]["loaded"]["step"] == 4
    assert not torch.equal(reference[0]["random"], reference[1]["random"])  # per-rank RNG
    assert same(reference[0]["tensors"][:4], reference[1]["tensors"][:4])  # DDP replicas agree


def test_every_rank_skips_a_checkpoint_that_one_rank_finds_damaged(tmp_path):
    directory = str(tmp_path)
    reference = run_distributed(workers.save_at_then_finish, 2, args=(directory, 4, 9), timeout=90)
    run_distributed(workers.save_at_then_finish, 2, args=(directory, 6, 9), timeout=90)
    resumed = run_distributed(
        workers.load_with_one_rank_seeing_damage, 2, args=(directory, 9, 1), timeout=90
    )
    for rank in (0, 1):
        assert resumed[rank]["loaded"]["step"] == 4, rank
        assert same(resumed[rank]["tensors"], reference[rank]["tensors"]), rank


def test_another_world_size_is_refused(tmp_path):
    run_distributed(workers.save_at_then_finish, 2, args=(str(tmp_path), 2, 3), timeout=90)
    error = workers.load_expecting_error(str(tmp_path))
    assert isinstance(error, CheckpointError)
    assert "was saved by 2 rank(s), this job has 1; resume with 2 ranks" in str(error)


def test_every_rank_refuses_another_model(tmp_path):
    run_distributed(workers.save_at_then_finish, 2, args=(str(tmp_path), 2, 3), timeout=90)
    for only_rank, ranks in ((None, "[0, 1]"), (1, "[1]")):  # a model differing on one rank too
        errors = run_distributed(
            workers.load_expecting_error, 2, args=(str(tmp_path), 32, only_rank), timeout=90
        )
        assert all(isinstance(e, CheckpointError) for e in errors), errors
        assert len({str(e) for e in errors}) == 1
        assert str(errors[0]).startswith(f"on rank(s) {ranks}: ")
        assert "model.0.weight (checkpoint (16, 8), here (32, 8))" in str(errors[0])


@pytest.mark.parametrize(("victim", "where"), [(1, "write"), (0, "commit")])
def test_a_rank_killed_during_a_save_leaves_the_previous_checkpoint_loadable(
    tmp_path, victim, where
):
    directory = str(tmp_path)
    with pytest.raises(WorkerError):
        run_distributed(
            workers.die_during_second_save, 2, args=(directory, victim, where), timeout=90
        )
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000002"
    assert not (tmp_path / "step-00000004").exists()
    assert list(tmp_path.glob(".step-00000004.partial-*"))  # the interrupted save, never loaded
    # one step after loading: rank 1's BatchNorm stats are its own again only after a forward
    resumed = run_distributed(workers.load_then_finish, 2, args=(directory, 3), timeout=90)
    expected = run_distributed(workers.train_only, 2, args=(3,), timeout=90)
    for rank in (0, 1):
        assert resumed[rank]["loaded"]["step"] == 2
        assert same(resumed[rank]["tensors"], expected[rank]), rank


@pytest.mark.parametrize(("victim", "where"), [(1, "write"), (0, "commit")])
def test_a_full_disk_on_one_rank_is_the_same_error_on_every_rank(tmp_path, victim, where):
    errors = run_distributed(
        workers.save_into_a_full_disk, 2, args=(str(tmp_path), victim, where), timeout=100
    )
    assert len({str(e) for e in errors}) == 1, errors
    for error in errors:
        _assert_full_disk_handled(tmp_path, error, where)


def test_every_rank_refuses_ranks_saving_different_steps(tmp_path):
    errors = run_distributed(workers.save_a_rank_dependent_step, 2, args=(str(tmp_path),))
    assert all(isinstance(e, CheckpointError) for e in errors), errors
    assert len({str(e) for e in errors}) == 1
    assert "ranks passed different steps {0: 0, 1: 1}; every rank must save the same" in str(
        errors[0]
    )
    assert not list(tmp_path.iterdir())


@pytest.mark.timeout(120)
def test_shutdown_waits_for_an_async_save_to_commit(tmp_path):
    names = run_distributed(
        workers.async_save_then_shutdown, world_size=2, args=(str(tmp_path / "ckpt"),), timeout=100
    )
    assert names == ["step-00000001", "step-00000001"]
