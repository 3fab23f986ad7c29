"""The prose corpus (`stateblock.train.corpus`): HTML and fortune files to paragraphs of
prose, duplicates removed, a split by the hash of each document's id that is deterministic
and disjoint, and a build that writes the two splits and their manifest. On the committed
sample of Python's documentation (tests/data/prose_sample) and on small files made here."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from stateblock.train import corpus
from stateblock.train.corpus import Dedup, Doc, Source, is_heldout, normalised, split
from stateblock.train.prose_text import fortunes, html_paragraphs, prose_like, text_paragraphs

SAMPLE = Path(__file__).resolve().parents[2] / "data" / "prose_sample"
PAGE = """<html><head><title>Skipped title</title><script>var x = 1;</script></head><body>
<div class="related"><a href="index.html">Previous topic</a></div>
<h1>Reading files<a class="headerlink" href="#x">¶</a></h1>
<p>Python opens a file with <code>open()</code>, which
   returns a file object.<p>An unclosed paragraph ends at the next one.
<div class="highlight"><pre>with open("f") as f:
    f.read()</pre></div>
<table><tr><td>a table cell</td></tr></table>
<ul><li>first item of a list<li>second item</ul>
<div class="sphinxsidebar"><div><p>sidebar text</div><p>more sidebar</div>
<p>After the sidebar &amp; its nested divs, prose again.<br>A line after a break.</p>
</body></html>"""


def test_html_keeps_prose_and_drops_code_tables_and_page_furniture():
    assert html_paragraphs(PAGE) == [
        "Reading files",
        "Python opens a file with open(), which returns a file object.",
        "An unclosed paragraph ends at the next one.",
        "first item of a list",
        "second item",
        "After the sidebar & its nested divs, prose again.",
        "A line after a break.",
    ]


def test_fortunes_and_plain_text_are_entries_apart_by_percent_or_blank_lines():
    text = "A first saying,\n\tover two lines.\n\t\t-- Someone\n%\n%\nA second one.\n%\n"
    assert fortunes(text) == ["A first saying, over two lines. -- Someone", "A second one."]
    text = "\n\nA paragraph\nover two lines.\n  \t\nAnother,\n\n\n\nand a third.\n"
    assert text_paragraphs(text) == ["A paragraph over two lines.", "Another,", "and a third."]


def test_prose_like_wants_words_made_mostly_of_letters():
    assert prose_like("The module provides a way to read files.")
    assert not prose_like("Reading files")  # a two-word heading
    assert not prose_like("0x7f 0x45 0x4c 0x46 0x02 0x01 0x01")
    assert not prose_like("if (x->y[i] != NULL) { return -EINVAL; }")


def _doc(i: str, *paragraphs: str) -> Doc:
    return Doc(i, list(paragraphs))


def test_dedup_drops_repeated_paragraphs_and_documents_mostly_seen():
    words = " ".join(f"word{k}" for k in range(90))
    dedup = Dedup(min_words=20)
    first = dedup(_doc("a", words, "Shared boilerplate paragraph about the licence terms."))
    assert first is not None and len(first.paragraphs) == 2
    # the same boilerplate, differently spaced and cased, is a duplicate paragraph
    second = dedup(
        _doc("b", "SHARED boilerplate  paragraph, about the licence terms!", words[::-1])
    )
    assert second is not None and second.paragraphs == [words[::-1]]
    # a copy of the first with one short paragraph added is a near-duplicate document
    assert dedup(_doc("c", words, "a short new line here")) is None
    assert dedup(_doc("d", "too short to keep on its own")) is None
    assert dedup.dropped == {"duplicate": 1, "short": 1}


@pytest.fixture(scope="module")
def sample() -> list[Doc]:
    return corpus.load_sample(SAMPLE / "docs.jsonl")


def test_the_sample_is_small_and_carries_its_licence(sample):
    assert (SAMPLE / "docs.jsonl").stat().st_size <= 200_000
    assert "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2" in (SAMPLE / "LICENSE").read_text()
    assert len(sample) >= 20 and all(d.id.startswith("python3.11-doc:") for d in sample)


def test_the_split_is_deterministic_disjoint_and_a_property_of_each_document(sample):
    train, heldout = split(sample, share=0.25)
    again = split(list(reversed(sample)), share=0.25)
    assert sorted(d.id for d in again[0]) == sorted(d.id for d in train)
    assert {d.id for d in train}.isdisjoint(d.id for d in heldout)
    assert len(train) + len(heldout) == len(sample) and train and heldout
    # a document's side does not depend on what else the corpus holds
    assert [is_heldout(d.id, 0.25) for d in sample[:5]] == [d in heldout for d in sample[:5]]
    # after deduplication no paragraph is on both sides
    kept = [d for d in map(Dedup(), sample) if d is not None]
    tr, ho = split(kept, share=0.25)
    para = lambda docs: {normalised(p) for d in docs for p in d.paragraphs}  # noqa: E731
    assert not para(tr) & para(ho)


def test_documents_round_trip_through_the_split_files(sample, tmp_path):
    path = tmp_path / "train.txt"
    size = corpus.write_documents(sample, path)
    assert size == path.stat().st_size
    assert corpus.read_documents(path) == [d.text for d in sample]


def test_build_writes_both_splits_and_the_manifest(tmp_path, monkeypatch):
    root = tmp_path / "root"
    pages = root / "usr/share/doc/fake-doc/html"
    (pages / "_static").mkdir(parents=True)
    body = " ".join(f"Sentence number {k} of the page says something new." for k in range(12))
    for k in range(40):
        (pages / f"page{k}.html").write_text(f"<p>Page {k}. {body}</p><pre>code()</pre>")
    (pages / "copy.html").write_text(f"<p>Page 0. {body}</p>")  # a duplicate of page0
    (pages / "_static" / "skipped.html").write_text(f"<p>Static {body}</p>")
    src = Source("fake-doc", "MIT", "/usr/share/doc/fake-doc/html", ("**/*.html",))
    # a gzipped text file, cut into documents of `CHUNK` paragraphs (two here)
    paragraphs = [f"Entry {k} of the glossary explains {body}" for k in range(corpus.CHUNK + 1)]
    (root / "text.txt.gz").write_bytes(gzip.compress("\n\n".join(paragraphs).encode()))
    text = Source("fake-text", "public-domain", "/", ("text.txt.gz",), (), "text")
    monkeypatch.setattr(corpus, "package_version", lambda package: "1.0-1")
    out = tmp_path / "prose"
    summary = corpus.build(out, (src, text), share=0.2, fs_root=root)
    train, heldout = (corpus.read_documents(out / f"{s}.txt") for s in ("train", "heldout"))
    assert len(train) + len(heldout) == 42 and heldout and train
    assert summary["dropped"]["duplicate"] == 1
    assert not any("code()" in d or "Static" in d for d in train + heldout)
    manifest = json.loads((out / "sources.json").read_text())
    pages, glossary = manifest["sources"]
    assert pages["package"] == "fake-doc" and pages["version"] == "1.0-1"
    assert pages["files"] == 41 and pages["documents"] == 40 and pages["licence"] == "MIT"
    assert glossary["files"] == 1 and glossary["documents"] == 2
    assert manifest["documents"] == {"train": len(train), "heldout": len(heldout)}


def test_build_names_the_packages_to_install_when_one_is_missing(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus, "package_version", lambda package: None)
    with pytest.raises(SystemExit, match="apt-get install -y python3.11-doc"):
        corpus.build(tmp_path, corpus.SOURCES[:1])
    assert not (tmp_path / "train.txt").exists()
