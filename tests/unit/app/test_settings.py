"""One configuration: `stateblock up` takes the services' STATEBLOCK_* variables as its
defaults (a flag wins), `stateblock config` prints what each would start with, and the
README's configuration table lists exactly the variables the code reads."""

from __future__ import annotations

import json
import re

import pytest

from stateblock.app import cli, settings
from tests.helpers import REPO


def test_up_flags_default_to_the_services_variables():
    d = settings.up_defaults({"STATEBLOCK_HTTP_PORT": "9001", "STATEBLOCK_ENGINE": "onnx",
                              "STATEBLOCK_NATS_URL": "nats://a:4222"})  # fmt: skip
    assert (d["http_port"], d["engine"], d["nats_url"]) == (9001, "onnx", "nats://a:4222")
    assert (
        settings.up_defaults({})["http_port"] == 8000
        and settings.up_defaults({})["nats_url"] is None
    )
    with pytest.raises(settings.ConfigError, match="STATEBLOCK_WORKERS"):
        settings.up_defaults({"STATEBLOCK_WORKERS": "0"})


def test_up_refuses_an_unusable_variable_in_one_line(monkeypatch, capsys):
    monkeypatch.setenv("STATEBLOCK_HTTP_PORT", "eighty")
    assert cli.main(["up"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "stateblock up: STATEBLOCK_HTTP_PORT='eighty' is not an integer"


def test_a_flag_beats_its_variable(monkeypatch):
    seen = {}
    monkeypatch.setenv("STATEBLOCK_HTTP_PORT", "9002")
    monkeypatch.setenv("STATEBLOCK_MODEL_NAME", "from-env")

    class Stop(Exception):
        pass

    def fake_config(**kw):
        seen.update(kw)
        raise Stop

    monkeypatch.setattr("stateblock.app.stack.UpConfig", fake_config)
    with pytest.raises(Stop):
        cli.main(["up", "--http-port", "9003"])
    assert seen["http_port"] == 9003 and seen["model_name"] == "from-env"


def test_config_prints_every_service_and_names_a_bad_variable(monkeypatch, capsys):
    monkeypatch.setenv("STATEBLOCK_API_KEY", "hunter2")
    monkeypatch.setenv("STATEBLOCK_LEASE_S", "12")
    assert cli.main(["config"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"up", "gateway", "capture", "readout"}
    assert out["readout"]["lease_s"] == 12.0
    assert out["gateway"]["api_key"] == "(set)" and "hunter2" not in json.dumps(out)
    monkeypatch.setenv("STATEBLOCK_ACK_WAIT_S", "-1")
    assert cli.main(["config", "--service", "readout"]) == 2
    out = json.loads(capsys.readouterr().out)
    assert list(out) == ["readout"] and "STATEBLOCK_ACK_WAIT_S" in out["readout"]["error"]


def test_the_readme_table_lists_exactly_what_the_code_reads():
    text = (REPO / "README.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `STATEBLOCK_")]
    documented = {name for row in rows for name in re.findall(r"`(STATEBLOCK_[A-Z0-9_]+)`", row)}
    read = settings.variables_read()
    assert read - documented == set(), "read by the code, missing from the README table"
    assert documented - read == set(), "in the README table, read by nothing"


def test_every_cli_option_has_help():
    """Every flag of every command says what it is (and, with the formatter, its default)."""
    import argparse

    def actions(parser):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    yield from ((f"{name} {a}", h) for a, h in actions(child))
            if not isinstance(action, argparse._HelpAction):
                yield action.dest, action.help

    missing = [dest for dest, help_ in actions(cli.build_parser()) if not help_]
    assert missing == []
