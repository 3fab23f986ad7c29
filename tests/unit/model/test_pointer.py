"""The base's attention maps from each prompt's last position, recorded during the capture's
forward: the eager attention's own probabilities, for lanes of unlike length and grouped
queries, with the rows unchanged."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from stateblock.model.capture import capture
from stateblock.model.pointer import attention_modules, capture_pointing

V = 50


def _base(kv_heads: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=kv_heads,
                      max_position_embeddings=64)  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_the_maps_are_the_eager_attentions_last_row(kv_heads):
    base = _base(kv_heads)
    lens = torch.tensor([9, 5, 7])
    ids = torch.zeros(3, 9, dtype=torch.long)
    for i, n in enumerate(lens.tolist()):
        ids[i, :n] = torch.randint(3, V, (n,))
    rows, maps = capture_pointing(base, ids, lens)
    assert maps.shape == (3, 3 * 4, 9)
    assert torch.allclose(rows, capture(base, ids))  # the hooks change nothing
    base.set_attn_implementation("eager")
    for i, n in enumerate(lens.tolist()):
        with torch.no_grad():
            att = base.model(ids[i : i + 1, :n], output_attentions=True).attentions
        want = torch.cat([a[0, :, -1] for a in att])  # (L * H, n)
        assert torch.allclose(maps[i, :, :n], want, atol=1e-5)
        assert (maps[i, :, n:] == 0).all()


def test_a_model_without_decoder_layers_is_refused():
    class Bare(torch.nn.Module):
        base_model = torch.nn.Linear(2, 2)

    with pytest.raises(TypeError, match="self_attn"):
        attention_modules(Bare())


def test_the_probe_finds_a_copied_spans_start_and_counts_the_heads_that_peak_there():
    from stateblock.train.pointer_probe import probe, span_start

    assert span_start([9, 5, 6, 7, 8, 3], [5, 6, 7, 8, 2]) == 1
    assert span_start([9, 5, 6, 7, 8, 6, 7, 8], [5, 6, 7, 8, 2]) is None  # not once
    assert span_start([9, 5, 6], [5, 6]) is None  # too short to place
    base = _base(4)
    recs = [{"prompt_ids": [9, 5, 6, 7, 8, 3, 4], "answer_ids": [5, 6, 7, 8, 2]},
            {"prompt_ids": [9, 4, 4], "answer_ids": [1, 2]}]  # fmt: skip
    share, n = probe(base, recs)
    _, maps = capture_pointing(base, torch.tensor([recs[0]["prompt_ids"]]), torch.tensor([7]))
    assert n == 1 and torch.equal(share, (maps[0].argmax(-1) == 1).float())
