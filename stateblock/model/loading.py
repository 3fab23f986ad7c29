"""The pieces a service serves: base model, tokenizer, lm_head and the decoder's identity.

Capture signs blocks with this identity and readout workers refuse blocks captured for any
other, so both sides derive it the same way, from the files on disk.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor, nn

from stateblock.model.capture import capture, lm_head_weight
from stateblock.model.checkpoint import DecoderError, check_identity
from stateblock.protocol.envelope import ModelIdentity
from stateblock.protocol.manifest import decoder_manifest, reads_prompt_ids

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; one of {sorted(DTYPES)}")
    return DTYPES[name]


@dataclass(frozen=True)
class ServingModel:
    name: str
    model: nn.Module | None  # None in a readout worker: it needs the lm_head alone
    tokenizer: object | None
    lm_head: Tensor  # (V, d_base), the resident output embedding
    identity: ModelIdentity
    manifest: dict
    base_dir: Path
    decoder_dir: Path

    @property
    def hidden_size(self) -> int:
        return int(self.lm_head.shape[1])

    @property
    def reads_prompt_ids(self) -> bool:
        """Whether the decoder reads the prompt's token ids beside its rows: its blocks then
        carry them (Lane.prompt_token_ids)."""
        return reads_prompt_ids(self.manifest)

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.dtype

    def prompt_rows(self, prompt: str, pad_to: Callable[[int], int] | None = None) -> Tensor:
        """One prompt captured alone: its rows (P, d_base). `pad_to(P)` is the width the
        forward is right-padded to (the capture service's `bucket_width`, to get the rows it
        gets); the padding's rows are dropped. No mask, as in the service: the model is
        causal, so the padding never reaches the prompt's rows."""
        ids = self.tokenizer(prompt)["input_ids"]
        pad = self.tokenizer.pad_token_id or 0
        width = len(ids) if pad_to is None else pad_to(len(ids))
        x = torch.full((1, width), pad, dtype=torch.long)
        x[0, : len(ids)] = torch.tensor(ids)
        return capture(self.model, x.to(self.lm_head.device))[0, : len(ids)]


def load_base(base_dir: str | Path, device: str = "cpu", dtype=torch.float32):
    """(model, tokenizer) from a local directory; never reaches a hub."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not Path(base_dir).is_dir():
        raise FileNotFoundError(f"no base model directory {base_dir}")

    tok = AutoTokenizer.from_pretrained(str(base_dir), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        str(base_dir), local_files_only=True, dtype=dtype
    ).to(device)
    model.eval().requires_grad_(False)
    return model, tok


def load_serving_model(
    name: str,
    base_dir: str | Path,
    decoder_dir: str | Path,
    *,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    lm_head_only: bool = False,
) -> ServingModel:
    """Base model + tokenizer from a local directory, checked once against the decoder
    manifest (the capture's load, and the embedded stack's, which shares it with the
    readout). `lm_head_only`: what a readout worker needs, the lm_head read as one slice of
    the safetensors files, no backbone, no tokenizer."""
    manifest = decoder_manifest(decoder_dir)
    if lm_head_only:
        model, tok, lm_head = None, None, load_lm_head(base_dir, device=device, dtype=dtype)
    else:
        model, tok = load_base(base_dir, device=device, dtype=dtype)
        lm_head = lm_head_weight(model)
    identity = _identity(name, manifest, base_dir, lm_head)
    return ServingModel(
        name, model, tok, lm_head, identity, manifest, Path(base_dir), Path(decoder_dir)
    )


def load_readout_model(
    name: str, base_dir: str | Path, decoder_dir: str | Path, **kw
) -> ServingModel:
    """The lm_head alone, what a readout worker needs: `load_serving_model(..., lm_head_only=True)`."""
    return load_serving_model(name, base_dir, decoder_dir, lm_head_only=True, **kw)


class ModelConfig(Protocol):
    """What a service's config says of the model it serves (the capture's, the readout's)."""

    @property
    def model_name(self) -> str: ...
    @property
    def base_dir(self) -> Path: ...
    @property
    def decoder_dir(self) -> Path: ...
    @property
    def device(self) -> str: ...


async def load_service_model(
    config: ModelConfig, *, dtype: torch.dtype = torch.float32, lm_head_only: bool = False
) -> ServingModel:
    """The model a service's config names, loaded off the event loop at start-up."""
    return await asyncio.to_thread(
        load_serving_model,
        config.model_name,
        config.base_dir,
        config.decoder_dir,
        device=config.device,
        dtype=dtype,
        lm_head_only=lm_head_only,
    )


def _identity(name: str, manifest: dict, base_dir: str | Path, lm_head: Tensor) -> ModelIdentity:
    actual = check_identity(manifest, base_dir, lm_head)
    return ModelIdentity(
        model=name,
        base_model_digest=bytes.fromhex(actual["base_model_digest"]),
        lm_head_digest=bytes.fromhex(actual["lm_head_digest"]),
        decoder_digest=bytes.fromhex(manifest["decoder_digest"]),
    )


def load_lm_head(base_dir: str | Path, *, device: str = "cpu", dtype=torch.float32) -> Tensor:
    """The output embedding (V, d_base) from the base model's safetensors, nothing else read:
    `lm_head.weight`, or the input embedding when the config ties the two."""
    from safetensors import safe_open

    d = Path(base_dir)
    if not d.is_dir():
        raise FileNotFoundError(f"no base model directory {base_dir}")
    config = json.loads((d / "config.json").read_text())
    names = ["lm_head.weight"]
    if config.get("tie_word_embeddings", True):  # transformers' default when unset
        names.append("model.embed_tokens.weight")
    files = sorted(d.glob("*.safetensors"))
    for name in names:
        for path in files:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                if name in f.keys():
                    weight = f.get_tensor(name)
                    return weight.to(device=device, dtype=dtype).requires_grad_(False)
    raise DecoderError(f"no {' or '.join(names)} in the safetensors files of {d}")
