"""prefetch on CUDA: the values, the stream ordering (no copy races a reader), no host syncs."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ddpgraph import TrainStep, pad_batch, prefetch
from ddpgraph.demo.models import build_model

pytestmark = pytest.mark.timeout(300)

DEVICE = torch.device("cuda", 0)
SLEEP_CYCLES = 20_000_000  # about 10 ms of one SM at ~2 GHz: long next to a 16 MB copy


def nested(i: int, *, pinned: bool):
    def t(*shape, dtype=torch.float32):
        tensor = torch.full(shape, float(i + 1), dtype=dtype)
        return tensor.pin_memory() if pinned else tensor

    return {
        "x": t(4, 3),
        "pair": (t(2), [t(3, dtype=torch.long), "leaf"]),
        "meta": {"step": i, "name": f"batch{i}"},
    }


def assert_equal_trees(got, expected):
    if isinstance(expected, torch.Tensor):
        assert got.device == DEVICE and got.dtype == expected.dtype
        assert torch.equal(got, expected.to(DEVICE))
    elif isinstance(expected, dict):
        assert type(got) is dict and list(got) == list(expected)
        for key in expected:
            assert_equal_trees(got[key], expected[key])
    elif isinstance(expected, (tuple, list)):
        assert type(got) is type(expected) and len(got) == len(expected)
        for a, b in zip(got, expected):
            assert_equal_trees(a, b)
    else:
        assert got == expected


@pytest.mark.parametrize("pinned", [True, False])
@pytest.mark.parametrize("depth", [1, 3])
def test_batches_arrive_equal_to_plain_copies_in_order(pinned, depth):
    batches = [nested(i, pinned=pinned) for i in range(6)]
    got = list(prefetch(batches, DEVICE, depth=depth))
    torch.cuda.synchronize()
    assert len(got) == len(batches)
    for g, b in zip(got, batches):
        assert_equal_trees(g, b)


def test_a_pinned_dataloader_with_workers_keeps_order_and_len():
    data = TensorDataset(torch.randn(100, 8), torch.arange(100))
    loader = DataLoader(data, batch_size=16, num_workers=2, pin_memory=True)
    wrapped = prefetch(loader, "cuda")
    assert len(wrapped) == len(loader) == 7
    got = [(x.cpu(), y.cpu()) for x, y in wrapped]
    for (x, y), (ex, ey) in zip(got, loader):
        assert torch.equal(x, ex) and torch.equal(y, ey)


N = 4 << 20  # 16 MB of float32 per batch


def big_batches(n: int, offset: int) -> list[torch.Tensor]:
    # every element of batch i is offset + i: a reader that sees another batch's memory (or
    # memory left by an earlier test, which used another offset) gets another sum
    return [torch.full((N,), float(offset + i)).pin_memory() for i in range(n)]


def expected_means(n: int, offset: int) -> list[float]:
    return [float(offset + i) for i in range(n)]


def means(sums: list[torch.Tensor]) -> list[float]:
    # rounded: a float32 sum of 4M equal values is not always exact; NaN (memory never written)
    # stays NaN and compares unequal
    return [round(float(s) / N, 3) for s in sums]


def read_slowly(pipe) -> list[torch.Tensor]:
    """Each batch read after a long kernel on the consumer stream, then dropped at once."""
    sums = []
    for batch in pipe:
        torch.cuda._sleep(SLEEP_CYCLES)
        sums.append(batch.sum())  # enqueued behind the sleep
        del batch
    return sums


def test_memory_of_a_batch_is_not_reused_while_a_slow_step_reads_it():
    sums = read_slowly(prefetch(big_batches(8, offset=1), DEVICE))
    torch.cuda.synchronize()
    assert means(sums) == expected_means(8, offset=1)


def test_without_record_stream_that_reader_sees_a_later_batch(monkeypatch):
    # The control for the test above: the race it guards against is real on this GPU.
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    sums = read_slowly(prefetch(big_batches(8, offset=20), DEVICE))
    torch.cuda.synchronize()
    assert means(sums) != expected_means(8, offset=20)


def slow_copy_stream_pipe(batches):
    """A prefetch whose copy stream starts with a long kernel, so every copy lands late."""
    wrapped = prefetch(batches, DEVICE)
    stream = torch.cuda.Stream(DEVICE)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SLEEP_CYCLES * 5)
    wrapped._copy_stream = stream
    return wrapped


def test_a_step_waits_for_its_batch_copy():
    sums = [batch.sum() for batch in slow_copy_stream_pipe(big_batches(4, offset=40))]
    torch.cuda.synchronize()  # the only wait in this test is the one prefetch makes
    assert means(sums) == expected_means(4, offset=40)


def test_without_the_event_wait_the_step_reads_before_the_copy(monkeypatch):
    monkeypatch.setattr(torch.cuda.Stream, "wait_event", lambda self, event: None)
    sums = [batch.sum() for batch in slow_copy_stream_pipe(big_batches(4, offset=60))]
    torch.cuda.synchronize()
    assert means(sums) != expected_means(4, offset=60)


@pytest.mark.parametrize("pin_memory", [True, False])
def test_iterating_makes_no_host_sync(pin_memory):
    data = TensorDataset(torch.randn(64, 8), torch.arange(64))
    loader = DataLoader(data, batch_size=8, pin_memory=pin_memory)
    wrapped = prefetch(loader, DEVICE, depth=2)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        outs = [x.sum() + y.sum() for x, y in wrapped]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(outs) == 8
    assert float(sum(outs)) == pytest.approx(float(data.tensors[0].sum() + data.tensors[1].sum()))


def losses_of(rt, feed: str, steps: int = 40) -> list[float]:
    torch.manual_seed(0)
    model = build_model("mlp").to(rt.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = TrainStep(model, optimizer, loss_fn=nn.CrossEntropyLoss())
    gen = torch.Generator().manual_seed(1)
    data = TensorDataset(
        torch.randn(steps * 32, 64, generator=gen), torch.randint(10, (steps * 32,))
    )
    loader = DataLoader(data, batch_size=32, pin_memory=True)
    losses = []
    if feed == "prefetch":
        for x, y in prefetch(loader, rt.device):
            losses.append(step(x, y).clone())
    else:
        for x, y in loader:
            losses.append(step(x.to(rt.device), y.to(rt.device)).clone())
    assert step.mode == "graphed"
    return [float(loss) for loss in losses]


def test_a_graphed_train_step_fed_by_prefetch_matches_plain_copies(rt):
    assert losses_of(rt, "prefetch") == losses_of(rt, "plain")


def test_padded_batches_prefetch_as_mappings():
    lengths = [5, 9, 13]
    rows = []
    for n in lengths:
        ids = torch.zeros(2, 13, dtype=torch.long)
        ids[:, :n] = 7
        mask = (ids != 0).long()
        rows.append(
            {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
        )
    padded = [pad_batch(b, multiple=16) for b in rows]
    for got, expected in zip(prefetch(padded, DEVICE), padded):
        assert got["input_ids"].shape == (2, 16)
        assert_equal_trees(got, expected)
