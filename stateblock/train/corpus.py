"""The English-prose corpus: documentation that installs from Debian's package archive, turned
into clean text, deduplicated and split into train / held-out by a hash of each document's id.

    apt-get update && apt-get install -y $(python -m stateblock.train.corpus packages)
    python -m stateblock.train.corpus build --out data/prose
    python -m stateblock.train.corpus sample --out tests/data/prose_sample

`build` writes OUT/train.txt and OUT/heldout.txt (one document per block, paragraphs one a
line, documents apart by a blank line) and OUT/sources.json (package, version, licence, files,
documents and bytes per source). Nothing is fetched at run time: a GPU build gets the text as
a file. docs/CORPUS.md lists the sources and their licences.
"""

from __future__ import annotations

import argparse
import fnmatch
import gzip
import hashlib
import json
import re
import subprocess
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from stateblock.train.prose_text import fortunes, html_paragraphs, prose_like, text_paragraphs

DOC_SEP = "\n\n"
HELDOUT_SHARE = 0.05
MIN_WORDS = 80  # a document shorter than this after cleaning is dropped
NEAR_DUP = 0.5  # a document whose text was this share already seen is dropped whole
_WORD = re.compile(r"[a-z0-9]+")
_COMMON = ("genindex*", "search.html", "py-modindex.html", "_sources/*", "_static/*",
           "_downloads/*", "_images/*")  # fmt: skip


@dataclass(frozen=True)
class Source:
    """One Debian package's documents: files under `root` matching `include` (globs relative
    to it), minus `exclude` (fnmatch patterns), read as `kind`: html (a document a page),
    fortune or text (plain text, gzipped or not, in blank-line paragraphs; a file cut into
    documents of `CHUNK` entries)."""

    package: str
    licence: str  # as /usr/share/doc/<package>/copyright states it (docs/CORPUS.md)
    root: str
    include: tuple[str, ...]
    exclude: tuple[str, ...] = _COMMON
    kind: str = "html"

    def files(self, fs_root: Path = Path("/")) -> list[Path]:
        base = fs_root / self.root.lstrip("/")
        found = {p for pat in self.include for p in base.glob(pat) if p.is_file()}
        keep = [p for p in found if not _excluded(p.relative_to(base).as_posix(), self.exclude)]
        return sorted(keep)


def _excluded(rel: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatch(rel, pat) for pat in patterns)


