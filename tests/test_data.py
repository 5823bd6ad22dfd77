"""pad_batch (shape buckets, loss-neutral padding) and prefetch (its CPU path and its pipeline)."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from collections import OrderedDict, UserDict, namedtuple
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ddpgraph
from ddpgraph import ConfigError, pad_batch, prefetch
from ddpgraph.data.prefetch import _Lookahead, _map_tensors

Pair = namedtuple("Pair", ["x", "y"])


class Encoding(UserDict):
    """Like HF's BatchEncoding: a UserDict with an attribute beside its items."""

    def __init__(self, data=None, encodings=None):
        super().__init__(data)
        self.encodings = encodings


class KeywordOnlyMapping(Mapping):
    """A mapping type that cannot be rebuilt from a dict: pad_batch returns a dict instead."""

    def __init__(self, *, items):
        self._items = dict(items)

    def __getitem__(self, key):
        return self._items[key]

    def __iter__(self):
        return iter(self._items)

    def __len__(self):
        return len(self._items)


def lm_batch(lengths=(7, 11, 13), vocab=50, seed=0) -> dict[str, torch.Tensor]:
    """A causal-LM batch as a collate function makes it: right-padded to its longest row."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(1, vocab, (len(lengths), width), generator=gen)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    ids = ids * mask
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


# --------------------------------------------------------------------- pad_batch: what it does
def test_pads_a_mapping_to_the_next_multiple_with_minus_100_labels_and_zeros():
    batch = lm_batch()  # length 13
    out = pad_batch(batch, multiple=8)
    assert type(out) is dict and list(out) == list(batch)
    for key, tensor in out.items():
        assert tensor.shape == (3, 16), key
        assert torch.equal(tensor[:, :13], batch[key])
        assert tensor.dtype == batch[key].dtype
    assert (out["labels"][:, 13:] == -100).all()
    assert (out["input_ids"][:, 13:] == 0).all()
    assert (out["attention_mask"][:, 13:] == 0).all()


def test_values_set_pad_values_per_key_and_none_leaves_an_entry_unpadded():
    batch = {**lm_batch(), "position_bias": torch.ones(3, 13)}
    out = pad_batch(batch, multiple=16, values={"input_ids": 50256, "position_bias": None})
    assert (out["input_ids"][:, 13:] == 50256).all()
    assert (out["labels"][:, 13:] == -100).all()  # the default for labels still applies
    assert out["position_bias"] is batch["position_bias"]


def test_tuple_values_are_aligned_with_positions():
    x, y = torch.ones(2, 5, 3), torch.ones(2, 5, dtype=torch.long)
    out = pad_batch((x, y), multiple=4, values=(0.5, -100))
    assert type(out) is tuple
    assert out[0].shape == (2, 8, 3) and (out[0][:, 5:] == 0.5).all()
    assert out[1].shape == (2, 8) and (out[1][:, 5:] == -100).all()
    by_position = pad_batch((x, y), multiple=4, values={1: -1})
    assert (by_position[0][:, 5:] == 0).all() and (by_position[1][:, 5:] == -1).all()


def test_tuple_entries_default_to_zero_even_for_the_target():
    out = pad_batch((torch.ones(2, 3), torch.ones(2, 3, dtype=torch.long)), multiple=4)
    assert (out[1][:, 3:] == 0).all()  # no key says "labels": pass values=(0, -100) for that


def test_per_sample_scalars_and_non_tensors_pass_through_unchanged():
    label = torch.tensor([3, 1])
    batch = {"input_ids": torch.ones(2, 5, dtype=torch.long), "label": label, "ids": ["a", "b"]}
    out = pad_batch(batch, multiple=4)
    assert out["input_ids"].shape == (2, 8)
    assert out["label"] is label
    assert out["ids"] is batch["ids"]


def test_a_batch_already_at_a_multiple_keeps_its_tensors():
    batch = lm_batch(lengths=(8, 16))
    out = pad_batch(batch, multiple=16)
    assert all(out[key] is batch[key] for key in batch)


def test_multiple_of_one_pads_nothing():
    batch = lm_batch()
    assert all(pad_batch(batch, multiple=1)[k] is batch[k] for k in batch)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 4),
    length=st.integers(0, 40),
    multiple=st.integers(1, 17),
    dim=st.integers(1, 2),
    value=st.integers(-100, 100),
)
def test_every_padded_tensor_is_the_input_then_pad_values_up_to_the_next_multiple(
    rows, length, multiple, dim, value
):
    shape = [rows, 3, 3]
    shape[dim] = length
    gen = torch.Generator().manual_seed(length)
    ids = torch.randint(1000, shape, generator=gen)
    scores = torch.rand(shape, generator=gen)
    batch = {"ids": ids, "scores": scores, "n": torch.arange(rows)}
    out = pad_batch(batch, multiple=multiple, dim=dim, values={"ids": value})
    target = -(-length // multiple) * multiple  # the smallest multiple >= length
    for key, original, pad in (("ids", ids, value), ("scores", scores, 0.0)):
        padded = out[key]
        assert padded.shape[dim] == target and padded.dtype == original.dtype
        assert [s for d, s in enumerate(padded.shape) if d != dim] == [
            s for d, s in enumerate(original.shape) if d != dim
        ]
        assert torch.equal(padded.narrow(dim, 0, length), original)
        assert (padded.narrow(dim, length, target - length) == pad).all()
    assert out["n"].shape == (rows,)


def test_a_dim_no_tensor_has_is_refused_naming_the_shapes():
    # returning the batch unchanged would hide the mistake until the graphs keep re-capturing
    x, y = torch.ones(4, 7), torch.ones(4)
    with pytest.raises(ValueError) as info:
        pad_batch((x, y), multiple=8, dim=2)  # neither has a dim 2
    assert str(info.value) == (
        "pad_batch(dim=2) found no tensor with a dim 2 to pad (shapes 0: (4, 7), 1: (4,)); dim "
        "counts from 0 and includes the batch dimension: use dim=1 (dim=1 for [batch, sequence] "
        "tensors)."
    )
    # entries left unpadded on purpose are not a mistake
    out = pad_batch((x, y), multiple=8, dim=2, values=(None, None))
    assert out[0] is x and out[1] is y


def test_rows_not_yet_collated_are_refused_with_the_collate_fix():
    rows = [{"input_ids": torch.ones(5)}, {"input_ids": torch.ones(3)}]
    with pytest.raises(
        TypeError, match=r"entries are dict\); a list of dicts is a list of samples"
    ):
        pad_batch(rows, multiple=8)
    with pytest.raises(TypeError, match=r"default_collate\(samples\)"):
        pad_batch(rows, multiple=8)


def test_numpy_arrays_are_refused_with_the_conversion():
    np = pytest.importorskip("numpy")
    with pytest.raises(
        TypeError, match=r"entry 0 is a numpy.ndarray of shape \(2, 5\).*from_numpy"
    ):
        pad_batch((np.ones((2, 5)),), multiple=8)
    with pytest.raises(TypeError, match=r"entry 'input_ids' is a numpy.ndarray"):
        pad_batch({"input_ids": np.ones((2, 5)), "labels": torch.ones(2, 5)}, multiple=8)


def test_pads_along_another_dim():
    images = torch.ones(2, 3, 5, 7)
    (out,) = pad_batch((images,), multiple=4, dim=3)
    assert out.shape == (2, 3, 5, 8) and (out[..., 7:] == 0).all()


def test_bool_and_float_entries_take_their_pad_values():
    batch = {"mask": torch.ones(2, 3, dtype=torch.bool), "x": torch.ones(2, 3)}
    out = pad_batch(batch, multiple=4, values={"x": float("-inf")})
    assert out["mask"].dtype == torch.bool and not out["mask"][:, 3:].any()
    assert torch.isneginf(out["x"][:, 3:]).all()


@pytest.mark.parametrize(
    "batch, expected_type",
    [
        ((torch.ones(1, 3),), tuple),
        ([torch.ones(1, 3)], list),
        (Pair(torch.ones(1, 3), torch.ones(1, 3)), Pair),
        (OrderedDict(a=torch.ones(1, 3)), OrderedDict),
        (types.MappingProxyType({"a": torch.ones(1, 3)}), types.MappingProxyType),
        (KeywordOnlyMapping(items={"a": torch.ones(1, 3)}), dict),
    ],
)
def test_the_container_type_is_kept_where_it_can_be_rebuilt(batch, expected_type):
    out = pad_batch(batch, multiple=4)
    assert type(out) is expected_type
    first = next(iter(out.values())) if isinstance(out, Mapping) else out[0]
    assert first.shape == (1, 4)


def test_a_batch_encoding_keeps_its_type_and_attributes():
    batch = Encoding(lm_batch(), encodings=["enc0", "enc1", "enc2"])
    out = pad_batch(batch, multiple=8)
    assert type(out) is Encoding and out.encodings == ["enc0", "enc1", "enc2"]
    assert out["labels"].shape == (3, 16) and (out["labels"][:, 13:] == -100).all()
    assert batch["labels"].shape == (3, 13)  # the input is not changed


def test_an_hf_batch_encoding_stays_one_through_pad_batch_and_the_copy():
    transformers = pytest.importorskip("transformers")
    batch = transformers.BatchEncoding(lm_batch())
    out = pad_batch(batch, multiple=8)
    assert type(out) is transformers.BatchEncoding
    assert (out["labels"][:, 13:] == -100).all() and out.input_ids.shape == (3, 16)
    assert type(_map_tensors(out, torch.clone)) is transformers.BatchEncoding


def test_different_lengths_along_dim_name_the_keys_and_sizes():
    batch = {"input_ids": torch.ones(2, 5), "pixel_values": torch.ones(2, 3, 4, 4)}
    with pytest.raises(
        ValueError, match=r"'input_ids': 5, 'pixel_values': 3.*values=\{key: None\}"
    ):
        pad_batch(batch, multiple=8)
    out = pad_batch(batch, multiple=8, values={"pixel_values": None})  # the fix it names
    assert out["input_ids"].shape == (2, 8) and out["pixel_values"] is batch["pixel_values"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"multiple": 0}, r"multiple=0 must be an integer >= 1"),
        ({"multiple": 1.5}, r"multiple=1\.5 must be an integer"),
        ({"multiple": True}, r"multiple=True must be an integer"),
        ({"dim": -1}, r"dim=-1 must be a non-negative integer"),
        ({"dim": "1"}, r"dim='1' must be a non-negative integer"),
        ({"batch_multiple": 0}, r"batch_multiple=0 must be an integer >= 1"),
        ({"dim": 0, "batch_multiple": 8}, r"pads dim 0 twice"),
        ({"values": {"label": -100}}, r"values names \['label'\].*misspelt"),
        ({"values": (0, -100)}, r"is a sequence, but the batch is a mapping"),
        ({"values": {"labels": "ignore"}}, r"values\['labels'\]='ignore' must be a number"),
        ({"values": 0}, r"values=0 must be None, a mapping"),
        ({"values": {"input_ids": 0.5}}, r"pad value 0\.5 for entry 'input_ids'.*torch\.int64"),
        ({"values": {"mask": 2}}, r"pad value 2 for entry 'mask' does not fit.*torch\.bool"),
        ({"values": {"input_ids": 2**63}}, r"does not fit its dtype torch\.int64"),
    ],
)
def test_bad_arguments_raise_config_error_naming_the_value(kwargs, message):
    batch = {
        "input_ids": torch.ones(2, 3, dtype=torch.long),
        "mask": torch.ones(2, 3, dtype=torch.bool),
        "labels": torch.ones(2, 3, dtype=torch.long),
    }
    with pytest.raises(ConfigError, match=message):
        pad_batch(batch, **kwargs)


def test_tuple_values_of_the_wrong_length_or_position_are_refused():
    batch = (torch.ones(2, 3), torch.ones(2, 3))
    with pytest.raises(ConfigError, match="values has 1 pad values for a batch of 2 entries"):
        pad_batch(batch, values=(0,))
    with pytest.raises(ConfigError, match=r"values names \[2\]"):
        pad_batch(batch, values={2: 0})


def test_options_are_keyword_only_and_a_bare_tensor_is_a_type_error():
    with pytest.raises(TypeError):
        pad_batch((torch.ones(2, 3),), 8)  # type: ignore[misc]
    with pytest.raises(TypeError, match=r"got a Tensor; pass a tuple/list.*pad_batch\(\(x,\)\)"):
        pad_batch(torch.ones(2, 3))


# ------------------------------------------------------------------ pad_batch: loss neutrality
class TinyLM(nn.Module):
    """A causal-LM-like model whose logits depend on the whole row through a masked mean.

    Embedding + linear head, plus a bidirectional context (the mean of the row's embeddings
    over positions with attention_mask 1), so a padded position changes every real position's
    logits unless the mask leaves it out. The loss is HF's: next-token cross entropy with
    ignore_index=-100, a mean over the positions whose label is not -100.
    """

    def __init__(self, vocab: int = 50, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids, attention_mask, labels):
        hidden = self.embed(input_ids)
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        # clamp: a row with no real token (a padded row) gets a finite context, not 0/0
        context = (hidden * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)
        logits = self.head(torch.tanh(hidden + self.mix(context)))
        return F.cross_entropy(
            logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100
        )


def loss_and_grads(model: nn.Module, batch) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    loss = model(**batch) if isinstance(batch, Mapping) else model(*batch)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def assert_same_loss_and_grads(a, b):
    assert torch.allclose(a[0], b[0], rtol=1e-5, atol=1e-6), (a[0], b[0])
    for grad_a, grad_b in zip(a[1], b[1]):
        assert torch.allclose(grad_a, grad_b, rtol=1e-4, atol=1e-6)


def test_padding_to_a_bucket_leaves_loss_and_gradients_unchanged():
    torch.manual_seed(0)
    model = TinyLM()
    batch = lm_batch()
    padded = pad_batch(batch, multiple=64)
    assert padded["input_ids"].shape == (3, 64)
    assert_same_loss_and_grads(loss_and_grads(model, batch), loss_and_grads(model, padded))


@pytest.mark.parametrize(
    "wrong",
    [
        {"labels": 0},  # padded positions become targets of token 0
        {"attention_mask": 1},  # padded positions enter every row's context
    ],
)
def test_padding_with_the_wrong_value_changes_the_loss(wrong):
    # The neutrality above holds because of these two pad values; the test can fail.
    torch.manual_seed(0)
    model = TinyLM()
    batch = lm_batch()
    right = loss_and_grads(model, batch)[0]
    assert not torch.allclose(right, loss_and_grads(model, pad_batch(batch, values=wrong))[0])


def test_padding_an_hf_gpt2_batch_leaves_its_loss_unchanged():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=50, n_positions=64, n_embd=32, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(config).eval()  # eval: no dropout, same draws
    batch = lm_batch()
    padded = pad_batch(batch, multiple=32)
    with torch.no_grad():
        plain = model(**batch)
        bucket = model(**padded)
    assert torch.allclose(plain.loss, bucket.loss, rtol=1e-5, atol=1e-6)
    real = batch["attention_mask"].bool()
    assert torch.allclose(plain.logits[real], bucket.logits[:, :13][real], atol=1e-5)


# ------------------------------------------------- pad_batch: the batch-dimension remainder
def test_padded_rows_are_masked_out_of_loss_and_gradients():
    torch.manual_seed(0)
    model = TinyLM()
    batch = lm_batch(lengths=(7, 11, 13))  # the last batch of an epoch: 3 rows, not 8
    padded = pad_batch(batch, multiple=16, batch_multiple=8)
    assert padded["input_ids"].shape == (8, 16)
    assert (padded["labels"][3:] == -100).all() and (padded["attention_mask"][3:] == 0).all()
    assert_same_loss_and_grads(loss_and_grads(model, batch), loss_and_grads(model, padded))


def classifier(batch_norm: bool) -> nn.Module:
    torch.manual_seed(0)
    norm: nn.Module = nn.BatchNorm1d(8) if batch_norm else nn.Identity()
    return nn.Sequential(nn.Linear(4, 8), norm, nn.ReLU(), nn.Linear(8, 3))


def class_loss(model: nn.Module):
    def loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x), y)  # ignore_index=-100 by default

    return loss


def test_padded_rows_of_a_tuple_batch_with_an_ignored_target_are_neutral():
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(5, 4, generator=gen), torch.randint(3, (5,), generator=gen)
    padded = pad_batch((x, y), multiple=1, batch_multiple=8, values=(0.0, -100))
    assert padded[0].shape == (8, 4) and padded[1].tolist()[5:] == [-100] * 3
    model = classifier(batch_norm=False)
    loss = class_loss(model)
    assert torch.allclose(loss(x, y), loss(*padded))


def test_padded_rows_change_a_batch_norm_model_as_documented():
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(5, 4, generator=gen), torch.randint(3, (5,), generator=gen)
    padded = pad_batch((x, y), multiple=1, batch_multiple=8, values=(0.0, -100))
    loss = class_loss(classifier(batch_norm=True).train())
    assert not torch.allclose(loss(x, y), loss(*padded))  # batch statistics see the zero rows


def test_batch_padding_of_a_tuple_needs_the_target_pad_value():
    with pytest.raises(ConfigError, match=r"nothing marks them.*values=\(0, -100\)"):
        pad_batch((torch.ones(5, 4), torch.zeros(5, dtype=torch.long)), batch_multiple=8)


def test_batch_padding_needs_one_row_count():
    batch = {"labels": torch.ones(3, 4, dtype=torch.long), "extra": torch.ones(2, 4)}
    with pytest.raises(ValueError, match=r"along dim 0.*'labels': 3, 'extra': 2"):
        pad_batch(batch, multiple=1, batch_multiple=4)


# --------------------------------------------------------------------- prefetch: the CPU path
def nested_batches() -> list:
    return [
        (torch.full((2, 3), float(i)), torch.tensor([i, i]))
        if i % 3 == 0
        else {"x": torch.full((2, 3), float(i)), "meta": {"ids": [i, i + 1], "name": f"b{i}"}}
        if i % 3 == 1
        else [Pair(torch.full((2,), float(i)), [torch.tensor(i)]), "text"]
        for i in range(7)
    ]


def test_on_cpu_prefetch_yields_the_loaders_own_batches_in_order():
    batches = nested_batches()
    got = list(prefetch(batches, "cpu"))
    assert len(got) == len(batches)
    assert all(a is b for a, b in zip(got, batches))


def test_on_cpu_a_dataloader_gives_the_same_batches_and_len():
    data = TensorDataset(torch.arange(40.0).view(20, 2), torch.arange(20))
    loader = DataLoader(data, batch_size=6)
    wrapped = prefetch(loader, torch.device("cpu"))
    assert len(wrapped) == len(loader) == 4
    for _ in range(2):  # every iter() is a new pass
        got = list(wrapped)
        expected = list(loader)
        assert len(got) == 4
        for (x, y), (ex, ey) in zip(got, expected):
            assert torch.equal(x, ex) and torch.equal(y, ey)


def test_len_of_a_loader_without_one_is_a_type_error():
    with pytest.raises(TypeError):
        len(prefetch(iter([1, 2]), "cpu"))


def failing_loader(good: int) -> Iterator[torch.Tensor]:
    for i in range(good):
        yield torch.tensor(i)
    raise RuntimeError("bad sample 3")


def test_on_cpu_an_exception_from_the_loader_reaches_the_loop():
    got = []
    with pytest.raises(RuntimeError, match="bad sample 3"):
        for batch in prefetch(failing_loader(3), "cpu"):
            got.append(int(batch))
    assert got == [0, 1, 2]


@pytest.mark.timeout(120)
def test_breaking_out_early_with_loader_workers_does_not_hang():
    data = TensorDataset(torch.arange(64.0).view(32, 2))
    loader = DataLoader(data, batch_size=2, num_workers=1)
    for _ in range(3):  # a fresh worker each pass, each abandoned after two batches
        for i, _batch in enumerate(prefetch(loader, "cpu")):
            if i == 1:
                break


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"depth": 0}, ConfigError, r"depth=0 must be an integer >= 1"),
        ({"depth": 2.0}, ConfigError, r"depth=2\.0 must be an integer >= 1"),
        ({"depth": True}, ConfigError, r"depth=True must be an integer >= 1"),
        ({"device": "meta"}, ConfigError, r"only 'cuda' and 'cpu' devices are supported"),
        ({"device": "gpu0"}, ConfigError, r"device='gpu0' is not a device"),
        ({"loader": 5}, ConfigError, r"got a int, which is not iterable"),
    ],
)
def test_prefetch_validates_its_arguments(kwargs, error, message):
    args = {"loader": [torch.ones(1)], "device": "cpu", **kwargs}
    with pytest.raises(error, match=message):
        prefetch(args.pop("loader"), args.pop("device"), **args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_prefetch_to_cuda_without_cuda_says_so():
    with pytest.raises(ConfigError, match=r"CUDA is not available; pass the device the model"):
        prefetch([], "cuda")


# -------------------------------------------- prefetch: the pipeline its CUDA path runs on
class Recorder:
    """stage/hand_over for _Lookahead that log what happened when, instead of copying."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []

    def stage(self, item: int) -> int:
        self.log.append(("stage", item))
        return item

    def hand_over(self, item: int) -> int:
        self.log.append(("hand", item))
        return item


