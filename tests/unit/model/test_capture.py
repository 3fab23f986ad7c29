"""Capture on the shipped reference model and on a tiny hybrid Mamba/attention NemotronH."""

import re

import pytest
import torch
from transformers import NemotronHConfig, NemotronHForCausalLM

from stateblock.model.capture import (
    backbone,
    capture,
    compile_backbone,
    compile_cache_counts,
    lm_head_weight,
    pack_lanes,
    pad_lanes,
    uncompile_backbone,
    unpack_lanes,
    use_compile_cache,
    warm_up,
)
from stateblock.model.decoder import ReadoutConfig, ReadoutDecoder
from stateblock.model.loading import load_base
from tests.helpers import REFERENCE_BASE


def tiny_nemotron_h() -> NemotronHForCausalLM:
    torch.manual_seed(0)
    cfg = NemotronHConfig(
        vocab_size=97,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        mamba_num_heads=4,
        mamba_head_dim=16,
        n_groups=1,
        ssm_state_size=16,
        chunk_size=16,
        n_routed_experts=2,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32,
        num_experts_per_tok=1,
        layers_block_type=["mamba", "attention", "mlp", "mamba"],
    )
    return NemotronHForCausalLM(cfg).eval()


def check_capture(model, ids, mask):
    calls = []
    rows = capture(model, ids, mask, on_rows=lambda r: calls.append(r.shape))
    assert calls == [rows.shape]  # the hook fired exactly once, in the one forward
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    diff = (rows - ref.hidden_states[-1]).abs().max().item()
    assert diff < 1e-5, diff
    return rows


def test_capture_reference_model_equals_final_hidden_state():
    model, tok = load_base(REFERENCE_BASE)
    enc = tok(["copy: abc", "count: 001 009"], padding=True, return_tensors="pt")
    rows = check_capture(model, enc["input_ids"], enc["attention_mask"])
    assert rows.shape[-1] == model.config.hidden_size


def test_capture_nemotron_h_through_the_decoder():
    model = tiny_nemotron_h()
    assert {"linear_attention", "full_attention"} <= set(model.config.layers_block_type)  # hybrid
    ids = torch.randint(0, 97, (2, 9))
    rows = check_capture(model, ids, torch.ones_like(ids))
    head = lm_head_weight(model)
    dec = ReadoutDecoder(
        ReadoutConfig(d_base=64, vocab_size=97, eos_token_id=2, d_r=32, n_latent=4, n_heads=4)
    ).eval()
    with torch.no_grad():
        out = dec(
            rows, torch.tensor([9, 5]), torch.arange(30).expand(2, -1), torch.tensor([30, 12]), head
        )
    assert out.tokens.shape == (2, 30)
    assert int(out.tokens.max()) < 97


def test_capture_does_not_leak_between_calls():
    model, tok = load_base(REFERENCE_BASE)
    a = tok(["copy: abc"], return_tensors="pt")
    b = tok(["sort: zyx"], return_tensors="pt")
    ra1 = capture(model, a["input_ids"], a["attention_mask"])
    capture(model, b["input_ids"], b["attention_mask"])
    ra2 = capture(model, a["input_ids"], a["attention_mask"])
    assert torch.equal(ra1, ra2)
    assert not model.base_model._forward_hooks  # the hook is removed after each forward


def test_pack_and_unpack_lanes_keep_the_layout_invariant():
    rows = [torch.randn(n, 8) for n in (3, 1, 5)]
    packed, offsets = pack_lanes(rows)
    assert offsets.tolist() == [0, 3, 4, 9] and packed.shape[0] == 9
    assert all(torch.equal(a, b) for a, b in zip(unpack_lanes(packed, offsets), rows, strict=True))
    with pytest.raises(ValueError):
        unpack_lanes(packed[:-1], offsets)
    padded, lens = pad_lanes(rows)
    assert padded.shape == (3, 5, 8) and lens.tolist() == [3, 1, 5]


