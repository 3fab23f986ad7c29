"""Benchmark models built from config alone: random weights, seeded, nothing downloaded.

- a Llama-shaped base (2.9 B parameters at `full`: hidden 2688, 28 layers, 21 heads, 3 KV
  heads, intermediate 7680, vocabulary 131072), saved with `save_pretrained` in bf16 with a
  word-level tokenizer of as many ids, so the services load and digest it like any base;
- a readout decoder of matching dimensions, saved with `save_decoder` against that base, so
  the manifest checks of the capture and readout services pass;
- a NemotronH-shaped hybrid (Mamba2 + attention + MLP layers) for a capture-only prefill.

The weights are untouched random ones: the bench asks the gateway for `ignore_eos` (every
request reads all of max_tokens), and AR generation forces the count with min_new_tokens.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from stateblock.model import checkpoint as ckpt
from stateblock.model.capture import lm_head_weight
from stateblock.model.decoder import ReadoutConfig, ReadoutDecoder
from stateblock.model.loading import ServingModel
from stateblock.protocol.envelope import ModelIdentity
from stateblock.train.recipe import DECODER_CONFIG

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIALS = (PAD, BOS, EOS, UNK)  # ids 0..3; word i is "w{i}" for i >= 4


def nemotron_pattern(groups: int, mamba_per_group: int) -> str:
    """Layers as NemotronH spells them: M Mamba2, * attention, - MLP; an MLP after each mixer."""
    return ("M-" * mamba_per_group + "*-") * groups


@dataclass(frozen=True)
class Scale:
    llama: dict
    vocab_size: int
    prompt_len: int
    max_tokens: int
    decoder: dict = field(default_factory=dict)  # ReadoutConfig overrides


SCALES: dict[str, Scale] = {
    # the target shape of docs/BENCHMARKS.md
    "full": Scale(
        llama=dict(hidden_size=2688, num_hidden_layers=28, num_attention_heads=21,
                   num_key_value_heads=3, intermediate_size=7680),
        vocab_size=131072,
        prompt_len=512,
        max_tokens=1014,
        decoder=dict(DECODER_CONFIG),  # the shipped decoder's architecture, at this scale
    ),
    # the full scale's wire: a 512 x 2688 block per request, in the services' own CPU stages
    # (sign, publish, verify, ...) on a machine without a GPU; one thin layer, small vocab
    "wire": Scale(
        llama=dict(hidden_size=2688, num_hidden_layers=1, num_attention_heads=21,
                   num_key_value_heads=3, intermediate_size=256),
        vocab_size=2048,
        prompt_len=512,
        max_tokens=64,
        decoder=dict(d_r=64, n_latent=8, n_heads=4),
    ),
    # the CPU dry run: the same code path in seconds
    "tiny": Scale(
        llama=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, intermediate_size=128),
        vocab_size=2048,
        prompt_len=48,
        max_tokens=96,
        decoder=dict(d_r=32, n_latent=8, n_heads=4),
    ),
}  # fmt: skip

NEMOTRON: dict[str, dict] = {
    # Nemotron-H-8B-shaped: 24 Mamba2, 4 attention and 24 MLP layers, ~8.1 B parameters
    "8b": dict(hidden_size=4096, groups=4, mamba_per_group=6, intermediate_size=21504,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128,
               mamba_num_heads=128, mamba_head_dim=64, n_groups=8, ssm_state_size=128,
               vocab_size=131072),
    # ~2.7 B: the same layer mix at half the width
    "2b": dict(hidden_size=2048, groups=4, mamba_per_group=6, intermediate_size=10752,
               num_attention_heads=16, num_key_value_heads=8, head_dim=128,
               mamba_num_heads=64, mamba_head_dim=64, n_groups=8, ssm_state_size=128,
               vocab_size=131072),
    "tiny": dict(hidden_size=64, groups=1, mamba_per_group=2, intermediate_size=128,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16,
                 vocab_size=2048),
}  # fmt: skip


def bench_tokenizer(vocab_size: int):
    """A fast tokenizer with exactly vocab_size ids: specials, then one id per word `w{i}`.

    Prompts through the HTTP API are text, so a prompt of n ids is n - 1 words (plus <bos>).
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIALS), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])]
    )
    tok.add_special_tokens(list(SPECIALS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, unk_token=UNK, pad_token=PAD
    )


def bench_prompt(rng: random.Random, n_ids: int, vocab_size: int) -> str:
    """A text prompt the bench tokenizer encodes to exactly n_ids ids (<bos> included)."""
    return " ".join(f"w{rng.randrange(len(SPECIALS), vocab_size)}" for _ in range(n_ids - 1))


def llama_config(scale: Scale):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=scale.vocab_size,
        max_position_embeddings=8192 + 512,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **scale.llama,
    )


