"""The base trainer's weight files: its fp32 checkpoint in safetensors parts of at most 15 MB
(a resumable stage on this machine), and `--init`'s start from one or from a saved base."""

from __future__ import annotations

from pathlib import Path


def save_split(state, prefix: Path, max_bytes=15 * 2**20):
    from safetensors.torch import save_file

    parts, cur, size = [], {}, 0
    for k, v in state.items():
        nb = v.numel() * v.element_size()
        if cur and size + nb > max_bytes:
            parts.append(cur)
            cur, size = {}, 0
        cur[k] = v.contiguous()
        size += nb
    parts.append(cur)
    for j, p in enumerate(parts):
        save_file(p, str(prefix) + f".part{j}.safetensors")
    return len(parts)


def load_split(prefix: Path):
    from safetensors.torch import load_file

    st = {}
    for f in sorted(prefix.parent.glob(prefix.name + ".part*.safetensors")):
        st.update(load_file(str(f)))
    return st


def init_weights(path: Path) -> dict:
    """--init: an fp32 split checkpoint prefix (a stage on this machine), or a saved base
    directory (its bf16 weights, upcast: a stage from the shipped base, on any machine)."""
    if path.is_dir():
        from safetensors.torch import load_file

        return {k: v.float() for k, v in load_file(str(path / "model.safetensors")).items()}
    return load_split(path)