@pytest.mark.parametrize("depth", [1, 2, 5])
def test_the_pipeline_stages_depth_items_ahead_and_keeps_the_order(depth):
    rec = Recorder()
    pipe = _Lookahead(iter(range(4)), stage=rec.stage, hand_over=rec.hand_over, depth=depth)
    assert rec.log == [("stage", i) for i in range(min(depth, 4))]  # staged before any next()
    got = []
    for item in pipe:
        got.append(item)
        staged = [i for what, i in rec.log if what == "stage"]
        # when an item is handed over, the next `depth` are already in flight
        assert staged == list(range(min(item + 1 + depth, 4)))
    assert got == [0, 1, 2, 3]
    assert [i for what, i in rec.log if what == "hand"] == [0, 1, 2, 3]


@pytest.mark.parametrize("depth", [1, 3])
def test_the_pipeline_raises_a_loader_error_after_the_items_before_it(depth):
    rec = Recorder()
    pipe = _Lookahead(failing_loader(3), stage=rec.stage, hand_over=rec.hand_over, depth=depth)
    got = []
    with pytest.raises(RuntimeError, match="bad sample 3"):
        for item in pipe:
            got.append(int(item))
    assert got == [0, 1, 2]
    with pytest.raises(StopIteration):  # raised once, then the pipeline is simply over
        next(pipe)


