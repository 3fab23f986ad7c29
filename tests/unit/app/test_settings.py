"""One configuration: every STATEBLOCK_* setting declared once (stateblock/settings.py), each
service and `stateblock up` read exactly what the declarations say they read, `up` takes
the variables as its flags' defaults (a flag wins), `stateblock config` prints what each
would start with, and the README's configuration table is the generated one."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from stateblock import settings as declared
from stateblock.app import cli, settings
from stateblock.nats_client import NatsOptions
from stateblock.runtime import event_loop_choice
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


class Recording(dict):
    """An environ mapping that records every name looked up."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.read: set[str] = set()

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)


def _read_by(component: str) -> set[str]:
    """Every name `component` looks up at start-up: its config, its NATS connection's files
    and its event loop."""
    env = Recording()
    if component == "up":
        settings.up_defaults(env)
    else:
        settings._service_configs()[component].from_env(env)
    NatsOptions.of("nats://127.0.0.1:4222", env)
    event_loop_choice(env)
    return env.read


@pytest.mark.parametrize("component", ["gateway", "capture", "readout", "up"])
def test_each_component_reads_exactly_its_declared_settings(component):
    mine = [s for s in declared.SETTINGS if component in s.readers]
    expected = {s.name for s in mine} | {s.fallback.name for s in mine if s.fallback}
    assert _read_by(component) == expected


def test_every_declaration_is_read_and_well_formed():
    names = [s.name for s in declared.SETTINGS]
    assert len(names) == len(set(names)) == len(declared.BY_NAME)
    readers = {"gateway", "capture", "readout", "up", "ask"}
    for s in declared.SETTINGS:
        assert s.name.startswith("STATEBLOCK_") and s.help and s.readers, s.name
        assert set(s.readers) <= readers and s.type in (str, int, float, Path, tuple), s.name
        assert set(s.defaults) <= set(s.readers), s.name
    read = set().union(*(_read_by(c) for c in ("gateway", "capture", "readout", "up")))
    assert read | {"STATEBLOCK_API_KEY"} == set(names)  # `ask` reads the API key alone


def test_a_setting_reads_its_type_bounds_and_per_reader_default():
    s = declared
    assert s.HTTP_PORT.read({"STATEBLOCK_HTTP_PORT": "0"}) == 0
    with pytest.raises(settings.ConfigError, match="STATEBLOCK_WORKERS=0 is below 1"):
        s.WORKERS.read({"STATEBLOCK_WORKERS": "0"}, "readout")
    with pytest.raises(settings.ConfigError, match="STATEBLOCK_LEASE_S=0.0 must be positive"):
        s.LEASE_S.read({"STATEBLOCK_LEASE_S": "0"}, "readout")
    assert s.BATCH_WINDOW_S.read({"STATEBLOCK_BATCH_WINDOW_S": "0"}, "capture") == 0.0
    assert s.CAPTURE_METRICS_PORT.read({"STATEBLOCK_CAPTURE_METRICS_PORT": "-1"}) is None
    assert s.CAPTURE_METRICS_PORT.read({"STATEBLOCK_CAPTURE_METRICS_PORT": "9"}) == 9
    assert (s.LOG_LEVEL.read({}, "up"), s.LOG_LEVEL.read({}, "capture")) == ("warning", "info")
    assert s.READOUT_TRUSTED_KEYS_DIR.read({}, "readout") is None
    assert s.READOUT_TRUSTED_KEYS_DIR.read({}, "gateway") == Path("readout-keys")
    # an unset variable falls back to another before the default
    assert s.TRUSTED_KEYS_DIR.read({"STATEBLOCK_KEY_DIR": "k"}, "readout") == Path("k")
    env = {"STATEBLOCK_KEY_DIR": "k", "STATEBLOCK_TRUSTED_KEYS_DIR": "t"}
    assert s.TRUSTED_KEYS_DIR.read(env, "readout") == Path("t")
    with pytest.raises(ValueError, match="not declared as read by capture"):
        s.HTTP_PORT.field("capture")


def test_the_limits_are_one_declaration_for_every_service():
    env = {"STATEBLOCK_MAX_LANES": "3", "STATEBLOCK_PROMPT_LEN_MAX": "99"}
    configs = [cls.from_env(env) for cls in settings._service_configs().values()]
    assert {(c.limits.max_lanes, c.limits.prompt_len_max) for c in configs} == {(3, 99)}
    assert {c.limits.answer_depth_max for c in configs} == {8192}


def test_the_readme_table_is_the_generated_one(capsys):
    text = (REPO / "README.md").read_text()
    table = declared.markdown_table()
    assert table in text, "regenerate it: stateblock config --markdown"
    rows = [line for line in text.splitlines() if line.startswith("| `STATEBLOCK_")]
    assert len(rows) == len(declared.SETTINGS)  # no hand-written row beside it
    assert cli.main(["config", "--markdown"]) == 0
    assert capsys.readouterr().out == table


def test_up_flags_are_the_settings_up_reads():
    parser = cli.build_parser()
    up = parser._subparsers._group_actions[0].choices["up"]
    flags = {a.dest: a for a in up._actions if a.dest not in ("help", "ask")}
    assert set(flags) == {f.name for f in dataclasses.fields(settings.UpFlags)}
    assert "$STATEBLOCK_BASE_DIR" in flags["base"].help and flags["http_port"].type is int


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