def test_compiled_backbone_still_captures_through_the_hook():
    """`compile_backbone` replaces only the backbone's forward: the hook still fires once per
    capture with the same rows (aot_eager: the compile path without codegen, fast on CPU)."""
    model, tok = load_base(REFERENCE_BASE)
    enc = tok(["copy: abc", "count: 001 009"], padding=True, return_tensors="pt")
    eager = capture(model, enc["input_ids"], enc["attention_mask"])
    compile_backbone(model, "aot_eager")
    seen = []
    rows = capture(model, enc["input_ids"], enc["attention_mask"], on_rows=seen.append)
    assert len(seen) == 1 and seen[0] is rows
    assert torch.equal(rows, eager)
    assert not model.base_model._forward_hooks
    one = capture(model, enc["input_ids"][:1], enc["attention_mask"][:1])  # another shape
    torch.testing.assert_close(one, eager[:1], rtol=0, atol=1e-5)  # batch size changes rounding
    uncompile_backbone(model)  # back to the eager forward, dynamo's caches dropped
    assert not hasattr(model.base_model, "_stateblock_compiled")
    assert not hasattr(model.base_model.forward, "_torchdynamo_orig_callable")
    assert torch.equal(capture(model, enc["input_ids"], enc["attention_mask"]), eager)
    uncompile_backbone(model)  # a no-op on an eager backbone


def test_a_compile_after_a_restart_loads_the_graph_from_the_compile_cache(tmp_path, monkeypatch):
    """use_compile_cache: inductor keeps what it compiled in the directory, and the same
    graph compiled again once dynamo has forgotten it (as in a new process) is loaded from
    there: a cache hit, no second miss (inductor itself: C++ on the CPU)."""
    import torch._dynamo

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "restored-at-teardown"))
    cache = tmp_path / "compile-cache"
    use_compile_cache(cache)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    x = torch.randn(3, 8)
    before = compile_cache_counts()
    runs = []
    for _ in range(2):
        torch._dynamo.reset()
        runs.append(torch.compile(net)(x))
        torch._dynamo.reset()
    after = compile_cache_counts()
    assert after["fxgraph_miss"] - before["fxgraph_miss"] == 1  # the first compile
    assert after["fxgraph_hit"] - before["fxgraph_hit"] == 1  # the second, from the cache
    assert (cache / "fxgraph").is_dir()
    torch.testing.assert_close(runs[0], runs[1], rtol=0, atol=0)


def test_warm_up_runs_each_shape_as_a_request_runs_it():
    """Right-padded pad ids, no mask, `runs` times a shape, each shape reported once."""
    model, tok = load_base(REFERENCE_BASE)
    seen = []
    handle = model.register_forward_pre_hook(
        lambda _m, _a, kw: seen.append((tuple(kw["input_ids"].shape), kw["attention_mask"])),
        with_kwargs=True,
    )
    reported = []
    try:
        warm_up(model, [(1, 16), (2, 24)], pad_id=0, runs=2, on_shape=lambda *a: reported.append(a))
    finally:
        handle.remove()
    assert seen == [((1, 16), None)] * 2 + [((2, 24), None)] * 2
    assert [r[:2] for r in reported] == [(1, 16), (2, 24)] and all(r[2] > 0 for r in reported)


@pytest.mark.parametrize("size_oblivious, graphs", [(False, 2), (True, 1)])
def test_a_lone_lane_runs_the_cohorts_graph_only_when_compiled_size_oblivious(
    size_oblivious, graphs
):
    """Dynamo specializes a lane count of one into a graph of its own, whose kernels may
    round otherwise (so by default a lone lane runs beside a dummy one); compiled
    size-oblivious (the lane count unbacked), lanes 4, 2 and 1 all run the one symbolic
    graph and give a lane the same rows."""
    from torch._dynamo.utils import counters

    model, tok = load_base(REFERENCE_BASE)
    ids = torch.randint(5, 60, (4, 24), generator=torch.Generator().manual_seed(0))
    try:
        compile_backbone(model, "aot_eager", size_oblivious=size_oblivious)
        counters.clear()
        rows = {lanes: capture(model, ids[:lanes].clone())[0] for lanes in (4, 2, 1)}
        assert counters["stats"]["unique_graphs"] == graphs
        assert torch.equal(rows[1], rows[4]) and torch.equal(rows[2], rows[4])
    finally:
        uncompile_backbone(model)