def _from_config(config, device: str, dtype: torch.dtype, seed: int) -> nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):  # initialised where it runs: no host copy of 2.9 B weights
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval().requires_grad_(False)


def build_llama(scale: Scale, device: str, seed: int = 0) -> nn.Module:
    """The random Llama base in bf16."""
    return _from_config(llama_config(scale), device, torch.bfloat16, seed)


def build_nemotron(preset: str, device: str, seed: int = 0) -> nn.Module:
    from transformers import NemotronHConfig

    p = dict(NEMOTRON[preset])
    pattern = nemotron_pattern(p.pop("groups"), p.pop("mamba_per_group"))
    config = NemotronHConfig(
        hybrid_override_pattern=pattern,
        num_hidden_layers=len(pattern),  # older transformers check it against the pattern
        tie_word_embeddings=False,
        **p,
    )
    return _from_config(config, device, torch.bfloat16, seed)


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@dataclass(frozen=True)
class BenchBase:
    """The base and decoder on disk, plus the in-memory model the services serve."""

    base_dir: Path
    decoder_dir: Path
    model: nn.Module
    tokenizer: object
    identity: dict  # the digests of the saved files and lm_head, as the manifest holds them
    timings: dict  # seconds: build, save, digest, decoder


def build_base_and_decoder(
    scale: Scale, out: Path, device: str, *, seed: int = 0, dtype: torch.dtype | None = None
) -> BenchBase:
    """Build the base on `device`, save it (bf16) and a matching decoder under `out`.

    dtype: what the services run in (default bf16; float32 suits the CPU). The weights are
    bf16 values either way, so the lm_head digest is the same as the saved one's.
    """
    t = {}
    t0 = time.perf_counter()
    model = build_llama(scale, device, seed)
    sync(device)
    t["build_s"] = time.perf_counter() - t0
    base_dir, decoder_dir = out / "base", out / "decoder"
    tok = bench_tokenizer(scale.vocab_size)
    t0 = time.perf_counter()
    model.save_pretrained(str(base_dir), safe_serialization=True)
    tok.save_pretrained(str(base_dir))
    t["save_s"] = time.perf_counter() - t0
    if dtype is not None and dtype != torch.bfloat16:
        model = model.to(dtype)
    t0 = time.perf_counter()
    lm_head = lm_head_weight(model)
    identity = {
        "base_model_digest": ckpt.base_model_digest(base_dir),
        "tokenizer_digest": ckpt.tokenizer_digest(base_dir),
        "lm_head_digest": ckpt.tensor_digest(lm_head),
        "data_digest": "random-init",
    }
    t["digest_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    dcfg = ReadoutConfig(
        d_base=model.config.hidden_size,
        vocab_size=lm_head.shape[0],
        eos_token_id=tok.eos_token_id,
        **scale.decoder,
    )
    torch.manual_seed(seed + 1)
    decoder = ReadoutDecoder(dcfg)
    extra = {"bench": {"seed": seed, "params": n_params(decoder), "random_init": True}}
    ckpt.save_decoder(decoder_dir, decoder.eval(), identity, extra)
    t["decoder_s"] = time.perf_counter() - t0
    return BenchBase(base_dir, decoder_dir, model, tok, identity, t)


def serving_model(name: str, base: BenchBase) -> ServingModel:
    """What `load_serving_model` returns, for the in-memory model instead of a reload of the
    files. The digests are the ones taken right after saving (hashing 5.8 GB again would
    add seconds, not checks); the readout engine's `load_decoder` re-checks them anyway."""
    manifest = ckpt.read_manifest(base.decoder_dir)
    for key in ("base_model_digest", "tokenizer_digest", "lm_head_digest"):
        if manifest.get(key) != base.identity[key]:
            raise ckpt.DecoderMismatch(key, str(manifest.get(key)), base.identity[key])
    identity = ModelIdentity(
        model=name,
        base_model_digest=bytes.fromhex(base.identity["base_model_digest"]),
        lm_head_digest=bytes.fromhex(base.identity["lm_head_digest"]),
        decoder_digest=bytes.fromhex(manifest["decoder_digest"]),
    )
    lm_head = lm_head_weight(base.model)
    return ServingModel(
        name, base.model, base.tokenizer, lm_head, identity, manifest, base.base_dir,
        base.decoder_dir,
    )  # fmt: skip


def sync(device: str | torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
