"""Generate the Python code for protos/stateblock/v1: `python -m stateblock.tools.protogen`.

The generated modules are checked in (stateblock/v1/*_pb2*.py*) so that a clone imports
without grpcio-tools; tests/unit/protocol/test_protos.py regenerates into a temp dir and fails when the
checked-in files are stale. The output depends on the grpcio-tools version (its bundled
protoc and the GRPC_GENERATED_VERSION stamp), so regenerate after upgrading it.
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO_ROOT / "protos"
PACKAGE_DIR = Path("stateblock") / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files(proto_root: Path = PROTO_ROOT) -> list[Path]:
    """The .proto sources, relative to proto_root (the -I root), in a stable order."""
    return sorted(p.relative_to(proto_root) for p in (proto_root / PACKAGE_DIR).glob("*.proto"))


def generated_files(out_dir: Path) -> list[Path]:
    """The generated modules under out_dir, relative to it."""
    pkg = out_dir / PACKAGE_DIR
    return sorted(
        p.relative_to(out_dir) for p in pkg.iterdir() if p.name.endswith(GENERATED_SUFFIXES)
    )


def generate(out_dir: Path = REPO_ROOT, proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Run protoc (from grpcio-tools) over every proto; returns the generated paths."""
    from grpc_tools import protoc  # dev dependency: only generation needs it

    # protoc resolves google/protobuf/*.proto from the copy bundled with grpcio-tools.
    well_known = resources.files("grpc_tools") / "_proto"
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{proto_root}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--pyi_out={out_dir}",
        *(str(p) for p in proto_files(proto_root)),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return generated_files(out_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT, help="output root (default: repo)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(args.out / path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