def test_an_empty_loader_gives_an_empty_pipeline():
    rec = Recorder()
    assert list(_Lookahead(iter([]), stage=rec.stage, hand_over=rec.hand_over, depth=2)) == []


def test_the_copy_reaches_every_tensor_and_keeps_containers_and_other_leaves():
    seen = []

    def double(t: torch.Tensor) -> torch.Tensor:
        seen.append(t)
        return t * 2

    for batch in nested_batches():
        out = _map_tensors(batch, double)
        assert type(out) is type(batch)
        flat_in, flat_out = _leaves(batch), _leaves(out)
        assert len(flat_in) == len(flat_out)
        for a, b in zip(flat_in, flat_out):
            if isinstance(a, torch.Tensor):
                assert torch.equal(b, a * 2)
            else:
                assert a is b  # strings, ints, names: untouched
    assert seen  # every batch had tensors
    encoding = _map_tensors(Encoding({"a": torch.ones(1)}, encodings="kept"), double)
    assert type(encoding) is Encoding and encoding.encodings == "kept"


def _leaves(data) -> list:
    if isinstance(data, Mapping):
        return [leaf for value in data.values() for leaf in _leaves(value)]
    if isinstance(data, (tuple, list)):
        return [leaf for value in data for leaf in _leaves(value)]
    return [data]