SOURCES: tuple[Source, ...] = (
    Source("python3.11-doc", "PSF-2.0", "/usr/share/doc/python3.11/html", ("**/*.html",),
           _COMMON + ("genindex-*", "contents.html", "download.html", "copyright.html",
                      "license.html", "whatsnew/changelog.html")),
    Source("debian-reference-en", "GPL-2+", "/usr/share/doc/debian-reference-common/docs",
           ("*.en.html",)),
    Source("debian-handbook", "GPL-2+ or CC-BY-SA-3.0", "/usr/share/doc/debian-handbook/html/en-US",
           ("*.html",)),
    Source("debian-policy", "GPL-2+", "/usr/share/doc/debian-policy",
           ("policy.html/*.html", "menu-policy.html/*.html", "perl-policy.html/*.html",
            "autopkgtest.html", "debconf_specification.html", "copyright-format-1.0.html")),
    Source("developers-reference", "GPL-2", "/usr/share/developers-reference", ("*.html",),
           _COMMON + ("developers-reference.html",)),
    Source("maint-guide", "GPL-2+", "/usr/share/doc/maint-guide/html", ("*.en.html",)),
    Source("debian-faq", "verbatim-copying (SPI)", "/usr/share/doc/debian/FAQ", ("*.en.html",)),
    Source("gnu-standards", "GFDL-1.3+ (no invariant sections)", "/usr/share/doc/gnu-standards",
           ("*.html",)),
    Source("linux-doc-6.1", "GPL-2", "/usr/share/doc/linux-doc-6.1/html", ("**/*.html",),
           _COMMON + ("translations/*",)),
    Source("postgresql-doc-15", "PostgreSQL", "/usr/share/doc/postgresql-doc-15/html",
           ("*.html",), _COMMON + ("bookindex.html",)),
    Source("python-django-doc", "BSD-3-Clause", "/usr/share/doc/python-django-doc/html",
           ("**/*.html",)),
    Source("sqlite3-doc", "public-domain", "/usr/share/doc/sqlite3", ("**/*.html",),
           _COMMON + ("sitemap.html", "keyword_index.html", "doclist.html")),
    Source("git-doc", "GPL-2", "/usr/share/doc/git-doc", ("**/*.html",)),
    Source("gimp-help-en", "GFDL-NIV-1.2+", "/usr/share/gimp/2.0/help/en", ("*.html",)),
    Source("apache2-doc", "Apache-2.0", "/usr/share/doc/apache2-doc/manual/en", ("**/*.html",),
           _COMMON + ("sitemap.html", "glossary.html")),
    Source("jargon-text", "public-domain", "/usr/share/doc/jargon-text", ("jargon.txt.gz",), (),
           "text"),
    Source("fortunes-min", "BSD-3-clause (fortune-mod)", "/usr/share/games/fortunes",
           ("fortunes", "literature", "riddles"), (), "fortune"),
    Source("fortunes", "BSD-3-clause (fortune-mod)", "/usr/share/games/fortunes", ("*",),
           ("*.*", "fortunes", "literature", "riddles", "ascii-art", "translate-me"), "fortune"),
    # added after the first 18 (a document keeps its side of the split, and the earlier
    # sources' documents their text, whatever follows them): twice the base's text
    Source("rust-doc", "MIT or Apache-2.0", "/usr/share/doc/rust-doc/html",
           tuple(f"{book}/**/*.html" for book in ("book", "reference", "nomicon",
                 "rust-by-example", "edition-guide", "embedded-book", "rustc", "rustdoc"))
           + ("*.html",),
           _COMMON + ("*/print.html", "*/toc.html", "error-index.html", "settings.html",
                      "not_found.html")),
    Source("nodejs-doc", "Expat (MIT)", "/usr/share/doc/nodejs/api", ("*.html",),
           _COMMON + ("all.html", "index.html")),
    Source("zsh-doc", "Zsh (MIT-like)", "/usr/share/doc/zsh-common/html", ("*.html",)),
    Source("sphinx-doc", "BSD-2-clause", "/usr/share/doc/sphinx-doc/html", ("**/*.html",),
           _COMMON + ("changes.html",)),
    Source("python-sqlalchemy-doc", "Expat (MIT)", "/usr/share/doc/python-sqlalchemy-doc/html",
           ("**/*.html",), _COMMON + ("changelog/*",)),
    Source("cmake-doc", "BSD-3-clause", "/usr/share/doc/cmake-data/html", ("**/*.html",),
           _COMMON + ("release/*",)),
    Source("exim4-doc-html", "GPL-2+", "/usr/share/doc/exim4-doc-html/spec_html", ("*.html",)),
    Source("postfix-doc", "EPL-2.0 or IPL-1.0", "/usr/share/doc/postfix/html", ("*.html",),
           _COMMON + ("*.1.html", "*.5.html", "*.8.html")),
    Source("r-doc-html", "GPL-2", "/usr/share/R/doc/manual", ("*.html",)),
    Source("octave-doc", "GPL-3+", "/usr/share/doc/octave/octave.html", ("*.html",)),
    Source("installation-guide-amd64", "GPL-2", "/usr/share/doc/installation-guide-amd64/en",
           ("*.html",)),
    Source("debian-kernel-handbook", "GPL-2+",
           "/usr/share/doc/debian-kernel-handbook/kernel-handbook.html", ("*.html",)),
    Source("live-manual-html", "GPL-3+", "/usr/share/doc/live-manual/html/live-manual",
           ("*.en.html",)),
    Source("bind9-doc", "MPL-2.0 and ISC", "/usr/share/doc/bind9-doc/arm", ("*.html",)),
    Source("python-flask-doc", "BSD-3-clause", "/usr/share/doc/python-flask-doc/html",
           ("**/*.html",), _COMMON + ("changes.html",)),
    Source("python-jinja2-doc", "BSD-3-clause", "/usr/share/doc/python-jinja2-doc/html",
           ("**/*.html",), _COMMON + ("changes.html",)),
    Source("python-setuptools-doc", "Expat (MIT)", "/usr/share/doc/python-setuptools-doc/html",
           ("**/*.html",), _COMMON + ("history.html",)),
    Source("python-pandas-doc", "BSD-3-clause", "/usr/share/doc/python-pandas-doc/html",
           ("**/*.html",), _COMMON + ("reference/*", "generated/*", "whatsnew/*")),
    Source("python-scipy-doc", "BSD-3-clause", "/usr/share/doc/python-scipy-doc/html",
           ("**/*.html",), _COMMON + ("reference/generated/*", "release/*")),
    Source("ghc-doc", "BSD-3-clause", "/usr/share/doc/ghc-doc/html", ("users_guide/**/*.html",)),
    Source("erlang-doc", "Apache-2.0", "/usr/share/doc/erlang-doc", ("**/*.html",)),
    Source("libreoffice-help-en-us", "MPL-2.0", "/usr/share/libreoffice/help/en-US/text",
           ("**/*.html",)),
    Source("lilypond-doc-html", "GPL-3+", "/usr/share/doc/lilypond/html/Documentation",
           tuple(f"{book}/*.html" for book in ("learning", "notation", "usage", "essay",
                 "extending", "music-glossary", "changes", "contributor", "web")),
           _COMMON + ("*.*.html", "*-big-page.html")),
    Source("gnucash-docs", "GFDL-NIV-1.1+", "/usr/share/doc/gnucash-docs",
           ("gnucash-guide-en/*.html", "gnucash-help-en/*.html")),
    Source("python-sklearn-doc", "BSD-3-clause", "/usr/share/doc/python-sklearn-doc/html",
           ("**/*.html",), _COMMON + ("modules/generated/*", "auto_examples/*", "whats_new/*")),
    Source("python-statsmodels-doc", "BSD-3-clause",
           "/usr/share/doc/python-statsmodels-doc/html", ("**/*.html",),
           _COMMON + ("generated/*", "dev/generated/*", "examples/*", "release/*")),
    Source("python-sympy-doc", "BSD-3-clause", "/usr/share/doc/python-sympy-doc/html",
           ("**/*.html",)),
    Source("grass-doc", "GPL-2+", "/usr/share/doc/grass-doc/html", ("*.html",)),
    Source("ghostscript-doc", "AGPL-3+", "/usr/share/doc/ghostscript/html", ("*.html",),
           _COMMON + ("History*.html", "News.html")),
    Source("docutils-doc", "public-domain", "/usr/share/doc/docutils-doc/docs", ("**/*.html",)),
    Source("python-astropy-doc", "BSD-3-clause", "/usr/share/doc/python-astropy-doc/html",
           ("**/*.html",), _COMMON + ("api/*", "whatsnew/*", "changelog.html")),
    Source("python-xarray-doc", "Apache-2.0", "/usr/share/doc/python-xarray-doc/html",
           ("**/*.html",), _COMMON + ("whats-new.html", "generated/*")),
    Source("python-skimage-doc", "BSD-3-clause", "/usr/share/doc/python-skimage-doc/html",
           ("**/*.html",), _COMMON + ("api/*", "release_notes/*")),
    Source("pypy3-doc", "Expat (MIT)", "/usr/share/doc/pypy3/html", ("**/*.html",),
           _COMMON + ("release-*", "whatsnew-*", "index-of-*")),
)  # fmt: skip
# Texts outside the corpus, never trained on: the passages of the served check
# (bench.prose_api), built apart with `build --foreign` (all of it held out).
FOREIGN: tuple[Source, ...] = (
    Source("debian-history", "GPL-2+", "/usr/share/doc/debian-history/docs", ("*.en.html",)),
    Source("bash-doc", "GFDL-NIV-1.3", "/usr/share/doc/bash", ("bashref.html",)),
)  # fmt: skip
CHUNK = 40  # a fortune or text file is cut into documents of this many entries


