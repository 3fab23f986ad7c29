"""Declared dependencies match the imports: every third-party module product code imports
is a declared dependency (serving) or in an extra; serving imports none of the extras."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib

from tests.helpers import REPO
from tests.unit.test_layers import product_files

# import name -> distribution name, where they differ
DIST_OF = {
    "google": "protobuf",
    "grpc": "grpcio",
    "grpc_health": "grpcio-health-checking",
    "grpc_reflection": "grpcio-reflection",
    "grpc_tools": "grpcio-tools",
    "nats": "nats-py",
    "prometheus_client": "prometheus-client",
    "yaml": "pyyaml",
}
OPTIONAL_EXTRAS = ("train", "export", "tensorrt")
# shipped by a declared dependency's own build (torch's CUDA wheels carry triton); imported
# behind a guard that falls back when it is absent
BUNDLED = {"triton"}


def _dist(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].strip().lower()


def declared() -> tuple[set[str], dict[str, set[str]]]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    core = {_dist(r) for r in project["dependencies"]}
    extras = {k: {_dist(r) for r in v} for k, v in project["optional-dependencies"].items()}
    return core, extras


def third_party_imports() -> set[str]:
    stdlib = set(sys.stdlib_module_names)
    ours = {"stateblock", "gateway", "capture_svc", "readout_svc", "registry", "bench", "tests"}
    found = set()
    for path in product_files():
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            found |= {n.split(".")[0] for n in names}
    return {n for n in found if n not in stdlib and n not in ours and n != "__future__"}


def test_every_imported_module_is_declared():
    core, extras = declared()
    anywhere = core.union(*extras.values())
    missing = sorted(
        m
        for m in third_party_imports() - BUNDLED
        if DIST_OF.get(m, m).replace("_", "-") not in anywhere
    )
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"


def test_serving_needs_none_of_the_extras():
    core, extras = declared()
    for name in OPTIONAL_EXTRAS:
        assert not (core & extras[name]), name
    assert {"matplotlib", "onnx", "tqdm"} <= extras["train"] | extras["export"]
    blocked = "".join(f"sys.modules[{m!r}] = None\n" for m in ("matplotlib", "onnx", "tqdm"))
    code = (
        "import sys\n" + blocked + "import gateway.server, capture_svc.server, readout_svc.server\n"
        "import stateblock.engines.onnx_engine, stateblock.engines.torch_engine\n"
        "from stateblock.app import stack\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr


def test_a_command_that_needs_an_extra_says_which(monkeypatch, capsys):
    from stateblock.app import cli, cli_models

    def needs_tqdm(_args):
        raise ModuleNotFoundError("No module named 'tqdm'", name="tqdm")

    monkeypatch.setattr(cli_models, "cmd_eval", needs_tqdm)
    parser = cli.build_parser
    monkeypatch.setattr(
        cli,
        "build_parser",
        lambda: _with_fn(parser(), "eval", needs_tqdm),
    )
    assert cli.main(["eval"]) == 2
    assert "pip install 'stateblock[train]'" in capsys.readouterr().err


def _with_fn(parser, command, fn):
    parser._subparsers._group_actions[0].choices[command].set_defaults(fn=fn)
    return parser


def test_every_cli_flag_has_help_and_shows_its_default():
    import argparse

    from stateblock.app.cli import build_parser

    def parsers(p):
        yield p
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    yield from parsers(sub)

    for parser in parsers(build_parser()):
        assert parser.formatter_class is argparse.ArgumentDefaultsHelpFormatter, parser.prog
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                continue
            assert action.help, f"{parser.prog} {action.dest} has no help"


def test_the_reference_pair_ships_as_package_data():
    """Every file of the reference pair that git tracks is matched by `stateblock`'s package
    data globs (so the wheel carries it), and the package finds the pair in this checkout."""
    from stateblock import runtime

    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    package = REPO / "stateblock"
    shipped = {
        p.relative_to(package).as_posix()
        for pattern in setuptools["package-data"]["stateblock"]
        for p in package.glob(pattern)
    }
    tracked = subprocess.run(
        ["git", "ls-files", "models/reference"], capture_output=True, text=True, cwd=REPO
    ).stdout.split()
    assert "models/reference/base/model.safetensors" in tracked
    missing = {f.removeprefix("models/") for f in tracked} - shipped
    assert not missing, f"tracked but left out of the wheel: {sorted(missing)}"
    assert runtime.REFERENCE_BASE == package / "reference" / "base"
    assert runtime.REFERENCE.resolve() == (REPO / "models" / "reference").resolve()
