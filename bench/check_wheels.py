"""Check, here, that the carried wheels + the GPU image's packages cover the bench's imports.

No Python 3.12 here to rehearse the GPU machine's environment, so this checks the two
things that break an offline install there:
1. every wheel's install requirements (for CPython 3.12 on x86-64 Linux) are carried or
   in the image;
2. every distribution that importing the stack and the bench loads (in this .venv) is
   carried, in the image, or part of the repo / the standard library; with --dry-run, after
   a tiny CPU run of bench.e2e_gpu, so the imports made at run time count too.
`python -m bench.check_wheels --wheels .whl [--dry-run]`; exits 1 on a gap.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import re
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement

KINDS = Path("/work/.library/device/KINDS.md")
# What the GPU image has that matters here, if KINDS.md is not readable.
IMAGE_FALLBACK = (
    "torch triton transformers tokenizers safetensors numpy tqdm huggingface-hub hf-xet "
    "filelock fsspec packaging pyyaml regex requests jinja2 markupsafe sympy mpmath "
    "networkx typing-extensions onnx onnxruntime urllib3 charset-normalizer"
).split()
PROJECT = {"stateblock", "gateway", "capture_svc", "readout_svc", "registry", "bench", "tests"}
# Loaded here but optional where they are imported, or not a distribution at all.
OPTIONAL = {
    "grpcio-tools": "grpc tries grpc_tools for runtime protos; only protogen needs it",
    "?cython-runtime": "a module every Cython extension creates",
}
STACK_MODULES = (
    "gateway.server",
    "capture_svc.server",
    "readout_svc.server",
    "registry",
    "stateblock.app.stack",
    "stateblock.app.cli",
    "bench.e2e_gpu",
)
# Requirement markers as the GPU machine evaluates them.
TARGET_ENV = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "extra": "",
}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages(kinds: Path) -> set[str]:
    try:
        text = kinds.read_text()
    except OSError:
        return {norm(n) for n in IMAGE_FALLBACK}
    line = next(x for x in text.splitlines() if x.startswith("Packages: ") or " Packages: " in x)
    names = line.split("Packages: ", 1)[1].rstrip(".").split(",")
    return {norm(n.strip()) for n in names if n.strip()}


def wheel_metadata(path: Path) -> tuple[str, str, list[str]]:
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        msg = Parser().parsestr(z.read(meta).decode())
    return norm(msg["Name"]), msg["Version"], msg.get_all("Requires-Dist") or []


def needed(req: str) -> str | None:
    r = Requirement(req)
    if r.marker is not None and not r.marker.evaluate(TARGET_ENV):
        return None  # an extra, or another Python / platform
    return norm(r.name)


def image_side(image: set[str]) -> dict[str, str]:
    """Distributions this .venv has only because an image package needs them (transitively):
    dist -> that image package. The image's own versions bring their own dependencies."""
    out: dict[str, str] = {}
    todo = [(name, name) for name in image]
    while todo:
        name, root = todo.pop()
        try:
            reqs = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        for r in reqs:
            dep = needed(r)
            if dep is not None and dep not in out and dep not in image:
                out[dep] = root
                todo.append((dep, root))
    return out


def loaded_distributions(dry_run: bool) -> dict[str, set[str]]:
    """distribution -> top-level modules of it that importing (and running) the stack loaded."""
    for name in STACK_MODULES:
        importlib.import_module(name)
    if dry_run:
        import tempfile

        from bench import e2e_gpu

        with tempfile.TemporaryDirectory(prefix="check-wheels-") as tmp:
            e2e_gpu.main(["--out", tmp, "--scale", "tiny", "--engine", "reference", "--n", "2",
                          "--warmup", "1", "--device", "cpu"])  # fmt: skip
    owners = md.packages_distributions()
    stdlib = set(sys.stdlib_module_names)
    out: dict[str, set[str]] = {}
    for mod in list(sys.modules):
        top = mod.split(".")[0]
        if top in stdlib or top in PROJECT or top.startswith("_"):
            continue
        for dist in owners.get(top, [f"?{top}"]):
            out.setdefault(norm(dist), set()).add(top)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheels", type=Path, default=Path(".whl"))
    ap.add_argument("--kinds", type=Path, default=KINDS, help="KINDS.md with the image's list")
    ap.add_argument("--dry-run", action="store_true", help="run a tiny e2e first (~15 s)")
    args = ap.parse_args()
    image = image_packages(args.kinds)
    carried: dict[str, str] = {}
    gaps: list[str] = []
    requires: dict[str, list[str]] = {}
    for whl in sorted(args.wheels.glob("*.whl")):
        name, version, reqs = wheel_metadata(whl)
        if name in carried:
            gaps.append(f"two versions of {name}: {carried[name]} and {version}")
        carried[name] = version
        requires[name] = [n for n in map(needed, reqs) if n is not None]
    for name, reqs in requires.items():
        for r in reqs:
            if r not in carried and r not in image:
                gaps.append(f"{name} requires {r}: neither carried nor in the image")
    via_image = image_side(image)
    for dist, mods in sorted(loaded_distributions(args.dry_run).items()):
        if dist in OPTIONAL:
            print(f"optional, not carried: {dist} ({OPTIONAL[dist]})")
        elif dist in via_image and dist not in carried:
            print(f"image side: {dist} (a dependency of {via_image[dist]} in this .venv)")
        elif dist.startswith("?"):
            gaps.append(f"module {sorted(mods)} belongs to no installed distribution")
        elif dist not in carried and dist not in image and dist != "stateblock":
            gaps.append(f"{dist} (imports {sorted(mods)}) is neither carried nor in the image")
    print(f"carried: {len(carried)} wheels; image list: {len(image)} packages")
    for gap in gaps:
        print(f"GAP: {gap}")
    print("covered" if not gaps else f"{len(gaps)} gap(s)")
    return 1 if gaps else 0


if __name__ == "__main__":
    raise SystemExit(main())
