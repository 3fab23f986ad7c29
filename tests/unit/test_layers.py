"""The import layering of docs/ARCHITECTURE.md, kept by reading every product module's imports.

AST-based (nothing is imported), so it also sees imports inside functions. A planted upward
import fails it (see test_a_planted_upward_import_is_caught).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SERVICES = ("gateway", "capture_svc", "readout_svc")
PRODUCT = ("stateblock", *SERVICES, "registry")

# What each layer may import from the project, innermost first. `stateblock.v1` (generated
# from protos/stateblock/v1, whose proto package fixes that import path) belongs to protocol.
CORE_BELOW = {
    "protocol": {"protocol"},
    "runtime": {"protocol", "runtime"},
    "model": {"protocol", "model"},
    "engines": {"protocol", "model", "engines"},
    "train": {"protocol", "model", "engines", "train"},
    "tools": {"protocol", "runtime", "model", "engines", "train", "tools"},
    "app": {"protocol", "runtime", "model", "engines", "train", "tools", "app", "services"},
    "registry": {"protocol", "runtime"},
}
SERVICE_MAY = {
    "gateway": {"protocol", "runtime"},  # no torch: protocol is the gateway's whole core
    "capture_svc": {"protocol", "runtime", "model"},
    "readout_svc": {"protocol", "runtime", "model", "engines"},
}
TORCH_FREE = {"protocol", "runtime", "registry", "gateway"}
HEAVY = ("torch", "numpy", "transformers", "triton", "onnx", "onnxruntime", "safetensors")


def layer_of(module: str) -> str | None:
    """The layer a dotted module name belongs to (None: not project code)."""
    parts = module.split(".")
    top = parts[0]
    if top in SERVICES:
        return top
    if top == "registry":
        return "registry"
    if top == "bench":
        return "bench"
    if top != "stateblock":
        return None
    if len(parts) == 1:
        return "root"
    sub = parts[1]
    if sub == "v1":
        return "protocol"
    if sub in ("nats_client", "settings", "service_config"):  # the services' NATS, settings
        return "runtime"
    return sub if sub in CORE_BELOW else "root"


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) for every import in the file, relative ones resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                stem = package[: len(package) - node.level + 1]
                base = ".".join([*stem, base] if base else stem)
            out.append((node.lineno, base))
            # `from stateblock import protocol` names a subpackage: check that too
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names if base in PRODUCT]
    return out


def violations(path: Path) -> list[str]:
    src = layer_of(module_name(path))
    bad: list[str] = []
    flagged: set[int] = set()  # one finding per import statement
    for line, mod in imports_of(path):
        if line in flagged:
            continue
        top = mod.split(".")[0]
        where = f"{path.relative_to(REPO)}:{line} imports {mod}"
        if top == "bench":
            bad.append(f"{where}: product code never imports bench")
            flagged.add(line)
            continue
        if top in HEAVY and src in TORCH_FREE:
            bad.append(f"{where}: the {src} layer is torch-free")
            flagged.add(line)
            continue
        dst = layer_of(mod)
        if dst is None or dst == "root" or dst == src:
            continue
        if src in SERVICES:
            allowed = SERVICE_MAY[src] | {"registry"}
        elif src == "registry":
            allowed = CORE_BELOW["registry"]
        else:
            allowed = CORE_BELOW.get(src, set())
            if "services" in allowed:
                allowed = allowed | set(SERVICES) | {"registry"}
        if dst not in allowed:
            bad.append(f"{where}: {src} may import only {sorted(allowed)}")
            flagged.add(line)
    return bad


def product_files() -> list[Path]:
    files = [p for top in PRODUCT for p in (REPO / top).rglob("*.py")]
    return sorted(p for p in files if not p.name.endswith(("_pb2.py", "_pb2_grpc.py")))


def test_every_product_import_goes_down_the_layers():
    bad = [v for p in product_files() for v in violations(p)]
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def test_every_product_module_has_a_layer():
    orphans = [
        str(p.relative_to(REPO))
        for p in product_files()
        if layer_of(module_name(p)) == "root" and p.parent != REPO / "stateblock"
    ]
    assert not orphans


@pytest.mark.parametrize(
    ("where", "planted", "why"),
    [
        ("stateblock/model/planted.py", "from stateblock.engines import base", "model may"),
        ("stateblock/protocol/planted.py", "import torch", "torch-free"),
        ("gateway/planted.py", "from readout_svc import worker", "gateway may"),
        ("stateblock/engines/planted.py", "from readout_svc import worker", "engines may"),
        ("stateblock/tools/planted.py", "import bench.stack", "never imports bench"),
        ("registry/planted.py", "from stateblock.model import vocab", "registry may"),
        ("stateblock/protocol/planted.py", "from ..model import vocab", "protocol may"),
    ],
)
def test_a_planted_upward_import_is_caught(where, planted, why):
    path = REPO / where
    assert not path.exists()
    path.write_text(planted + "\n")
    try:
        found = violations(path)
    finally:
        path.unlink()
    assert len(found) == 1 and why in found[0], found


def test_the_gateway_and_the_protocol_import_without_torch():
    """In a fresh interpreter where importing torch (or transformers) fails."""
    code = (
        "import sys\n"
        "for name in ('torch', 'transformers', 'numpy', 'triton', 'onnxruntime'):\n"
        "    sys.modules[name] = None\n"
        "import gateway.server, gateway.http, gateway.grpc_server, registry\n"
        "import stateblock.protocol.envelope, stateblock.protocol.manifest\n"
        "import stateblock.protocol.streams, stateblock.protocol.keys, stateblock.runtime\n"
        "from gateway.detokenizer import Detokenizer\n"
        f"print(Detokenizer.load({str(REPO / 'models/reference/base')!r}).decode([5]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "copy:"