def test_public_names():
    assert ddpgraph.pad_batch is pad_batch and ddpgraph.prefetch is prefetch


# ------------------------------------------------------------------- benchmarks/loader.py
@pytest.mark.timeout(600)
def test_loader_benchmark_quick_writes_rates_and_ratios(tmp_path):
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "loader.py"
    out = tmp_path / "loader.json"
    proc = subprocess.run(
        [sys.executable, str(script), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=580,  # seconds on an idle machine; minutes on a loaded CI runner
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["environment"]["torch"] == torch.__version__ and data["environment"]["commit"]
    assert data["config"]["quick"] is True and data["device"] == "cpu"
    assert set(data["models"]) == {"mlp", "resnet", "transformer"}
    for result in data["models"].values():
        rates = result["steps_per_s"]
        assert set(rates) == {
            "staged",
            "loader",
            "prefetch",
            "batched_prefetch",
            "batched_workers_prefetch",
            "index_prefetch",
            "device_index",
            "device_data",
        }
        assert all(rate > 0 for rate in rates.values())
        for mode, ratio in result["ratio_to_staged"].items():
            assert ratio == pytest.approx(rates[mode] / rates["staged"])
        assert all(len(v) == 2 for v in result["all_repeats_steps_per_s"].values())
        alone = result["loader_alone_batches_per_s"]
        assert set(alone) == {"loader", "batched", "batched_workers", "index"}
        assert all(rate > 0 for rate in alone.values())
