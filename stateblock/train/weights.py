"""The trainers' weight files: the base's fp32 checkpoint in safetensors parts of at most
15 MB (a resumable stage on this machine), `--init`'s start from one or from a saved base,
and every trainer's resume state (`save_state`, `read_state`, `restore`): the weights and
optimizer of a run stopped before its end, with its step and plan, so the next run goes on
where it stopped."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def save_state(where: Path, loadables: dict[str, Any], **fields: Any) -> None:
    """Each loadable's state_dict (a module's, an optimizer's) under its name, and `fields`,
    written beside and renamed into place: a run cut off while saving leaves the state
    before it, whole, or none."""
    where = Path(where)
    where.parent.mkdir(parents=True, exist_ok=True)
    tmp = where.with_name(where.name + ".tmp")
    torch.save({**{k: v.state_dict() for k, v in loadables.items()}, **fields}, tmp)
    tmp.replace(where)


def read_state(where: Path | None, device: Any) -> dict | None:
    """The state `save_state` wrote (None: none there, a fresh run), on `device`."""
    if where is None or not Path(where).is_file():
        return None
    return torch.load(where, map_location=device, weights_only=True)


def restore(state: dict, loadables: dict[str, Any]) -> dict:
    """Each loadable's state_dict loaded from its name in `state`; the other fields."""
    for name, target in loadables.items():
        target.load_state_dict(state[name])
    return {k: v for k, v in state.items() if k not in loadables}


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