def grouped_heads_llama(layers: int):
    """A tiny random Llama of the bench's head shape: 21 query heads over 3 key/value heads
    (hidden 84, vocabulary 96), the same weights for a given `layers`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=84, num_hidden_layers=layers,
                         num_attention_heads=21, num_key_value_heads=3, intermediate_size=160)  # fmt: skip
    return LlamaForCausalLM(config).eval()


def test_a_lone_lane_runs_the_cohorts_graph_with_grouped_key_value_heads_too():
    """The bench's Llama shape (21 query heads over 3 key/value heads), compiled
    size-oblivious: lanes 3, 1 and 2 run one graph (the lane count is unbacked, so no
    stride rule of the grouped heads guards it) and give a lane the same rows."""
    from torch._dynamo.utils import counters

    model = grouped_heads_llama(layers=2)
    ids = torch.randint(4, 96, (3, 40))
    compile_backbone(model, "aot_eager", size_oblivious=True)
    try:
        counters.clear()
        rows = {lanes: capture(model, ids[:lanes].clone())[0] for lanes in (3, 1, 2)}
        assert counters["stats"]["unique_graphs"] == 1
        assert torch.equal(rows[1], rows[3]) and torch.equal(rows[2], rows[3])
    finally:
        uncompile_backbone(model)


def sin_kernel_calls(model, ids) -> int:
    """How many times the compiled forward's wrapper calls a kernel that evaluates sin."""
    from torch._inductor.utils import run_and_get_code

    _, codes = run_and_get_code(lambda: capture(model, ids))
    code = "\n".join(codes)
    starts = [(m.start(), m.group(1)) for m in re.finditer(r"^(\w+) = async_compile", code, re.M)]
    call = code[code.index("def call(") :]
    calls = 0
    for (start, name), (end, _) in zip(starts, [*starts[1:], (len(code), "")], strict=True):
        if re.search(r"\bsin\(|\.sin\(", code[start:end]):
            calls += len(re.findall(rf"\b{name}(?:\.run)?\(", call))
    return calls


def test_a_rope_table_evaluates_cos_and_sin_once_a_forward_not_in_every_layer():
    """Compiled, inductor fuses the rotary embedding's cos and sin into each of the 3 layers'
    rotary kernels; with `use_rope_table` they are evaluated by one kernel, once a forward,
    in one graph. Eager, the embedding gives what it gave."""
    from torch._dynamo.utils import counters

    from stateblock.model.capture import use_rope_table

    ids = torch.randint(4, 96, (2, 24), generator=torch.Generator().manual_seed(0))
    calls = {}
    for table in (False, True):
        model = grouped_heads_llama(layers=3)
        rope = backbone(model).rotary_emb
        x, pos = torch.zeros(1, 24, 84), torch.arange(24)[None]
        before = rope(x, pos)
        if table:
            assert use_rope_table(model)
            assert all(torch.equal(a, b) for a, b in zip(rope(x, pos), before, strict=True))
        compile_backbone(model, "default")
        try:
            counters.clear()
            calls[table] = sin_kernel_calls(model, ids)
            assert counters["stats"]["unique_graphs"] == 1
        finally:
            uncompile_backbone(model)
    assert calls == {False: 3, True: 1}


def test_unmasked_causal_attention_leaves_out_the_mask_and_keeps_the_rows():
    """A Llama with grouped key/value heads (the bench's shape), compiled: with the unmasked
    attention no (B, 1, P, P) mask is built for a batch without padding, the rows equal the
    eager forward's bit for bit, and a padding mask still gets transformers' mask."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.masking_utils import sdpa_mask

    from stateblock.model.capture import _causal_mask_or_none, use_unmasked_causal_attention

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(4, 96, (3, 24))
    eager = capture(model, ids)
    assert use_unmasked_causal_attention(model)
    compile_backbone(model, "aot_eager")
    try:
        assert torch.equal(capture(model, ids), eager)
    finally:
        uncompile_backbone(model)
    assert _causal_mask_or_none(batch_size=3, q_length=24, kv_length=24) is None
    padding = torch.ones(3, 24, dtype=torch.bool)
    padding[0, 20:] = False
    kwargs = dict(batch_size=3, q_length=24, kv_length=24, attention_mask=padding)
    assert torch.equal(_causal_mask_or_none(**kwargs), sdpa_mask(**kwargs))
    # another attention than SDPA is left as it is
    other = LlamaForCausalLM(LlamaConfig(**config.to_dict(), attn_implementation="eager"))
    assert not use_unmasked_causal_attention(other)
    assert other.config._attn_implementation == "eager"


def test_a_compiled_backbone_is_deterministic_unless_a_bench_asks_to_autotune():
    """The service's compile picks kernel configurations without timing them (replicas then
    agree); `deterministic=False`, for a bench measuring autotuning, leaves them timed."""
    import torch._inductor.config as inductor

    from stateblock.model.capture import compile_settings

    if not hasattr(inductor, "deterministic"):
        pytest.skip("this torch has no inductor deterministic mode")
    assert (inductor, "deterministic", True) in compile_settings()
    assert (inductor, "deterministic", False) in compile_settings(deterministic=False)
