"""Packed (padding-free) batches at a fixed capacity (``ddpgraph.integrations._packing``): the
batch TRL's ``DataCollatorForLanguageModeling(padding_free=True)`` (trl 1.16) makes, padded so
that one graph serves every packed batch. The SFT runs themselves are in
``test_integrations_trl.py``."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

from ddpgraph.errors import ConfigError
from ddpgraph.integrations._packing import fixed_capacity

PAD = 60


def trl_packed(*lengths: int) -> dict:
    """TRL's own padding-free batch of documents of these lengths (its collator, not ours)."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    collator = DataCollatorForLanguageModeling(pad_token_id=PAD, padding_free=True)
    gen = torch.Generator().manual_seed(0)
    return collator(
        [{"input_ids": torch.randint(50, (n,), generator=gen).tolist()} for n in lengths]
    )


def test_a_packed_batch_keeps_its_documents_and_pads_to_the_capacity_with_short_documents():
    batch = trl_packed(5, 3, 7)
    padded = fixed_capacity(batch, capacity=32, max_length=8, pad_token_id=PAD)
    assert padded["input_ids"].shape == (1, 32)
    for key in ("input_ids", "labels", "position_ids", "seq_idx"):
        assert torch.equal(padded[key][:, :15], batch[key]), key
    # padding: documents of at most max_length tokens (8, 8, 1), ignored by the loss
    assert padded["position_ids"][0, 15:].tolist() == [*range(8), *range(8), 0]
    assert (padded["labels"][0, 15:] == -100).all() and (padded["input_ids"][0, 15:] == PAD).all()
    assert padded["seq_idx"][0, 15:].tolist() == [3] * 8 + [4] * 8 + [5]
    # boundaries: the real offsets, the padding's, then the last repeated to capacity + 1
    offsets = [0, 5, 8, 15, 23, 31, 32]
    expected = offsets + [32] * (33 - len(offsets))
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        assert padded[key].tolist() == expected and padded[key].dtype == torch.int32
        assert padded["max_length_q"] == padded["max_length_k"] == 8


def test_every_packed_batch_gets_the_same_shapes():
    shapes = {
        tuple((k, tuple(v.shape)) for k, v in sorted(padded.items()) if isinstance(v, torch.Tensor))
        for padded in (
            fixed_capacity(trl_packed(*lengths), capacity=40, max_length=10, pad_token_id=PAD)
            for lengths in ((10,), (3, 4, 5), (1,) * 12, (10, 10, 10, 10))
        )
    }
    assert len(shapes) == 1, shapes


def test_a_batch_over_the_capacity_or_a_document_over_max_length_is_refused_with_the_numbers():
    with pytest.raises(ConfigError, match="of 30 tokens exceeds GraphTrainer's capacity of 24"):
        fixed_capacity(trl_packed(10, 10, 10), capacity=24, max_length=10, pad_token_id=PAD)
    with pytest.raises(ConfigError, match=r"a document of 12 tokens .* longer than max_length=10"):
        fixed_capacity(trl_packed(12), capacity=24, max_length=10, pad_token_id=PAD)