@dataclass
class Doc:
    id: str  # "<package>:<path under the source's root>[#part]"
    paragraphs: list[str]

    @property
    def text(self) -> str:
        return "\n".join(self.paragraphs)


def read_source(src: Source, fs_root: Path = Path("/")) -> Iterator[Doc]:
    """The source's documents, paragraphs extracted and filtered to prose (`prose_like`)."""
    base = fs_root / src.root.lstrip("/")
    for path in src.files(fs_root):
        data = path.read_bytes()
        raw = (gzip.decompress(data) if path.suffix == ".gz" else data).decode(errors="replace")
        rel = path.relative_to(base).as_posix()
        if src.kind == "html":
            yield Doc(f"{src.package}:{rel}", [p for p in html_paragraphs(raw) if prose_like(p)])
            continue
        entries = fortunes(raw) if src.kind == "fortune" else text_paragraphs(raw)
        entries = [p for p in entries if prose_like(p)]
        for k in range(0, len(entries), CHUNK):
            yield Doc(f"{src.package}:{rel}#{k // CHUNK}", entries[k : k + CHUNK])


def normalised(paragraph: str) -> str:
    """What two near-identical paragraphs share: lower case, words only."""
    return " ".join(_WORD.findall(paragraph.lower()))


def _key(paragraph: str) -> bytes:
    return hashlib.blake2b(normalised(paragraph).encode(), digest_size=16).digest()


