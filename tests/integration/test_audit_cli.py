"""`stateblock audit` from the command line: `--engine onnx` in one command with `--export`,
and fail-closed without a graph; the torch engine's bf16 fast path by `--greedy-dtype`."""

from __future__ import annotations

import json
import shutil

from stateblock.app.cli import main


def test_onnx_audit_exports_when_asked_and_fails_closed_otherwise(decoder_dir, tmp_path, capsys):
    decoder = tmp_path / "decoder"
    shutil.copytree(decoder_dir, decoder, ignore=shutil.ignore_patterns("readout.onnx*"))
    args = ["audit", "--engine", "onnx", "--decoder", str(decoder), "--device", "cpu"]
    args += ["--depths", "8,24", "--n-prompts", "3", "--lanes", "3"]

    assert main(args) == 1  # no graph beside the decoder: the engine refuses to load
    assert "did not load" in capsys.readouterr().err
    assert not (decoder / "readout.onnx").exists()

    assert main([*args, "--export"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)  # stdout is the report alone
    assert report["engine"] == "onnx" and report["gate"] == "PASS", report["blockers"]
    assert set(report["depths"]) == {"8", "24"}
    assert (decoder / "readout.onnx").exists() and (decoder / "readout.onnx.json").exists()
    assert "exported" in captured.err


def test_the_torch_fast_path_is_audited_by_its_serving_setting(capsys):
    args = ["audit", "--device", "cpu", "--depths", "16", "--n-prompts", "2", "--lanes", "2"]
    assert main([*args, "--engine", "onnx", "--greedy-dtype", "bfloat16"]) == 2  # torch only
    assert "--greedy-dtype applies to the torch engine" in capsys.readouterr().err

    assert main([*args, "--engine", "torch", "--greedy-dtype", "bfloat16"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["engine"] == "torch" and report["gate"] == "PASS", report["blockers"]
    assert report["settings"]["engine_options"] == {"greedy_dtype": "bfloat16"}
