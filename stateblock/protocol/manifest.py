"""Decoder manifests: the files that bind a readout decoder to one base model, read
without torch (the gateway reads its default max_tokens from one).

A readout decoder is only meaningful against the exact base model, lm_head and tokenizer
it was distilled from; stateblock.model.checkpoint loads it only when these match.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

WEIGHTS = "decoder.safetensors"
MANIFEST = "manifest.json"
FORMAT = "stateblock-readout-decoder/1"


class DecoderError(Exception):
    """A decoder checkpoint cannot be used."""


class DecoderMismatch(DecoderError):
    def __init__(self, field: str, expected: str, actual: str) -> None:
        super().__init__(
            f"readout decoder does not match the loaded base model: {field} is {actual[:16]}..., "
            f"the decoder was distilled against {expected[:16]}... (retrain with `stateblock train`)"
        )
        self.field = field


def sha_files(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.name.encode() + b"\0")
        with p.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def base_model_digest(base_dir: str | Path) -> str:
    """SHA-256 over the base model's config and weight files, in name order."""
    d = Path(base_dir)
    files = sorted([d / "config.json", *d.glob("*.safetensors"), *d.glob("*.bin")])
    if not files[1:]:
        raise DecoderError(f"no weight files in {d}")
    return sha_files(files)


def tokenizer_digest(base_dir: str | Path) -> str:
    d = Path(base_dir)
    return sha_files(sorted(p for p in d.glob("tokenizer*.json") if p.is_file()))


def decoder_digest(decoder_dir: str | Path) -> str:
    return sha_files([Path(decoder_dir) / WEIGHTS])


def read_manifest(decoder_dir: str | Path) -> dict:
    path = Path(decoder_dir) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DecoderError(f"cannot read decoder manifest {path}: {e}") from e
    if manifest.get("format") != FORMAT:
        raise DecoderError(f"{path}: unknown format {manifest.get('format')!r}")
    return manifest


def decoder_manifest(decoder_dir: str | Path) -> dict:
    """The manifest, with a start-up message that says what to do when it is missing."""
    if not (Path(decoder_dir) / MANIFEST).exists():
        raise DecoderError(
            f"no readout decoder at {decoder_dir} (manifest.json missing): build one with "
            "`stateblock build-reference` or `stateblock train`, or set STATEBLOCK_DECODER_DIR"
        )
    return read_manifest(decoder_dir)


def reads_prompt_ids(manifest: dict) -> bool:
    """Whether the decoder reads the prompt's token ids beside its rows (a copy head, or rows
    that carry their tokens): its blocks then carry them, and only some engines serve it."""
    cfg = manifest.get("decoder_config", {})
    return bool(cfg.get("copy") or cfg.get("row_tokens"))


def default_max_tokens(manifest: dict, answer_depth_max: int) -> int:
    """The depth read when a request does not say: what the decoder was trained to serve."""
    trained = manifest.get("training", {}).get("config", {}).get("max_answer")
    return min(int(trained), answer_depth_max) if trained else answer_depth_max
