"""Text out of documentation files: HTML pages (the standard library's `html.parser`) and
fortune files, as paragraphs of prose. Code blocks, tables, navigation and index pages are
dropped here, where it is cheap; `corpus.py` then cleans, deduplicates and splits.
"""

from __future__ import annotations

import re
from html.parser import HTMLParser

# elements whose whole content is not prose: code, tables, page furniture
SKIP_TAGS = frozenset({"head", "script", "style", "pre", "table", "nav", "footer", "svg",
                       "math", "object", "select", "textarea", "button", "form"})  # fmt: skip
# classes of the same (Sphinx, DocBook/Publican and Debian's doc themes)
SKIP_CLASSES = frozenset({"sphinxsidebar", "related", "footer", "headerlink", "highlight",
                          "navheader", "navfooter", "toc", "navigation", "docs-navigation",
                          "sig", "literal-block", "programlisting", "screen", "synopsis",
                          "doctest", "linenodiv", "breadcrumbs", "searchbox", "legalnotice",
                          "copyright", "indextable", "index"})  # fmt: skip
# elements that end a paragraph
BLOCK_TAGS = frozenset({"p", "div", "li", "dt", "dd", "h1", "h2", "h3", "h4", "h5", "h6",
                        "br", "blockquote", "section", "article", "ul", "ol", "dl", "hr",
                        "title", "caption", "figcaption", "td", "th", "tr"})  # fmt: skip
VOID_TAGS = frozenset({"br", "hr", "img", "meta", "link", "input", "area", "base", "col",
                       "embed", "source", "track", "wbr", "param"})  # fmt: skip
SPACE = re.compile(r"\s+")


class _Prose(HTMLParser):
    """Collects the text outside skipped elements, one paragraph per block element."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.paragraphs: list[str] = []
        self._buf: list[str] = []
        self._skip: list[str] = []  # the open elements a skip began at, and those inside them

    def _flush(self) -> None:
        text = SPACE.sub(" ", "".join(self._buf)).strip()
        if text:
            self.paragraphs.append(text)
        self._buf = []

    def handle_starttag(self, tag, attrs) -> None:
        if tag in VOID_TAGS:
            if tag in BLOCK_TAGS and not self._skip:
                self._flush()
            return
        if self._skip:
            self._skip.append(tag)
            return
        classes = set((dict(attrs).get("class") or "").split())
        skip = tag in SKIP_TAGS or bool(classes & SKIP_CLASSES)
        if skip or tag in BLOCK_TAGS:
            self._flush()  # a skipped element ends the paragraph before it too
        if skip:
            self._skip.append(tag)

    def handle_startendtag(self, tag, attrs) -> None:
        if tag in BLOCK_TAGS and not self._skip:
            self._flush()

    def handle_endtag(self, tag) -> None:
        if self._skip:
            # an unclosed child (<p>, <li>) must not keep the skip open: close up to `tag`
            if tag in self._skip:
                while self._skip and self._skip.pop() != tag:
                    pass
            return
        if tag in BLOCK_TAGS:
            self._flush()

    def handle_data(self, data) -> None:
        if not self._skip:
            self._buf.append(data)

    def close(self) -> None:
        super().close()
        self._flush()


def html_paragraphs(markup: str) -> list[str]:
    """The prose paragraphs of an HTML page, whitespace collapsed."""
    parser = _Prose()
    parser.feed(markup)
    parser.close()
    return parser.paragraphs


def fortunes(text: str) -> list[str]:
    """The entries of a fortune file (separated by lines holding `%`), each one paragraph:
    its lines joined, the attribution line kept."""
    entries = re.split(r"^%\s*$", text, flags=re.M)
    return [p for p in (SPACE.sub(" ", e).strip() for e in entries) if p]


def text_paragraphs(text: str) -> list[str]:
    """The paragraphs of a plain-text file: blocks apart by blank lines, each one line."""
    blocks = re.split(r"\n[ \t]*\n", text)
    return [p for p in (SPACE.sub(" ", b).strip() for b in blocks) if p]


def prose_like(paragraph: str, min_words: int = 3, min_letters: float = 0.8) -> bool:
    """Whether a paragraph reads as prose: enough words, and mostly letters and spaces (code,
    paths, hex dumps and ASCII art are not)."""
    if len(paragraph.split()) < min_words:
        return False
    plain = sum(c.isalpha() or c == " " for c in paragraph)
    return plain / len(paragraph) >= min_letters
