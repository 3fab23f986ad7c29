"""Every trainer's resume state: written whole or not at all, read back into fresh modules
and optimizers with the fields beside them, and none for a fresh run."""

from __future__ import annotations

import pytest
import torch

from stateblock.train.weights import read_state, restore, save_state


def trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(3):
        model(torch.randn(5, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_a_saved_state_restores_the_weights_the_optimizer_and_the_fields(tmp_path):
    model, opt = trained(0)
    where = tmp_path / "run" / "state.pt"
    save_state(where, {"model": model, "opt": opt}, step=3, total=10, losses=[1.0, 0.5])
    assert [p.name for p in where.parent.iterdir()] == ["state.pt"]  # no .tmp left
    fresh, fresh_opt = trained(1)
    fields = restore(read_state(where, "cpu"), {"model": fresh, "opt": fresh_opt})
    assert fields == {"step": 3, "total": 10, "losses": [1.0, 0.5]}
    assert torch.equal(fresh.weight, model.weight)
    saved = opt.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], saved)


def test_a_fresh_run_has_no_state(tmp_path):
    assert read_state(tmp_path / "state.pt", "cpu") is None
    assert read_state(None, "cpu") is None


def test_a_save_cut_off_leaves_the_state_before_it(tmp_path, monkeypatch):
    model, opt = trained(0)
    where = tmp_path / "state.pt"
    save_state(where, {"model": model, "opt": opt}, step=3)

    def cut_off(obj, f):
        open(f, "wb").write(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", cut_off)
    with pytest.raises(OSError, match="disk full"):
        save_state(where, {"model": model, "opt": opt}, step=4)
    monkeypatch.undo()
    assert read_state(where, "cpu")["step"] == 3
