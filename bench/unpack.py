"""Unpack what a GPU call carries compressed (`python -m bench.unpack DIR`).

A call carries at most 64 MiB: the prose base's bf16 parts travel as `.xz` (about a quarter
smaller), the corpus and the teacher's answers as `.gz`. Every `*.xz` and `*.gz` under DIR
but the prompt files (in `tasks/`, read packed) is written beside itself without the
suffix, unless that file is there already; the packed file is kept, so a second call finds
nothing to do.
"""

from __future__ import annotations

import argparse
import gzip
import lzma
import shutil
from pathlib import Path

OPENERS = {".xz": lzma.open, ".gz": gzip.open}


def unpack(data: Path) -> list[Path]:
    """The files written (none when each was there already)."""
    written = []
    for packed in sorted(data.rglob("*")):
        opener, out = OPENERS.get(packed.suffix), packed.with_suffix("")
        if opener is None or out.exists() or packed.parent.name == "tasks":
            continue
        tmp = out.with_name(out.name + ".tmp")
        with opener(packed, "rb") as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        tmp.rename(out)
        written.append(out)
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data", type=Path)
    for path in unpack(ap.parse_args().data):
        print("unpacked", path, path.stat().st_size, "bytes")


if __name__ == "__main__":
    main()
