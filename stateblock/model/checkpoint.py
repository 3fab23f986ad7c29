"""Decoder checkpoints: safetensors plus a manifest (stateblock.protocol.manifest) that
binds them to one base model.

A readout decoder is only meaningful against the exact base model, lm_head and tokenizer
it was distilled from; loading it against anything else raises DecoderMismatch instead of
producing fluent nonsense.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from stateblock.model.decoder import ReadoutConfig, ReadoutDecoder
from stateblock.protocol.manifest import (  # noqa: F401  (re-exported: the checkpoint's names)
    FORMAT,
    MANIFEST,
    WEIGHTS,
    DecoderError,
    DecoderMismatch,
    base_model_digest,
    decoder_digest,
    read_manifest,
    sha_files,
    tokenizer_digest,
)


def tensor_digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's values as float32, row block by row block: the same digest
    whatever dtype or device the weights were loaded in, as long as the values are equal."""
    h = hashlib.sha256(str(tuple(t.shape)).encode())
    flat = t.detach().reshape(t.shape[0], -1)
    for lo in range(0, flat.shape[0], 4096):
        h.update(flat[lo : lo + 4096].to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def save_decoder(out_dir: str | Path, decoder: ReadoutDecoder, identity: dict, extra: dict) -> None:
    """identity: base_model_digest, lm_head_digest, tokenizer_digest, data_digest."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {  # weights in bf16; integer tables (a copy head's twins) as they are
        k: v.detach().to("cpu", torch.bfloat16 if v.is_floating_point() else v.dtype).contiguous()
        for k, v in decoder.state_dict().items()
    }
    save_file(state, str(out / WEIGHTS))
    manifest = {"format": FORMAT, "decoder_config": decoder.cfg.to_dict(), **identity, **extra}
    manifest["decoder_digest"] = decoder_digest(out)
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def load_decoder(
    decoder_dir: str | Path,
    *,
    base_dir: str | Path,
    lm_head: torch.Tensor,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> tuple[ReadoutDecoder, dict]:
    """The decoder, after checking its manifest against the base model it will serve."""
    manifest = read_manifest(decoder_dir)
    check_identity(manifest, base_dir, lm_head)
    return build_decoder(decoder_dir, manifest, device=device, dtype=dtype), manifest


def check_identity(manifest: dict, base_dir: str | Path, lm_head: torch.Tensor) -> dict[str, str]:
    """Raise DecoderMismatch unless the manifest names this base model, tokenizer and
    lm_head; returns their digests (hex)."""
    actual = {
        "base_model_digest": base_model_digest(base_dir),
        "tokenizer_digest": tokenizer_digest(base_dir),
        "lm_head_digest": tensor_digest(lm_head),
    }
    for field, value in actual.items():
        if manifest.get(field) != value:
            raise DecoderMismatch(field, str(manifest.get(field)), value)
    return actual


def build_decoder(
    decoder_dir: str | Path,
    manifest: dict,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> ReadoutDecoder:
    """The decoder of a manifest whose identity was checked (`check_identity`); its weights
    must match the manifest's digest."""
    if decoder_digest(decoder_dir) != manifest.get("decoder_digest"):
        raise DecoderError(f"{decoder_dir}: {WEIGHTS} does not match its manifest digest")
    decoder = ReadoutDecoder(ReadoutConfig.from_dict(manifest["decoder_config"]))
    decoder.load_state_dict(load_file(str(Path(decoder_dir) / WEIGHTS)))
    return decoder.to(device=device, dtype=dtype).eval().requires_grad_(False)