@dataclass
class Dedup:
    """Removes exact and near-exact duplicates, first seen first kept: a paragraph whose
    normalised text was seen before is dropped, and a document that was mostly seen
    (`NEAR_DUP` of its characters) or is left too short (`MIN_WORDS`) is dropped whole."""

    min_words: int = MIN_WORDS
    near_dup: float = NEAR_DUP
    seen: set[bytes] = field(default_factory=set)
    dropped: dict[str, int] = field(default_factory=lambda: {"short": 0, "duplicate": 0})

    def __call__(self, doc: Doc) -> Doc | None:
        fresh, seen_chars, keys = [], 0, set()
        for p in doc.paragraphs:
            k = _key(p)
            if k in self.seen or k in keys:
                seen_chars += len(p)
            else:
                fresh.append(p)
                keys.add(k)
        total = sum(len(p) for p in doc.paragraphs)
        if total and seen_chars / total >= self.near_dup:
            self.dropped["duplicate"] += 1
            return None
        self.seen.update(keys)  # a dropped short document's paragraphs stay free to use
        if sum(len(p.split()) for p in fresh) < self.min_words:
            self.dropped["short"] += 1
            return None
        return Doc(doc.id, fresh)


def is_heldout(doc_id: str, share: float = HELDOUT_SHARE) -> bool:
    """The split: a hash of the document's id, so a document stays on its side whatever else
    the corpus holds and on every machine."""
    h = int.from_bytes(hashlib.sha256(doc_id.encode()).digest()[:8], "big")
    return h / 2**64 < share


def split(docs: Iterable[Doc], share: float = HELDOUT_SHARE) -> tuple[list[Doc], list[Doc]]:
    train, heldout = [], []
    for d in docs:
        (heldout if is_heldout(d.id, share) else train).append(d)
    return train, heldout


def write_documents(docs: Iterable[Doc], path: Path) -> int:
    """Documents to a text file, apart by a blank line; returns the bytes written."""
    data = DOC_SEP.join(d.text for d in docs) + "\n"
    path.write_text(data, encoding="utf-8")
    return len(data.encode())


def read_documents(path: str | Path) -> list[str]:
    """The documents of a file `write_documents` wrote."""
    text = Path(path).read_text(encoding="utf-8")
    return [d.strip("\n") for d in text.split(DOC_SEP) if d.strip()]


def package_version(package: str) -> str | None:
    """The installed version of a Debian package, or None when it is not installed."""
    run = subprocess.run(["dpkg-query", "-W", "-f=${Status} ${Version}", package],
                         capture_output=True, text=True)  # fmt: skip
    words = run.stdout.split()
    return words[-1] if run.returncode == 0 and "installed" in words[:3] else None


def build(out: Path, sources: tuple[Source, ...] = SOURCES, share: float = HELDOUT_SHARE,
          fs_root: Path = Path("/")) -> dict:  # fmt: skip
    """Extract, clean, deduplicate and split every source; write the corpus into `out`."""
    missing = [s.package for s in sources if package_version(s.package) is None]
    if missing:
        raise SystemExit(f"not installed: {' '.join(missing)}; run apt-get update && "
                         f"apt-get install -y {' '.join(missing)}")  # fmt: skip
    dedup, train, heldout, manifest = Dedup(), [], [], []
    for src in sources:
        docs = [d for d in map(dedup, read_source(src, fs_root)) if d is not None]
        tr, ho = split(docs, share)
        train += tr
        heldout += ho
        manifest.append({
            "package": src.package, "version": package_version(src.package),
            "licence": src.licence, "copyright": f"/usr/share/doc/{src.package}/copyright",
            "files": len(src.files(fs_root)), "documents": len(docs),
            "heldout_documents": len(ho), "bytes": sum(len(d.text.encode()) for d in docs),
        })  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    sizes = {"train": write_documents(train, out / "train.txt"),
             "heldout": write_documents(heldout, out / "heldout.txt")}  # fmt: skip
    summary = {
        "documents": {"train": len(train), "heldout": len(heldout)},
        "bytes": sizes,
        "words": {"train": _words(train), "heldout": _words(heldout)},
        "heldout_share_of_bytes": round(sizes["heldout"] / sum(sizes.values()), 4),
        "dropped": dedup.dropped,
        "split": {"heldout_share": share, "hash": "sha256(document id)"},
        "sources": manifest,
    }
    (out / "sources.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _words(docs: list[Doc]) -> int:
    return sum(len(d.text.split()) for d in docs)


# the CI sample: Python's documentation alone (the PSF licence allows redistribution)
SAMPLE_SOURCE = SOURCES[0]
SAMPLE_LICENCE = (
    "Python License\n==============",
    "Licenses and Acknowledgements for Incorporated",
)


def sample(out: Path, budget: int = 150_000, max_doc: int = 8_000) -> dict:
    """A small deterministic sample for CI: cleaned, deduplicated documents of Python's
    documentation of at most `max_doc` characters, in an order drawn from their ids (a hash
    of its own: the split's hash would put the held-out side first), until `budget` bytes;
    written as OUT/docs.jsonl with the licence beside it (OUT/LICENSE)."""
    docs = [d for d in map(Dedup(), read_source(SAMPLE_SOURCE)) if d is not None]
    docs.sort(key=lambda d: hashlib.sha256(b"sample:" + d.id.encode()).digest())
    lines, size = [], 0
    for d in docs:
        line = json.dumps({"id": d.id, "text": d.text}, ensure_ascii=False) + "\n"
        if len(d.text) > max_doc or size + len(line.encode()) > budget:
            continue
        lines.append(line)
        size += len(line.encode())
    out.mkdir(parents=True, exist_ok=True)
    (out / "docs.jsonl").write_text("".join(lines), encoding="utf-8")
    copyright = Path(f"/usr/share/doc/{SAMPLE_SOURCE.package}/copyright").read_text()
    start, end = (copyright.index(m) for m in SAMPLE_LICENCE)
    version = package_version(SAMPLE_SOURCE.package)
    header = (f"docs.jsonl: text extracted from the Debian package {SAMPLE_SOURCE.package} "
              f"{version} (Python's documentation) by stateblock.train.corpus sample.\n"
              "Its licence, from /usr/share/doc/python3.11-doc/copyright:\n\n")  # fmt: skip
    (out / "LICENSE").write_text(header + copyright[start:end].rstrip() + "\n")
    return {"documents": len(lines), "bytes": size, "version": version}


def load_sample(path: str | Path) -> list[Doc]:
    """The documents of a sample's docs.jsonl."""
    rows = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines()]
    return [Doc(r["id"], r["text"].split("\n")) for r in rows]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m stateblock.train.corpus",
                                 description=__doc__.splitlines()[0])  # fmt: skip
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("packages", help="print the Debian packages the corpus reads")
    b = sub.add_parser("build", help="build train.txt, heldout.txt and sources.json")
    b.add_argument("--out", default="data/prose", help="the corpus directory (outside git)")
    b.add_argument("--heldout-share", type=float, default=HELDOUT_SHARE, help="held-out share")
    b.add_argument("--packages", default="", help="comma-separated subset of the sources")
    b.add_argument("--foreign", action="store_true",
                   help="the texts outside the corpus (FOREIGN), all held out")  # fmt: skip
    s = sub.add_parser("sample", help="write the small CI sample (docs.jsonl + LICENSE)")
    s.add_argument("--out", default="tests/data/prose_sample")
    s.add_argument("--bytes", type=int, default=150_000, help="the sample's size at most")
    a = ap.parse_args(argv)
    if a.cmd == "packages":
        print(" ".join(dict.fromkeys(s.package for s in SOURCES)))
        return 0
    if a.cmd == "sample":
        print(json.dumps(sample(Path(a.out), a.bytes)))
        return 0
    pool = FOREIGN if a.foreign else SOURCES
    chosen = tuple(s for s in pool if not a.packages or s.package in a.packages.split(","))
    summary = build(Path(a.out), chosen, 1.0 if a.foreign else a.heldout_share)
    print(json.dumps({k: v for k, v in summary.items() if k != "sources"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
