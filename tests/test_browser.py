"""The built book in a real browser (Debian's Chromium driven by Playwright): every page loads with no
console error and no failed or off-site request, maths is typeset, images load, search works, hidden
solutions open, no page pans sideways on a phone, every figure's text is legible at 390 px, the
verification report shows what each check measured, and the KV-cache explorer shows the same numbers
as labcode."""

from __future__ import annotations

import json
import re
from itertools import product
from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

import pytest
import torch
import yaml
from playwright.sync_api import Page

from conftest import ROOT, toc_files
from labcode.config import get_config
from labcode.cost import (
    codes_per_byte,
    kv_cache_bytes,
    kv_cache_elements,
    positions_computed,
    quantized_kv_cache_bytes,
)
from labcode.engines.quant import QuantizedCache
from labcode.generate import new_token_budget
from labcode.plotting import PNG_SCALE_KEY, PNG_TEXT_KEY

PAGES = toc_files()
CHAPTERS = [f for f in PAGES if f.startswith("notebooks/")]


class Watch:
    """Collects console errors, page errors, failed requests and requests that leave this machine."""

    def __init__(self, page: Page):
        self.errors: list[str] = []
        self.failed: list[str] = []
        self.offsite: list[str] = []
        page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))
        page.on("requestfailed", self._failed)
        page.on("response", lambda r: r.status >= 400 and self.failed.append(f"{r.url} (HTTP {r.status})"))
        page.on("request", self._request)

    def _failed(self, request):
        # A navigation (reload, Back, a new address) cancels the requests of the page it leaves,
        # such as a favicon still loading: the browser reports those as aborted, not as failures.
        if request.failure == "net::ERR_ABORTED":
            return
        self.failed.append(f"{request.url} ({request.failure})")

    def _request(self, request):
        parts = urlsplit(request.url)
        if parts.scheme in ("data", "blob", "about"):
            return
        if parts.hostname != "127.0.0.1":
            self.offsite.append(request.url)

    def assert_clean(self, where: str):
        assert not self.errors, f"{where}: console errors {self.errors}"
        assert not self.failed, f"{where}: failed requests {self.failed}"
        assert not self.offsite, f"{where}: requests that leave this machine {self.offsite}"


def open_page(page: Page, base: str, doc: str) -> Watch:
    watch = Watch(page)
    page.goto(base + doc + ".html", wait_until="load")
    page.wait_for_load_state("networkidle")
    return watch


def wait_for_maths(page: Page) -> int:
    """Wait until every maths element holds a MathJax container; returns how many there are."""
    count = page.locator("span.math, div.math").count()
    if count:
        page.wait_for_function(
            "() => [...document.querySelectorAll('span.math, div.math')].every(e => e.querySelector('mjx-container'))",
            timeout=20000,
        )
    return count


@pytest.mark.parametrize("doc", PAGES)
def test_page_loads_cleanly_with_maths_and_images(page: Page, book_server, doc):
    watch = open_page(page, book_server, doc)
    assert page.locator("article.bd-article h1").count() >= 1, f"{doc}: no title"
    maths = wait_for_maths(page)
    if maths:
        raw = page.evaluate(
            r"""() => [...document.querySelectorAll('span.math, div.math')]
                 .map(e => e.textContent).filter(t => /\\\(|\\\)|\\\[|\\\]/.test(t))"""
        )
        assert not raw, f"{doc}: untypeset maths left: {raw[:3]}"
    broken = page.evaluate(
        "() => [...document.images].filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.src)"
    )
    assert not broken, f"{doc}: images that did not load: {broken}"
    measure(page, doc)  # for the tests below, while the page is open
    watch.assert_clean(doc)


def test_maths_is_typeset_on_the_explorer_page(page: Page, book_server):
    open_page(page, book_server, "book/explorer")
    assert wait_for_maths(page) >= 1
    assert page.locator("article mjx-container").count() >= 1


def _search_term(page: Page, base: str) -> tuple[str, str]:
    """A distinctive word from a chapter (or, before chapters exist, from the glossary), and its page."""
    doc = CHAPTERS[0] if CHAPTERS else "book/glossary"
    open_page(page, base, doc)
    words = re.findall(r"[A-Za-z][a-z]{6,}", page.locator("article.bd-article h1").first.inner_text())
    if not words:
        words = re.findall(r"[A-Za-z][a-z]{6,}", page.locator("article.bd-article").inner_text())
    return max(words, key=len).lower(), doc


def test_search_finds_a_word_from_a_chapter(page: Page, book_server):
    term, doc = _search_term(page, book_server)
    watch = Watch(page)
    page.goto(f"{book_server}search.html?q={term}", wait_until="load")
    results = page.locator("#search-results ul.search li a")
    results.first.wait_for(timeout=20000)
    hrefs = [urlsplit(h).path for h in results.evaluate_all("els => els.map(e => e.href)")]
    assert any(h.endswith(f"/{doc}.html") for h in hrefs), f"searching {term!r} did not find {doc}: {hrefs}"
    watch.assert_clean("search")


def test_search_summaries_are_article_text_without_latex(page: Page, book_server):
    """The passage under each search result comes from the article (not the toolbar or the page's
    "Contents" sidebar) and shows maths as text, not LaTeX source (book/_static/kvcv.js)."""
    watch = Watch(page)
    outside = r"Contents\s+\d+\.\d+\.|Print to PDF|Download source|\.ipynb\s+\.pdf"
    for term in ("cache", "softmax"):
        page.goto(f"{book_server}search.html?q={term}", wait_until="load")
        results = page.locator("#search-results ul.search li")
        results.first.wait_for(timeout=20000)
        n = results.count()
        assert n >= 3, f"searching {term!r} found only {n} pages"
        page.wait_for_function(
            "n => document.querySelectorAll('#search-results ul.search li p.context').length >= n", arg=n, timeout=30000
        )
        summaries = results.locator("p.context").all_inner_texts()
        latex = [t for t in summaries if re.search(r"\\[(\[]|\\[a-zA-Z]{2,}\{|\$\$", t)]
        chrome = [t for t in summaries if re.search(outside, t)]
        assert not latex, f"{term!r}: search summaries show LaTeX source: {latex[:3]}"
        assert not chrome, f"{term!r}: search summaries show text from outside the article: {chrome[:3]}"
    watch.assert_clean("search summaries")


def solutions_hidden_until_clicked(page: Page, doc: str) -> tuple[int, list[str]]:
    """Open every exercise solution of a loaded page with a click: (how many opened, problems found).
    A solution must start closed and hidden, and show its content after one click on its chevron."""
    solutions = page.locator("div.solution.dropdown")
    opened, problems = 0, []
    for i in range(solutions.count()):
        sol = solutions.nth(i)
        body = sol.locator(":scope > :not(.admonition-title)").first
        button = sol.locator(".toggle-button").first
        if button.get_attribute("aria-expanded") != "false":
            problems.append(f"{doc}: solution {i} is open")
        if body.is_visible():
            problems.append(f"{doc}: solution {i} is visible before a click")
        link = sol.locator(".admonition-title a").first
        if link.count() and link.inner_text() != link.inner_text().lstrip():
            problems.append(f"{doc}: solution {i}'s link starts with an underlined space")
        button.click()  # the chevron (test_the_solution_title_opens_the_solution clicks the title's link)
        if button.get_attribute("aria-expanded") != "true":
            problems.append(f"{doc}: solution {i} did not open on a click")
        body.wait_for(state="visible", timeout=5000)
        opened += 1
    return opened, problems


def test_solutions_are_hidden_until_clicked(measured_pages):
    if not CHAPTERS:
        pytest.skip("no chapter notebooks in _toc.yml yet")
    problems = [p for doc in CHAPTERS for p in measured_pages[doc]["solutions"][1]]
    assert not problems, problems
    assert sum(measured_pages[doc]["solutions"][0] for doc in CHAPTERS) >= 1, \
        "no chapter has an exercise solution in a dropdown"


# ---- everything fits: code, outputs, tables and equations; figures with alt text and captions ----

DESKTOP, PHONE = 1280, 390

# One pass over a page's article (with every folded cell unfolded; a closed dropdown's content is
# laid out at full width already): every code block, output, table and equation that is wider than
# the box that holds it, and how that box deals with it. A box that clips it fails; a box that
# scrolls sideways passes only if it shows that it does (the scroll shadows of book/_static/kvcv.css:
# phones hide scrollbars until touched) and, with `mustFit` (the desktop width), only if it is not a
# notebook code cell or a table, which must fit the column outright. Whatever is left must lie
# inside the text column.
OVERFLOW_JS = r"""
(mustFitOnThisScreen) => {
  const article = document.querySelector("article.bd-article");
  if (!article) return [];
  article.querySelectorAll("details").forEach((d) => { d.open = true; }); // code a reader may unfold
  const px = (v) => parseFloat(v) || 0;
  const acs = getComputedStyle(article);
  const ar = article.getBoundingClientRect();
  const colLeft = ar.left + px(acs.borderLeftWidth) + px(acs.paddingLeft);
  const colRight = ar.right - px(acs.borderRightWidth) - px(acs.paddingRight);
  const KINDS = [
    ["code", "div.cell_input pre"],
    ["code", "pre:not(div.cell_input pre, div.cell_output pre)"],
    ["output", "div.cell_output pre, div.cell_output .output:not(:has(pre))"],
    ["table", "table"],
    ["equation", "mjx-container"],
  ];
  const tex = (e) => {
    try { return window.MathJax.startup.document.getMathItemsWithin(e)[0].math; } catch (err) { return e.textContent; }
  };
  const describe = (kind, e) => {
    const section = e.closest("section[id]");
    const raw = kind === "equation" ? tex(e)
      : kind === "table" ? [...e.querySelectorAll("th")].map((t) => t.textContent.trim()).join(" | ") || e.textContent
      : e.textContent;
    const text = raw.replace(/\s+/g, " ").trim();
    const short = text.length > 70 ? text.slice(0, 70) + "..." : text;
    return (section ? "#" + section.id + " " : "") + JSON.stringify(short);
  };
  const afforded = (n) => {
    const cs = getComputedStyle(n);
    return /gradient/.test(cs.backgroundImage) && /local/.test(cs.backgroundAttachment);
  };
  const found = [];
  const seen = new Set();
  for (const [kind, selector] of KINDS) {
    for (const e of article.querySelectorAll(selector)) {
      if (seen.has(e) || !e.getClientRects().length) continue; // counted already, or not laid out
      seen.add(e);
      const mustFit = mustFitOnThisScreen && (kind === "table" || (kind === "code" && e.closest("div.cell_input")));
      const report = (problem, need, have) =>
        found.push({ kind, where: describe(kind, e), problem, need: Math.round(need), have: Math.round(have) });
      let right = null; // right edge of what the reader sees of e
      let reported = false;
      for (let n = e; n && n !== article; n = n.parentElement) {
        const r = n.getBoundingClientRect();
        const inner = r.left + n.clientLeft;
        // MathJax's hidden MathML copy inflates scrollWidth: measure the typeset maths itself.
        const typeset = n === e && kind === "equation" ? e.querySelector("mjx-math") : null;
        const extent = typeset ? typeset.getBoundingClientRect().right + n.scrollLeft
          : n === e ? inner + n.scrollWidth : right;
        if (extent <= inner + n.clientWidth + 1) {
          if (n === e) right = r.right;
          continue;
        }
        const ox = getComputedStyle(n).overflowX;
        if (ox === "hidden" || ox === "clip") {
          report("is cut off", extent - inner, n.clientWidth);
          reported = true;
          break;
        }
        if (ox === "auto" || ox === "scroll") {
          if (mustFit) report("scrolls sideways", extent - inner, n.clientWidth);
          else if (!afforded(n)) report("scrolls with nothing to show that it does", extent - inner, n.clientWidth);
          else { right = r.right; continue; }
          reported = true;
          break;
        }
        right = extent; // it spills out of n: compare with the next box up
      }
      if (!reported && right > colRight + 1) {
        report("is wider than the text column", right - colLeft, colRight - colLeft);
      }
    }
  }
  return found;
}
"""

# Every image in the article: its alt text and its figure caption (number and text).
IMAGES_JS = r"""
() => [...document.querySelectorAll("article.bd-article img")].map((img) => {
  const figure = img.closest("figure");
  const caption = figure ? figure.querySelector("figcaption") : null;
  const number = caption ? caption.querySelector(".caption-number") : null;
  const section = img.closest("section[id]");
  return {
    src: img.getAttribute("src") || "",
    alt: img.getAttribute("alt"),
    where: section ? "#" + section.id : "",
    caption: caption ? caption.textContent.replace(/\s+/g, " ").replace(/#$/, "").trim() : null,
    number: number ? number.textContent.trim() : null,
  };
})
"""

# Diagrams (img.kvcv-diagram, book/_static/kvcv.css): their width as shown and as drawn, and whether
# their figure scrolls sideways and shows that it does.
DIAGRAMS_JS = r"""
() => [...document.querySelectorAll("article.bd-article figure img.kvcv-diagram")].map((img) => {
  const figure = img.closest("figure");
  const cs = getComputedStyle(figure);
  return {
    src: img.getAttribute("src") || "",
    url: img.currentSrc || img.src,
    shown: img.getBoundingClientRect().width,
    natural: img.naturalWidth,
    scrolls: figure.scrollWidth > figure.clientWidth + 1,
    afforded: /gradient/.test(cs.backgroundImage) && /local/.test(cs.backgroundAttachment)
      && (cs.overflowX === "auto" || cs.overflowX === "scroll"),
  };
})
"""

# Every figure image: the width it is shown at, its PNG's width in pixels, and its file.
FIGURES_JS = r"""
() => [...document.querySelectorAll("article.bd-article figure img")].map((img) => {
  const number = img.closest("figure").querySelector(".caption-number");
  return {
    url: img.currentSrc || img.src,
    shown: img.getBoundingClientRect().width,
    natural: img.naturalWidth,
    number: number ? number.textContent.trim() : img.getAttribute("src"),
  };
})
"""

# Launch buttons (Binder, Colab, JupyterHub, live code): none, since none of them would run.
LAUNCH_JS = r"""
() => [...document.querySelectorAll(
  '.dropdown-launch-buttons, a[href*="mybinder.org"], a[href*="colab.research.google.com"], ' +
  '.btn-launch, [data-bs-original-title*="Launch"], [title*="Launch"], .thebe-launch-button'
)].map((e) => e.outerHTML.slice(0, 120))
"""

# The page's own width against the screen's, and the elements that stick out past the screen's
# right edge without a box of theirs that scrolls or clips them.
# The book's tables (book/_static/kvcv.js, behaviour 6; the report's tables have their own phone
# layout): whether each scrolls, was set closer, keeps its first column in view, and, scrolled
# sideways, still shows that column where it was; and whether a number with an exponent was split.
TABLES_JS = r"""
() => [...document.querySelectorAll(
  "article.bd-article .kvcv-table-wrap, article.bd-article .pst-scrollable-table-container")]
  .filter((w) => w.querySelector(":scope > table:not(.kvcv-verdicts)"))
  .map((w) => {
    const table = w.querySelector(":scope > table");
    const first = table.rows.length ? table.rows[table.rows.length - 1].cells[0] : null;
    const scrolls = w.scrollWidth > w.clientWidth + 1;
    let held = null;
    if (scrolls && first) {
      const before = first.getBoundingClientRect().left;
      w.scrollLeft = 80;
      held = Math.abs(first.getBoundingClientRect().left - before) < 1;
      w.scrollLeft = 0;
    }
    const numbers = [...w.querySelectorAll(".kvcv-nobreak")];
    // The box's scroll shadows are its background: an opaque row or cell in front of it hides them.
    const alpha = (c) => { const n = c.match(/[\d.]+/g).map(Number); return n.length > 3 ? n[3] : 1; };
    const veiled = [...table.rows].filter((r) => [r, ...[...r.cells].slice(1)]
      .some((e) => alpha(getComputedStyle(e).backgroundColor) > 0.99)).length;
    return {
      where: (table.rows[0] ? [...table.rows[0].cells].map((c) => c.textContent.trim()).join(" | ") : "")
        .replace(/\s+/g, " ").slice(0, 60),
      scrolls, held, veiled,
      tight: w.classList.contains("kvcv-tight"),
      sticky: w.classList.contains("kvcv-sticky"),
      first_share: first ? first.getBoundingClientRect().width / w.clientWidth : 0,
      sticky_share: window.KVCVTables.stickyShare,
      numbers: numbers.length,
      split: numbers.filter((n) => n.getClientRects().length > 1).map((n) => n.textContent),
    };
  })
"""

# Printed outputs on a phone: each one's lines as printed against the rows it takes on the page, and
# whether its cell carries the output-columns tag (book/_static/kvcv.css, tests/test_notebook_style.py).
OUTPUTS_JS = r"""
() => [...document.querySelectorAll("article.bd-article div.cell_output pre")].map((pre) => {
  const cs = getComputedStyle(pre);
  const lineHeight = parseFloat(cs.lineHeight);
  const height = pre.clientHeight - parseFloat(cs.paddingTop) - parseFloat(cs.paddingBottom);
  return {
    columns: !!pre.closest("div.cell.tag_output-columns"),
    lines: pre.textContent.replace(/\n$/, "").split("\n").length,
    rows: Math.round(height / lineHeight),
    scrolls: pre.scrollWidth > pre.clientWidth + 1,
    first: pre.textContent.trim().slice(0, 50),
  };
})
"""

# Display equations on a phone: how wide the typeset maths is against its box.
EQUATIONS_JS = r"""
() => [...document.querySelectorAll("article.bd-article div.math mjx-container")].map((e) => {
  let tex = e.textContent;
  try { tex = window.MathJax.startup.document.getMathItemsWithin(e)[0].math; } catch (err) { /* as shown */ }
  return { width: e.querySelector("mjx-math").getBoundingClientRect().width, box: e.clientWidth,
           tex: tex.replace(/\s+/g, " ").trim().slice(0, 60) };
})
"""

# Words of inline code in prose (not in a table) short enough to fit a phone's line, each split
# over two lines: a browser may end a line after a hyphen ("--" / "long"; kvcv.js, behaviour 7).
SHORT_CODE_WORD = 24  # characters
CODE_WORDS_JS = r"""
(most) => [...document.querySelectorAll("article.bd-article code.literal span.pre")]
  .filter((w) => !w.closest("table") && w.textContent.length <= most && w.getClientRects().length > 1)
  .map((w) => w.textContent)
"""

PAGE_WIDTH_JS = r"""
() => {
  const width = window.innerWidth;
  // Inside a box that scrolls or clips within the screen, or in a drawer (fixed), it cannot pan the page.
  const boxed = (e) => {
    for (let n = e; n && n !== document.body; n = n.parentElement) {
      const cs = getComputedStyle(n);
      if (cs.position === "fixed" || cs.visibility === "hidden") return true;
      if (n !== e && cs.overflowX !== "visible") return n.getBoundingClientRect().right <= width + 1;
    }
    return false;
  };
  const out = [...document.querySelectorAll("body *")].filter((e) => {
    const r = e.getBoundingClientRect();
    return r.width && r.right > width + 1 && !boxed(e);
  }).slice(0, 6).map((e) => `${e.tagName.toLowerCase()}.${[...e.classList].join(".")} ` +
                             JSON.stringify(e.textContent.replace(/\s+/g, " ").trim().slice(0, 50)));
  return { scroll: document.documentElement.scrollWidth, width, out };
}
"""

FIX_HINTS = {
    "scrolls sideways": "format the notebook's code to 88 columns (ruff format), show tables with "
    "labcode.display.show_table and keep them to what fits",
    "is cut off": "something clips it: give its box overflow-x: auto with the kvcv-scroll class, or make it narrower",
    "scrolls with nothing to show that it does": "give the scrolling box the kvcv-scroll class (book/_static/kvcv.css)",
    "is wider than the text column": "make it narrower, or put it in a box with the kvcv-scroll class",
}


_MEASURED: dict[str, dict] = {}  # page -> what measure() found; filled by the first test that loads the page


def measure(page: Page, doc: str) -> None:
    """Measure a loaded page (maths typeset) at the desktop width and, resized without a second
    load, at the phone width; keep what was found in _MEASURED for the tests below. Exercise
    solutions are opened first (solutions_hidden_until_clicked), so they are measured open."""
    page.set_viewport_size({"width": DESKTOP, "height": 900})
    found = {"solutions": solutions_hidden_until_clicked(page, doc),
             "images": page.evaluate(IMAGES_JS), DESKTOP: page.evaluate(OVERFLOW_JS, True),
             "loaded_images": page.evaluate("() => [...document.images].filter(i => i.naturalWidth > 0).length")}
    found["figures", DESKTOP] = page.evaluate(FIGURES_JS)
    found["launch"] = page.evaluate(LAUNCH_JS)
    page.set_viewport_size({"width": PHONE, "height": 844})
    # The tables are fitted again on the next frame after a change of width (kvcv.js, behaviour 6).
    page.evaluate("() => new Promise((done) => requestAnimationFrame(() => requestAnimationFrame(done)))")
    found["phone_tables"] = page.evaluate(TABLES_JS)
    found[PHONE] = page.evaluate(OVERFLOW_JS, False)
    found["phone_diagrams"] = page.evaluate(DIAGRAMS_JS)
    found["phone_outputs"] = page.evaluate(OUTPUTS_JS)
    found["phone_equations"] = page.evaluate(EQUATIONS_JS)
    found["figures", PHONE] = page.evaluate(FIGURES_JS)
    found["page_width"] = page.evaluate(PAGE_WIDTH_JS)
    found["phone_code_words"] = page.evaluate(CODE_WORDS_JS, SHORT_CODE_WORD)
    page.set_viewport_size({"width": DESKTOP, "height": 900})
    _MEASURED[doc] = found


@pytest.fixture(scope="module")
def measured_pages(browser, book_server) -> dict[str, dict]:
    """Every page's measurements: test_page_loads_cleanly_with_maths_and_images takes them while it
    has the page open; a page it did not measure (deselected, or failed) is loaded here."""
    missing = [doc for doc in PAGES if doc not in _MEASURED]
    if missing:
        context = browser.new_context(viewport={"width": DESKTOP, "height": 900})
        try:
            page = context.new_page()
            for doc in missing:
                open_page(page, book_server, doc)
                wait_for_maths(page)
                measure(page, doc)
        finally:
            context.close()
    return {doc: _MEASURED[doc] for doc in PAGES}


@pytest.mark.parametrize("width", [DESKTOP, PHONE])
def test_nothing_is_wider_than_its_column(measured_pages, width):
    """At 1280 px notebook code and tables fit the column; at both widths no code, output, table or
    equation is cut off, runs out of the column, or scrolls without showing that it does."""
    lines, problems, pages = [], set(), 0
    for doc, found in measured_pages.items():
        if found[width]:
            pages += 1
            lines.append(f"{doc}.html")
            for f in found[width]:
                problems.add(f["problem"])
                lines.append(f"  {f['kind']} {f['where']} {f['problem']}: needs {f['need']} px, has {f['have']} px")
    n = sum(len(found[width]) for found in measured_pages.values())
    hints = [f"  {p}: {FIX_HINTS[p]}" for p in sorted(problems)]
    assert not n, (
        f"at {width} px, {n} elements on {pages} pages do not fit their column:\n"
        + "\n".join(lines)
        + "\nto fix:\n"
        + "\n".join(hints)
    )


def _alt_text_problem(image: dict) -> str | None:
    alt = (image["alt"] or "").strip()
    name = image["src"].rsplit("/", 1)[-1]
    if not alt:
        return "has no alt text"
    # A path has no spaces; a description may well contain a slash ("GFLOP/s", "bytes / bandwidth").
    path_like = " " not in alt and "/" in alt
    if path_like or alt.endswith(name) or re.search(r"\.(png|jpe?g|svg|gif|webp)$", alt, flags=re.I):
        return "has its file path for alt text"
    if len(alt.split()) < 4:
        return f"has an alt text too short to describe a figure ({alt!r})"
    return None


def test_chapters_have_images(measured_pages):
    """Images counted while the pages were open for the tests above (loaded, with a size)."""
    if not CHAPTERS:
        pytest.skip("no chapter notebooks in _toc.yml yet")
    found = sum(measured_pages[doc]["loaded_images"] for doc in CHAPTERS)
    assert found >= 1, "no chapter shows a single image"


def test_every_image_has_alt_text_and_a_numbered_caption(measured_pages):
    """Every image on every page describes itself to a screen reader and carries a numbered caption
    (myst-nb: cell metadata "mystnb": {"figure": {"caption", "name"}, "image": {"alt"}}, or glue:figure)."""
    lines, total, bad = [], 0, 0
    for doc, found in measured_pages.items():
        page_lines = []
        for image in found["images"]:
            total += 1
            problems = [p for p in [_alt_text_problem(image)] if p]
            if image["caption"] is None:
                problems.append("has no caption (no figure caption element)")
            elif not image["number"]:
                problems.append("has a caption without a number (give the figure a name)")
            elif len(image["caption"]) <= len(image["number"]) + 2:
                problems.append("has an empty caption")
            if problems:
                bad += 1
                name = image["src"].rsplit("/", 1)[-1][:16]
                page_lines.append(f"  image {name}... {image['where']}: " + "; ".join(problems))
        if page_lines:
            lines += [f"{doc}.html", *page_lines]
    assert not bad, (
        f"{bad} of {total} images lack a real alt text or a numbered caption:\n"
        + "\n".join(lines)
        + '\nto fix: cell metadata "mystnb": {"figure": {"caption": ..., "name": ...}, "image": {"alt": ...}} '
        "(labcode.plotting.caption_metadata), or glue the figure and show it with {glue:figure} and :alt:"
    )


def test_diagrams_keep_their_size_on_a_phone_and_scroll_visibly(measured_pages, book_html):
    """A diagram's small print (slots, positions, block numbers) stays at the size it was drawn at on a
    phone: its figure scrolls sideways instead, with the scroll shadows (book/_static/kvcv.css). Its
    natural size is its PNG's width over the pixels per CSS px the PNG records (labcode.plotting)."""
    diagrams = [(doc, d) for doc in CHAPTERS for d in measured_pages[doc]["phone_diagrams"]]
    if CHAPTERS:
        assert diagrams, "no chapter shows a diagram (an image with the class kvcv-diagram)"
    natural = {d["url"]: d["natural"] / _png_record(book_html, d["url"]).get(PNG_SCALE_KEY, 1.0) for _, d in diagrams}
    shrunk = [f"{doc}: {d['src'][-20:]} shown {d['shown']:.0f} px of {natural[d['url']]:.0f}" for doc, d in diagrams
              if abs(d["shown"] - natural[d["url"]]) > 1]
    unmarked = [f"{doc}: {d['src'][-20:]}" for doc, d in diagrams if d["scrolls"] and not d["afforded"]]
    assert not shrunk, f"diagrams shrunk on a phone: {shrunk}"
    assert not unmarked, f"diagrams that scroll on a phone with nothing to show that they do: {unmarked}"
    assert any(d["scrolls"] for _, d in diagrams), "no diagram is wider than a phone: the scrolling above went untested"


def test_output_in_columns_keeps_its_lines_on_a_phone(measured_pages):
    """At 390 px printed output wraps at the column, except output set in columns (its cell tagged
    output-columns): each of its lines stays one row, and the box scrolls sideways instead (its
    scroll shadows are checked with everything else that scrolls)."""
    outputs = [(doc, o) for doc in CHAPTERS for o in measured_pages[doc]["phone_outputs"]]
    columns = [(doc, o) for doc, o in outputs if o["columns"]]
    broken = [f"{doc}: {o['first']!r}: {o['lines']} lines on {o['rows']} rows" for doc, o in columns
              if o["rows"] != o["lines"]]
    assert not broken, f"output in columns wrapped on a phone: {broken}"
    if CHAPTERS:
        assert columns, "no chapter prints output in columns (a cell tagged output-columns)"
        assert any(o["scrolls"] for _, o in columns), "no output in columns is wider than a phone: untested"
        assert any(o["rows"] > o["lines"] for _, o in outputs if not o["columns"]), "no other output wraps"


def test_display_equations_fit_a_phone(measured_pages):
    """At 390 px every display equation fits its column: a long one is set on several lines
    (aligned), so a reader never scrolls sideways through maths."""
    equations = [(doc, e) for doc in PAGES for e in measured_pages[doc]["phone_equations"]]
    wide = [f"{doc}: {e['width']:.0f} px in {e['box']} px: {e['tex']}" for doc, e in equations
            if e["width"] > e["box"] + 1]
    assert not wide, "display equations wider than a phone's column:\n" + "\n".join(wide)
    if CHAPTERS:
        assert equations, "no page shows a display equation"


def test_back_to_top_stays_in_the_corner_on_a_phone(browser, book_server):
    """Scrolling up on a phone shows the theme's "Back to top" button: a round arrow in the bottom
    right corner (book/_static/kvcv.css), not a pill across the middle of the text; its words
    remain its accessible name."""
    context = browser.new_context(viewport={"width": PHONE, "height": 844})
    try:
        page = context.new_page()
        open_page(page, book_server, CHAPTERS[0] if CHAPTERS else PAGES[0])
        page.mouse.wheel(0, 3000)
        page.wait_for_timeout(300)
        page.mouse.wheel(0, -300)
        page.wait_for_function("() => getComputedStyle(document.querySelector('#pst-back-to-top')).display !== 'none'")
        box = page.locator("#pst-back-to-top").bounding_box()
        name = page.locator("#pst-back-to-top").text_content().strip()
    finally:
        context.close()
    assert box["width"] <= 48 and box["height"] <= 48, f"the button is {box['width']:.0f} x {box['height']:.0f} px"
    assert box["x"] >= 0.8 * PHONE and box["y"] >= 0.8 * 844, f"the button is not in the bottom right corner: {box}"
    assert name == "Back to top", name


def test_88_columns_of_code_fit_at_1280px(page: Page, book_server):
    """The layout gives notebook code 88 columns at 1280 px (whatever today's notebooks hold), and a
    wide table scrolls inside its wrapper, with its scroll shadows, on a phone."""
    doc = CHAPTERS[0] if CHAPTERS else "book/running"
    page.set_viewport_size({"width": DESKTOP, "height": 900})
    open_page(page, book_server, doc)
    widths = page.evaluate(
        """() => {
            const pre = document.querySelector("div.cell_input pre") || document.querySelector("article pre");
            const probe = document.createElement("span");
            probe.textContent = "M".repeat(88);
            pre.appendChild(probe);
            const need = probe.getBoundingClientRect().width;
            probe.remove();
            const cs = getComputedStyle(pre);
            return [need, pre.clientWidth - parseFloat(cs.paddingLeft) - parseFloat(cs.paddingRight)];
        }"""
    )
    assert widths[0] <= widths[1], f"88 columns of code need {widths[0]:.0f} px; a code cell has {widths[1]:.0f} px"

    # A show_table table of twelve number columns, as labcode.display.show_table writes it.
    header = "".join(f'<th class="kvcv-r">column {i}</th>' for i in range(12))
    row = "".join(f'<td class="kvcv-r">{10**i:,}</td>' for i in range(12))
    html = (f'<div class="kvcv-table-wrap"><table class="table kvcv-table"><thead><tr>{header}</tr></thead>'
            f"<tbody><tr>{row}</tr></tbody></table></div>")
    page.set_viewport_size({"width": PHONE, "height": 844})
    page.evaluate("html => document.querySelector('article.bd-article h1').insertAdjacentHTML('afterend', html)", html)
    wrap = page.evaluate(
        """() => { const w = document.querySelector(".kvcv-table-wrap");
                   return [w.scrollWidth, w.clientWidth, w.getBoundingClientRect().right, window.innerWidth]; }"""
    )
    assert wrap[0] > wrap[1] and wrap[2] <= wrap[3], f"the table does not scroll inside its wrapper: {wrap}"
    problems = [f for f in page.evaluate(OVERFLOW_JS, False) if "column 0" in f["where"]]
    assert not problems, problems


def test_six_short_columns_fit_a_phone(page: Page, book_server):
    """On a phone a show_table table of six short columns (chapter 7's table of cache layouts) fits the
    text column, its text a size smaller than on a desk (book/_static/kvcv.css), instead of scrolling."""
    doc = CHAPTERS[0] if CHAPTERS else "book/running"
    header = "".join(f'<th class="kvcv-{a}">{h}</th>' for h, a in
                     zip(("layout", "Hkv", "format", "bytes/token", "plain", "paged"), "lrlrrr", strict=True))
    row = "".join(f'<td class="kvcv-{a}">{x}</td>' for x, a in
                  zip(("GQA", "3", "bfloat16", "9,216", "1,820", "1,849"), "lrlrrr", strict=True))
    html = (f'<div class="kvcv-table-wrap" id="six"><table class="table kvcv-table"><thead><tr>{header}</tr>'
            f"</thead><tbody><tr>{row}</tr></tbody></table></div>")
    sizes = {}
    for width in (DESKTOP, PHONE):
        page.set_viewport_size({"width": width, "height": 900})
        open_page(page, book_server, doc)
        page.evaluate("html => document.querySelector('article.bd-article h1').insertAdjacentHTML('afterend', html)",
                      html)
        sizes[width] = page.evaluate(
            """() => { const w = document.getElementById("six"), td = w.querySelector("td");
                       return [w.scrollWidth, w.clientWidth, parseFloat(getComputedStyle(td).fontSize)]; }"""
        )
    scroll, client, phone_px = sizes[PHONE]
    assert scroll <= client, f"six short columns need {scroll} px on a {PHONE} px phone; the column has {client} px"
    assert phone_px < sizes[DESKTOP][2], f"a table's text is {phone_px} px on a phone, as on a desk"


def test_wide_tables_fit_or_keep_their_names_on_a_phone(measured_pages):
    """At 390 px a table wider than the column is set closer (book/_static/kvcv.js, behaviour 6), and
    most then fit; one that still scrolls keeps its first column in view while it is scrolled, unless
    that column is itself a wide share of the screen, and shows its scroll shadows through its rows.
    No number with an exponent splits at its minus."""
    tables = [(doc, t) for doc in PAGES for t in measured_pages[doc]["phone_tables"]]
    loose = [f"{doc}: {t['where']}" for doc, t in tables if t["scrolls"] and not t["tight"]]
    assert not loose, f"tables that scroll on a phone without being set closer first: {loose}"
    unheld = [f"{doc}: {t['where']} (first column {t['first_share']:.0%} of the screen)" for doc, t in tables
              if t["scrolls"] and t["first_share"] <= t["sticky_share"] and not (t["sticky"] and t["held"])]
    assert not unheld, f"tables that scroll on a phone and lose their first column: {unheld}"
    veiled = [f"{doc}: {t['where']} ({t['veiled']} rows)" for doc, t in tables if t["scrolls"] and t["veiled"]]
    assert not veiled, f"tables that scroll on a phone with opaque rows over their scroll shadows: {veiled}"
    split = [f"{doc}: {t['split']}" for doc, t in tables if t["split"]]
    assert not split, f"numbers split across lines in a phone's table: {split}"
    # Each path was taken somewhere, so none of the checks above went untested.
    assert any(t["tight"] and not t["scrolls"] for _, t in tables), "no table was made to fit by setting it closer"
    assert any(t["sticky"] and t["held"] for _, t in tables), "no table kept its first column in view"
    assert any(t["numbers"] for _, t in tables), "no table holds a number with an exponent"


def test_no_page_pans_sideways_on_a_phone(measured_pages):
    """At 390 px no page is wider than the screen: long inline code wraps (book/_static/kvcv.css),
    and whatever is wider than the column scrolls inside its own box."""
    wide = [f"{doc}: {m['page_width']['scroll']} px wide on a {m['page_width']['width']} px screen; "
            f"sticking out: {m['page_width']['out']}"
            for doc, m in measured_pages.items() if m["page_width"]["scroll"] > m["page_width"]["width"]]
    assert not wide, "pages that pan sideways at 390 px:\n" + "\n".join(wide)


def test_short_inline_code_is_read_whole_on_a_phone(measured_pages):
    """At 390 px a word of inline code in prose that fits a line is never split over two
    ("bash scripts/regenerate_results.sh --long" may break between its words, not inside
    "--long"); a longer one may break where it must (book/_static/kvcv.js, behaviour 7)."""
    split = [f"{doc}: {words}" for doc, m in measured_pages.items() if (words := m["phone_code_words"])]
    assert not split, "inline code split inside a word at 390 px:\n" + "\n".join(split)


def test_no_page_offers_a_launch_button(measured_pages):
    """The launch buttons are gone (_config.yml): a chapter opened on Colab or Binder fails on its first
    import, since labcode is not installed there."""
    shown = {doc: m["launch"] for doc, m in measured_pages.items() if m["launch"]}
    assert not shown, f"pages with launch buttons: {shown}"


# The smallest text of any figure, in CSS px as the page shows it: at 390 px about 56% of the body
# text's 16 px, and at 1280 px about 70% of it (before this rule, tick labels were 6-7 px on a phone).
PHONE_TEXT_PX, DESKTOP_TEXT_PX = 9.0, 11.0
_PNG_RECORDS: dict[str, dict] = {}


def _png_record(book_html: Path, url: str) -> dict:
    """What a figure's PNG records of itself (labcode.plotting.page_png): its smallest text, in CSS px
    at its natural size, and its pixels per CSS px. Empty for a PNG that records nothing."""
    if url not in _PNG_RECORDS:
        from PIL import Image

        path = book_html / unquote(urlsplit(url).path).lstrip("/")
        with Image.open(path) as image:
            text = getattr(image, "text", {}) or {}
        _PNG_RECORDS[url] = {k: float(text[k]) for k in (PNG_TEXT_KEY, PNG_SCALE_KEY) if k in text}
    return _PNG_RECORDS[url]


def rendered_text_px(book_html: Path, figure: dict) -> float | None:
    """The figure's smallest text as shown: its recorded size times the image's scale on the page
    (shown width over natural width in CSS px); None for a PNG that records no text size."""
    record = _png_record(book_html, figure["url"])
    if PNG_TEXT_KEY not in record or not figure["natural"]:
        return None
    natural_css = figure["natural"] / record.get(PNG_SCALE_KEY, 1.0)
    return record[PNG_TEXT_KEY] * figure["shown"] / natural_css


@pytest.mark.parametrize("width", [PHONE, DESKTOP])
def test_every_figure_is_legible(measured_pages, book_html, width):
    """Every figure's smallest text (ticks, legends, labels) is at least PHONE_TEXT_PX on a 390 px
    phone and DESKTOP_TEXT_PX at 1280 px, as rendered: the size its PNG records (labcode.plotting
    draws every figure of a notebook at twice the page's resolution and records its smallest text)
    times the scale the page shows it at."""
    least = PHONE_TEXT_PX if width == PHONE else DESKTOP_TEXT_PX
    figures = [(doc, f) for doc, m in measured_pages.items() for f in m["figures", width]]
    if CHAPTERS:
        assert figures, "no chapter shows a figure"
    small, unknown = [], []
    for doc, f in figures:
        px = rendered_text_px(book_html, f)
        if px is None:
            unknown.append(f"{doc}: {f['number']}")
        elif px < least:
            small.append(f"{doc}: {f['number']} smallest text {px:.1f} px (shown {f['shown']:.0f} px wide)")
    assert not (small or unknown), (
        f"at {width} px, figure text below {least} px:\n" + "\n".join(small)
        + "\nto fix: no fontsize below labcode.plotting.MIN_TEXT_PT in a figure as wide as the column (a narrower "
        "figure shrinks less on a phone)\nfigures whose PNG records no text size, drawn without labcode.plotting "
        "(call labcode.plotting.figure or use_book_style first): " + ", ".join(unknown))


def test_the_solution_title_opens_the_solution(page: Page, book_server):
    """A click on the link in a solution's title ("Solution to Exercise 1") opens the solution where
    it is, instead of jumping back to the exercise; a second click closes it."""
    doc = next((d for d in CHAPTERS if "{solution}" in (ROOT / f"{d}.ipynb").read_text()), None)
    if doc is None:
        pytest.skip("no chapter with an exercise solution in _toc.yml yet")
    watch = open_page(page, book_server, doc)
    solutions = page.locator("div.solution.dropdown")
    assert solutions.count() >= 1, f"{doc} has no solution"
    for i in range(solutions.count()):
        sol = solutions.nth(i)
        link = sol.locator(":scope > .admonition-title a").first
        body = sol.locator(":scope > :not(.admonition-title)").first
        button = sol.locator(".toggle-button").first
        url = page.url
        link.scroll_into_view_if_needed()
        top = page.evaluate("() => window.scrollY")
        link.click()
        body.wait_for(state="visible", timeout=5000)
        assert button.get_attribute("aria-expanded") == "true", f"{doc}: solution {i} did not open"
        assert page.url == url and abs(page.evaluate("() => window.scrollY") - top) < 2, (
            f"{doc}: the title of solution {i} jumped to {page.url}")
        link.click()
        body.wait_for(state="hidden", timeout=5000)
    watch.assert_clean(f"{doc} solution titles")


def test_a_figure_opens_at_full_size_and_closes(page: Page, book_server):
    """A click on a figure shows it over the page (on a phone at its size on a desk, so it scrolls);
    Escape closes it and gives the focus back to the figure."""
    doc = CHAPTERS[0] if CHAPTERS else pytest.skip("no chapter notebooks in _toc.yml yet")
    page.set_viewport_size({"width": PHONE, "height": 844})
    watch = open_page(page, book_server, doc)
    img = page.locator("article.bd-article figure img").first
    img.scroll_into_view_if_needed()
    shown = img.bounding_box()["width"]
    img.click()
    big = page.locator(".kvcv-enlarged img")
    big.wait_for(state="visible", timeout=5000)
    same = page.evaluate("""() => { const [a, b] = [document.querySelector("article.bd-article figure img"),
                                                     document.querySelector(".kvcv-enlarged img")];
                                    return a.src === b.src && a.alt === b.alt; }""")
    assert same, "the figure at full size is not the figure clicked"
    assert big.bounding_box()["width"] > 1.5 * shown, "the figure did not open larger than it is shown"
    page.keyboard.press("Escape")
    big.wait_for(state="hidden", timeout=5000)
    assert page.evaluate("() => document.activeElement === document.querySelector('article.bd-article figure img')")
    page.set_viewport_size({"width": DESKTOP, "height": 900})
    watch.assert_clean(f"{doc} figure at full size")


def test_running_it_yourself_gives_the_repository_and_a_clone_line(page: Page, book_server):
    url = yaml.safe_load((ROOT / "_config.yml").read_text())["repository"]["url"]
    open_page(page, book_server, "book/running")
    article = page.locator("article.bd-article")
    assert article.locator(f'a[href="{url}"]').count() >= 1, f"running.html does not link {url}"
    code = "\n".join(article.locator("pre").all_inner_texts())
    assert re.search(rf"^git clone {re.escape(url)}(\.git)?$", code, flags=re.M), code[:400]


def test_appendix_figures_are_numbered_with_its_letter(measured_pages):
    """Chapter N numbers its figures "Fig. N.k"; the appendix "Fig. A.k", never a bare "Fig. k"."""
    appendices = yaml.safe_load((ROOT / "_config.yml").read_text())["sphinx"]["config"]["kvcv_appendices"]
    bare = [(doc, i["number"]) for doc, m in measured_pages.items() for i in m["images"]
            if i["number"] and re.fullmatch(r"Fig\. \d+", i["number"])]
    assert not bare, f"figures numbered without their chapter: {bare}"
    for doc, letter in appendices.items():
        numbers = [i["number"] for i in measured_pages[doc]["images"]]
        assert numbers and all(n.startswith(f"Fig. {letter}.") for n in numbers), (doc, numbers)


def test_search_summaries_keep_table_cells_apart(page: Page, book_server):
    """A search summary of a page with a table shows its cells apart ("a · b"), not run together."""
    doc = next(d for d in CHAPTERS if "table" in (Path(ROOT / f"{d}.ipynb").read_text()))
    page.goto(f"{book_server}search.html", wait_until="load")
    html = page.evaluate("url => fetch(url).then(r => r.text())", f"{book_server}{doc}.html")
    text, cells = page.evaluate(
        """html => {
            const doc = new DOMParser().parseFromString(html, "text/html");
            const row = doc.querySelector("article.bd-article table tbody tr");
            return [window.KVCVSearch.articleText(html, ""),
                    [...row.querySelectorAll("td, th")].map(c => c.textContent.replace(/\\s+/g, " ").trim())];
        }""",
        html,
    )
    assert len(cells) >= 2, cells
    assert " · ".join(cells) in text, f"{doc}: the summary runs the cells {cells} together"


def test_bibliography_is_labelled_as_it_is_cited(page: Page, book_server):
    """Citations are author-year, so the bibliography's labels are too ("Vaswani et al. 2017")."""
    open_page(page, book_server, "book/references")
    labels = page.locator("article.bd-article div.citation > .label").all_inner_texts()
    assert labels, "no bibliography entries"
    odd = [t for t in labels if not re.fullmatch(r"\[?[^\[\]\d]+ \d{4}[a-z]?\]?", t.strip())]
    assert not odd, f"labels that are not author-year: {odd[:5]}"


# ---- the verification report -------------------------------------------------------------------

# A measured value as the report writes it: a number, a boolean, a list, "none", or a name.
MEASURED = re.compile(r"-?[\d,]+(\.\d+)?(e[-+]\d+)?|true|false|none|\[.*\]|[A-Za-z_][\w.]*")


def _shown_matches(shown: str, value) -> bool:
    """`shown` is `value` as the report writes it: exact for integers and booleans, and for floats
    within half a unit of the last significant digit shown."""
    import math

    if isinstance(value, bool):
        return shown == str(value).lower()
    if isinstance(value, int):
        return shown == f"{value:,}"
    if isinstance(value, float):
        x = float(shown.replace(",", ""))
        if x == 0:
            return value == 0
        mantissa = re.sub(r"e.*", "", shown).replace("-", "").replace(".", "").replace(",", "").lstrip("0")
        last = math.floor(math.log10(abs(x))) - len(mantissa) + 1  # the last digit's power of ten
        return abs(x - value) <= 0.5 * 10**last * (1 + 1e-9)
    return True


def test_report_shows_the_measured_value_beside_its_bound(page: Page, book_server):
    """Every check of qa/results/*.json has its row, with the value it measured (not the bound, not
    "true == true") in the measured column and the bound beside it; every performance target of the
    benchmark record has its row with its measured value and met / not met."""
    docs = {p.name: json.loads(p.read_text()) for p in sorted((ROOT / "qa" / "results").glob("*.json"))}
    watch = open_page(page, book_server, "qa/verdicts")
    rows = page.evaluate(
        """() => [...document.querySelectorAll("table.kvcv-checks, table.kvcv-targets")].map(t => [
              t.classList.contains("kvcv-targets") ? "targets" : t.closest("section").id,
              [...t.querySelectorAll("tbody tr")].map(r => ({
                  claim: r.cells[0].childNodes[0].textContent.trim(),
                  measured: (r.querySelector("td.kvcv-measured") || {}).innerText,
                  bound: (r.querySelector("td.kvcv-bound") || {}).innerText,
                  verdict: r.cells[3].innerText.trim(),
                  painted: getComputedStyle(r.cells[3]).backgroundColor !== "rgba(0, 0, 0, 0)",
              }))])"""
    )
    tables = dict(rows)
    # Every verdict is painted in its colour (kvcv.css), on odd rows as on even ones, in the table on a
    # desk and in the cards on a phone.
    unpainted = [(source, i) for source, shown in rows for i, row in enumerate(shown) if not row["painted"]]
    assert not unpainted, f"verdicts shown without their colour: {unpainted[:10]}"
    page.set_viewport_size({"width": PHONE, "height": 844})
    bare = page.evaluate(
        """() => [...document.querySelectorAll("table.kvcv-verdicts tbody td:is(.kvcv-pass, .kvcv-fail, .kvcv-miss)")]
              .filter(td => getComputedStyle(td).backgroundColor === "rgba(0, 0, 0, 0)").length"""
    )
    assert bare == 0, f"{bare} verdicts shown without their colour on a phone"
    page.set_viewport_size({"width": DESKTOP, "height": 900})
    problems = []
    for source, doc in docs.items():
        section = re.sub(r"[^a-z0-9]+", "-", source.lower()).strip("-")
        shown = tables.get(section)
        if shown is None or len(shown) != len(doc["checks"]):
            problems.append(f"{source}: {len(doc['checks'])} checks, {len(shown or [])} rows")
            continue
        for check, row in zip(doc["checks"], shown, strict=True):
            measured = (row["measured"] or "").strip()
            where = f"{source} {check['name']}"
            if not measured or not MEASURED.fullmatch(measured) or "rounding" in measured:
                problems.append(f"{where}: measured shows {measured!r}")
            elif not _shown_matches(measured, check["value"]):
                problems.append(f"{where}: measured shows {measured!r}, the file holds {check['value']!r}")
            bound = (row["bound"] or "").strip()
            if not bound or bound[0] not in "≤<≥>=":
                problems.append(f"{where}: no bound beside the value ({row['bound']!r})")
            if row["verdict"].lower().lstrip("✓✗ \u00a0") != ("pass" if check["passed"] else "fail"):
                problems.append(f"{where}: verdict {row['verdict']!r}")
    targets = docs["bench.json"]["values"]["targets"]
    shown = tables.get("targets", [])
    assert len(shown) == len(targets), f"{len(targets)} targets, {len(shown)} rows"
    for target, row in zip(targets, shown, strict=True):
        if not _shown_matches(row["measured"].strip(), float(target["measured"])):
            problems.append(f"target {target['name']}: measured shows {row['measured']!r}")
        if row["verdict"].strip().lstrip("○✓ \u00a0") != ("met" if target["met"] else "not met"):
            problems.append(f"target {target['name']}: verdict {row['verdict']!r}")
    assert not problems, "\n".join(problems[:30])
    watch.assert_clean("verification report")


def test_report_rolls_up_by_chapter_and_filters(page: Page, book_server):
    """The summary counts each chapter's checks and links to the list filtered to that chapter; the
    filter shows one chapter's rows, or the failed ones, or those whose claim has a word."""
    watch = open_page(page, book_server, "qa/verdicts")
    rows = page.locator("table.kvcv-checks tbody tr")
    total = rows.count()
    summary = page.evaluate(
        """() => [...document.querySelectorAll("table.kvcv-chapters tbody tr")].map(r => ({
              chapter: r.cells[0].innerText.trim(), href: r.cells[1].querySelector("a").getAttribute("href"),
              n: parseInt(r.cells[1].innerText), page: r.cells[0].querySelector("a").getAttribute("href")}))"""
    )
    assert summary and sum(s["n"] for s in summary) == total, (summary, total)
    # In dark mode the filter sits on the page, not on the light panel the theme gives HTML outputs.
    page.evaluate("() => { document.documentElement.dataset.theme = 'dark'; }")
    panel = page.evaluate(
        """() => getComputedStyle(document.querySelector("[data-kvcv-report-filter]")
                                  .closest(".cell_output .text_html")).backgroundColor"""
    )
    page.evaluate("() => { document.documentElement.dataset.theme = 'light'; }")
    assert panel == "rgba(0, 0, 0, 0)", f"the filter sits on a panel of {panel} in dark mode"
    first = summary[0]
    number = re.search(r"\d+", first["chapter"])[0]
    page.goto(book_server + "qa/verdicts.html" + first["href"], wait_until="load")
    visible = page.locator("table.kvcv-checks tbody tr:not([hidden])")
    assert visible.count() == first["n"], f"{first['href']} shows {visible.count()} rows, not {first['n']}"
    chapters = set(visible.evaluate_all("rs => rs.map(r => r.dataset.chapter)"))
    assert chapters == {number}, chapters
    links = set(visible.evaluate_all("rs => rs.map(r => r.cells[4].querySelector('a').getAttribute('href'))"))
    assert links == {first["page"]}, links
    page.select_option('[data-kvcv-filter="chapter"]', "")
    assert page.locator("table.kvcv-checks tbody tr:not([hidden])").count() == total
    page.select_option('[data-kvcv-filter="verdict"]', "fail")
    failed = page.locator("table.kvcv-checks tbody tr:not([hidden])").count()
    assert failed == page.locator('table.kvcv-checks tbody tr[data-verdict="fail"]').count()
    page.select_option('[data-kvcv-filter="verdict"]', "")
    page.fill('[data-kvcv-filter="words"]', "float32")
    claims = page.locator("table.kvcv-checks tbody tr:not([hidden])").evaluate_all(
        "rs => rs.map(r => r.cells[0].textContent)")
    assert claims and all("float32" in c.lower() for c in claims), claims[:3]
    assert page.locator('[data-kvcv-filter="count"]').inner_text() == f"{len(claims)} of {total} checks"
    watch.assert_clean("report filter")


def test_report_file_names_break_only_between_words(page: Page, book_server):
    """At 1280 px the result-file and command cells keep each word whole ("engines.json", never
    "engines.jso" / "n"): every line break falls after _ . / or a space."""
    page.set_viewport_size({"width": DESKTOP, "height": 900})
    open_page(page, book_server, "qa/verdicts")
    broken = page.evaluate(
        r"""() => {
            const bad = [];
            for (const code of document.querySelectorAll("td.kvcv-file code, td.kvcv-files-cell code")) {
                const range = document.createRange();
                const walker = document.createTreeWalker(code, NodeFilter.SHOW_TEXT);
                let lastTop = null, prev = "";
                for (let node = walker.nextNode(); node; node = walker.nextNode()) {
                    for (let i = 0; i < node.length; i++) {
                        range.setStart(node, i); range.setEnd(node, i + 1);
                        const rect = range.getClientRects()[0];
                        if (!rect) continue;
                        const here = node.data[i];  // a break at a space may put the space first
                        if (lastTop !== null && rect.top > lastTop + 2 && !/[_./\s]/.test(prev) && !/\s/.test(here))
                            bad.push(code.textContent);
                        lastTop = rect.top; prev = node.data[i];
                    }
                }
            }
            return bad;
        }"""
    )
    assert not broken, f"names broken inside a word: {broken}"


# ---- the explorer ----------------------------------------------------------------------------


def explorer(page: Page, base: str) -> Watch:
    watch = open_page(page, base, "book/explorer")
    page.locator("[data-kv-explorer] .kvx-strip").wait_for()
    return watch


def value(page: Page, key: str) -> int:
    node = page.locator(f'[data-kv-explorer] [data-kvx="{key}"]').first
    return int(node.get_attribute("data-value"))


def shown(page: Page, key: str) -> str:
    return page.locator(f'[data-kv-explorer] [data-kvx="{key}"]').first.inner_text()


def choose(page: Page, setting: str, number: float):
    page.locator(f'[data-kv-explorer] select[data-kvx-setting="{setting}"]').select_option(str(number))


def test_explorer_functions_match_labcode(page: Page, book_server):
    explorer(page, book_server)
    model = get_config("gpt2-124m")
    fixed = page.evaluate("() => window.KVExplorer.MODEL")
    assert fixed == {"nLayers": model.n_layers, "nHeads": model.n_heads, "headDim": model.head_dim}

    grid = list(product([1, 12], [1, 2, 8], [0, 1, 7, 1024], [1, 2, 4, 12], [64, 128], [1, 2, 4]))
    js = page.evaluate(
        """grid => grid.map(([l, b, t, h, d, s]) => [window.KVExplorer.cacheElements(l, b, t, h, d),
                                                     window.KVExplorer.cacheBytes(l, b, t, h, d, s)])""",
        grid,
    )
    py = [[kv_cache_elements(n, b, t, h, d), kv_cache_bytes(n, b, t, h, d, s)] for n, b, t, h, d, s in grid]
    assert js == py

    # int8: codes and one float32 scale per position and head (per group, with groups), as
    # labcode.engines.quant.QuantizedCache stores them.
    qgrid = list(product([1, 12], [1, 3], [0, 1, 9], [1, 4], [16, 64], [None, 8], [8, 4, 2, 3]))
    js = page.evaluate(
        "grid => grid.map(([l, b, t, h, d, g, q]) => window.KVExplorer.quantizedCacheBytes(l, b, t, h, d, g, q))",
        qgrid,
    )
    assert js == [quantized_kv_cache_bytes(*args) for args in qgrid]
    assert page.evaluate("() => [1, 2, 3, 4, 5, 8].map(window.KVExplorer.codesPerByte)") == [
        codes_per_byte(b) for b in (1, 2, 3, 4, 5, 8)
    ]
    # What labcode refuses, the explorer's function refuses too, rather than counting fractions of a byte.
    for bad in [(1, 1, 1, 1, 64, 7, 8), (1, 1, 1, 1, 64, None, 9), (1, 1, 1, 1, 5, None, 4)]:
        with pytest.raises(ValueError):
            quantized_kv_cache_bytes(*bad)
        thrown = page.evaluate("a => { try { window.KVExplorer.quantizedCacheBytes(...a); return null; }"
                               " catch (e) { return e.name; } }", list(bad))
        assert thrown == "RangeError", (bad, thrown)
    for n_layers, batch, tokens, heads, head_dim, group in [(12, 1, 9, 4, 64, None), (2, 3, 5, 2, 16, 8)]:
        cache = QuantizedCache(n_layers, group_size=group)
        cache.begin((batch, heads, tokens, head_dim), torch.float32, "cpu")  # one pass, as the model makes it
        for layer in range(n_layers):
            k = torch.randn(batch, heads, tokens, head_dim, generator=torch.Generator().manual_seed(layer))
            cache.append(layer, k, -k)
        cache.end()
        assert cache.nbytes == quantized_kv_cache_bytes(n_layers, batch, tokens, heads, head_dim, group)

    runs = list(product([1, 3, 6, 24], [0, 1, 2, 9], [True, False]))
    js = page.evaluate("runs => runs.map(([p, n, c]) => window.KVExplorer.positionsComputed(p, n, c))", runs)
    assert js == [positions_computed(p, n, c) for p, n, c in runs]

    budgets = list(product([1, 6, 10, 12], [0, 4, 20], [8, 10, 64]))
    js = page.evaluate("bs => bs.map(([p, n, c]) => window.KVExplorer.newTokenBudget(p, n, c))", budgets)
    assert [tuple(x) for x in js] == [new_token_budget(p, n, c) for p, n, c in budgets]


def test_explorer_answers_clicks_and_keys(page: Page, book_server):
    watch = explorer(page, book_server)
    model = get_config("gpt2-124m")
    L, D = model.n_layers, model.head_dim
    status = page.locator('[data-kv-explorer] [data-kvx="status"]')
    assert status.get_attribute("aria-live") == "polite"

    # The seed's capacity example: prompt 6, a position table of 10 rows, 20 tokens requested.
    choose(page, "prompt", 6)
    choose(page, "newTokens", 20)
    choose(page, "context", 10)
    choose(page, "kvHeads", 4)
    choose(page, "bytes", 2)
    n, reason = new_token_budget(6, 20, 10)
    assert reason == "context_length"

    page.locator('[data-kv-explorer] [data-kvx="next"]').click()
    page.locator('[data-kv-explorer] [data-kvx="next"]').click()
    page.locator('[data-kv-explorer] [data-kvx="strip"]').focus()
    before = status.inner_text()
    page.keyboard.press("ArrowRight")  # three steps past the prefill: the fourth forward call
    assert status.inner_text() != before
    step = 3
    with_cache, without = positions_computed(6, step + 1, True), positions_computed(6, step + 1, False)
    assert value(page, "computed") == with_cache[step] == 1
    assert value(page, "reused") == 6 + step - 1
    assert value(page, "cum-cached") == sum(with_cache)
    assert value(page, "cum-uncached") == sum(without)
    assert shown(page, "cum-uncached") == f"{sum(without):,}"
    assert value(page, "cache-tokens") == 6 + step
    total = kv_cache_bytes(L, 1, 6 + step, 4, D, 2)
    assert value(page, "bytes-total") == total
    assert value(page, "bytes-layer") == kv_cache_bytes(1, 1, 6 + step, 4, D, 2)
    assert f"= {total:,} bytes" in shown(page, "formula")
    assert page.locator('[data-kv-explorer] [data-state="computed"]').count() == 1
    assert page.locator('[data-kv-explorer] [data-state="reused"]').count() == 6 + step - 1

    # The last call: generation stops at the position table, with a visible reason.
    assert step == n - 1
    stop = page.locator('[data-kv-explorer] [data-kvx="stop"]')
    assert stop.is_visible() and "position table" in stop.inner_text()
    assert page.locator('[data-kv-explorer] [data-kvx="next"]').is_disabled()
    page.keyboard.press("n")
    assert value(page, "cum-cached") == sum(with_cache), "stepped past the position-table limit"

    # Cache off (key c): every position of the sequence is computed again, nothing is kept.
    page.keyboard.press("c")
    assert page.locator('[data-kv-explorer] [data-kvx="cache-toggle"]').get_attribute("aria-pressed") == "false"
    assert value(page, "computed") == without[step] == 6 + step
    assert value(page, "bytes-total") == 0
    page.locator('[data-kv-explorer] [data-kvx="cache-toggle"]').click()
    assert value(page, "computed") == 1

    # Multi-query attention shrinks the cache by the head ratio, and not the position counts.
    choose(page, "kvHeads", 1)
    assert value(page, "bytes-total") == kv_cache_bytes(L, 1, 6 + step, 1, D, 2)
    assert value(page, "cum-cached") == sum(with_cache)

    # A window of 4: older positions drop out and the cache stops growing.
    choose(page, "context", 64)
    choose(page, "window", 4)
    page.locator('[data-kv-explorer] [data-kvx="strip"]').focus()
    page.keyboard.press("End")
    n, _ = new_token_budget(6, 20, 64)
    seq = 6 + n - 1
    assert value(page, "cache-tokens") == 4
    assert value(page, "dropped") == seq - 4
    assert value(page, "visible") == 4
    assert value(page, "bytes-total") == kv_cache_bytes(L, 1, 4, 1, D, 2)
    assert value(page, "cum-uncached") == sum(positions_computed(6, n, False))
    assert "requested tokens generated" in page.locator('[data-kv-explorer] [data-kvx="stop"]').inner_text()

    # Back to the prefill with p and Home; the prefill computes the whole prompt.
    page.keyboard.press("p")
    page.keyboard.press("Home")
    assert value(page, "computed") == 6
    assert value(page, "cum-cached") == value(page, "cum-uncached") == 6
    watch.assert_clean("explorer")


def test_explorer_is_reachable_with_tab(page: Page, book_server):
    explorer(page, book_server)
    page.locator("article.bd-article h1").first.click()
    wanted = set(
        page.evaluate(
            """() => [...document.querySelectorAll(
                   '[data-kv-explorer] select, [data-kv-explorer] button, [data-kv-explorer] [tabindex="0"]')]
                 .filter(e => !e.disabled).map(e => e.id || e.dataset.kvx)"""
        )
    )
    assert len(wanted) >= 10, wanted
    reached = set()
    for _ in range(250):
        page.keyboard.press("Tab")
        reached.add(
            page.evaluate(
                "() => { const e = document.activeElement; return e && e.closest('[data-kv-explorer]') ? "
                "(e.id || e.dataset.kvx) : null }"
            )
        )
        if wanted <= reached:
            break
    assert wanted <= reached, f"not reachable with Tab: {wanted - reached}"


def _contrast(page: Page, selector: str) -> float:
    """WCAG contrast ratio between an element's text colour and its (first opaque) background."""
    return page.evaluate(
        """sel => {
            const parse = c => c.match(/[\\d.]+/g).map(Number);
            const lum = ([r, g, b]) => {
                const f = v => { v /= 255; return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; };
                return 0.2126 * f(r) + 0.7152 * f(g) + 0.0722 * f(b);
            };
            const el = document.querySelector(sel);
            let bg = null;
            for (let n = el; n; n = n.parentElement) {
                const c = parse(getComputedStyle(n).backgroundColor);
                if (c.length < 4 || c[3] > 0.9) { bg = c; break; }
            }
            bg = bg || [255, 255, 255];
            const [a, b] = [lum(parse(getComputedStyle(el).color)), lum(bg)];
            return (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05);
        }""",
        selector,
    )


def test_explorer_keys_hint_only_where_there_are_keys(browser, book_server):
    """The hint listing the explorer's keys shows with a mouse and keyboard, not on a touch-only phone."""
    shown = {}
    for name, options in (("desk", {"viewport": {"width": 1280, "height": 900}}),
                          ("phone", {"viewport": {"width": 390, "height": 844}, "is_mobile": True, "has_touch": True})):
        context = browser.new_context(**options)
        try:
            page = context.new_page()
            explorer(page, book_server)
            shown[name] = page.locator("[data-kv-explorer] .kvx-keys").is_visible()
        finally:
            context.close()
    assert shown == {"desk": True, "phone": False}, shown


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_explorer_readable_on_a_phone_in_both_themes(browser, book_server, artifacts_dir, scheme):
    context = browser.new_context(viewport={"width": 375, "height": 812}, color_scheme=scheme)
    try:
        page = context.new_page()
        watch = explorer(page, book_server)
        assert page.evaluate("() => document.documentElement.dataset.theme") == scheme
        page.locator('[data-kv-explorer] [data-kvx="next"]').click()
        overflow = page.evaluate(
            """() => [...document.querySelectorAll('[data-kv-explorer] *')]
                 .filter(e => e.getBoundingClientRect().right > window.innerWidth + 1)
                 .map(e => e.className || e.tagName)"""
        )
        assert not overflow, f"explorer elements wider than a 375px screen: {overflow[:5]}"
        for sel in (
            '[data-kvx="status"]',
            ".kvx-cell.kvx-computed",
            ".kvx-cell.kvx-reused",
            '.kvx-metric-value[data-kvx="computed"]',
            ".kvx-field label",
            ".kvx-hint",
        ):
            ratio = _contrast(page, "[data-kv-explorer] " + sel)
            assert ratio >= 4.5, f"{scheme}: contrast {ratio:.2f} for {sel}"
        # Viewport shots: a full-page shot of a phone layout paints the sticky header mid-page.
        for part, sel in (("settings", "[data-kv-explorer]"), ("positions", '[data-kvx="status"]')):
            page.locator(sel).first.evaluate("e => e.scrollIntoView()")
            page.screenshot(path=str(artifacts_dir / f"explorer-375px-{scheme}-{part}.png"))
        watch.assert_clean(f"explorer at 375px, {scheme}")
    finally:
        context.close()


def test_screenshots(browser, book_server, artifacts_dir):
    """Full-page screenshots of the introduction, one chapter and the explorer, for people to look at."""
    context = browser.new_context(viewport={"width": 1280, "height": 900}, color_scheme="light")
    try:
        page = context.new_page()
        chapter = CHAPTERS[0] if CHAPTERS else "book/verification"
        for name, doc in [("intro", "book/intro"), ("chapter", chapter), ("explorer", "book/explorer")]:
            open_page(page, book_server, doc)
            wait_for_maths(page)
            path = artifacts_dir / f"{name}.png"
            page.screenshot(path=str(path), full_page=True)
            assert path.stat().st_size > 10_000, path
    finally:
        context.close()


def test_explorer_edge_cases(page: Page, book_server):
    watch = explorer(page, book_server)
    model = get_config("gpt2-124m")
    stop = page.locator('[data-kv-explorer] [data-kvx="stop"]')

    # A prompt longer than the window is prefilled in chunks; only the last W positions stay.
    choose(page, "prompt", 10)
    choose(page, "window", 4)
    assert value(page, "computed") == positions_computed(10, 1, True)[0] == 10
    assert value(page, "dropped") == 6 and value(page, "cache-tokens") == 4
    assert value(page, "bytes-total") == kv_cache_bytes(model.n_layers, 1, 4, 12, model.head_dim, 2)
    assert page.locator('[data-kv-explorer] [data-state="dropped"]').count() == 6

    # A prompt that fills, or overflows, the position table generates nothing, and says why.
    for context in (10, 8):
        choose(page, "context", context)
        assert new_token_budget(10, 8, context)[0] == 0
        assert stop.is_visible() and "Nothing to generate" in stop.inner_text()
        assert page.locator('[data-kv-explorer] [data-kvx="next"]').is_disabled()
        assert value(page, "bytes-total") == 0 and value(page, "cum-uncached") == 0

    # One requested token: one forward call, and a sentence in the singular.
    choose(page, "context", 64)
    choose(page, "newTokens", 1)
    assert stop.is_visible() and stop.inner_text() == "Done: the one requested token generated."
    watch.assert_clean("explorer edge cases")


def test_explorer_counts_int8_scales(page: Page, book_server):
    """"int8 + scale" holds what chapter 9's QuantizedCache holds: D + 4 bytes per position and head
    (codes and one float32 scale), so (D + 4) / (4 D) of float32, as qa/engines checks, and "int4 +
    scale" D / 2 + 4 (two codes to a byte); sizes are shown to three significant digits."""
    watch = explorer(page, book_server)
    model = get_config("gpt2-124m")
    L, D = model.n_layers, model.head_dim
    choose(page, "prompt", 6)
    choose(page, "kvHeads", 4)
    choose(page, "batch", 2)
    page.locator('[data-kv-explorer] [data-kvx="last"]').click()
    tokens = value(page, "cache-tokens")
    choose(page, "bytes", 4)
    float32 = value(page, "bytes-total")
    assert float32 == kv_cache_bytes(L, 2, tokens, 4, D, 4)
    choose(page, "bytes", 1)
    int8 = value(page, "bytes-total")
    assert int8 == quantized_kv_cache_bytes(L, 2, tokens, 4, D) == 2 * L * 2 * tokens * 4 * (D + 4)
    assert value(page, "bytes-total") / float32 == (D + 4) / (4 * D)
    assert value(page, "bytes-layer") == quantized_kv_cache_bytes(1, 2, tokens, 4, D)
    assert value(page, "bytes-limit") == quantized_kv_cache_bytes(L, 2, 32, 4, D)  # the 32-row position table
    assert f"(D + 4) = 2 × 2 × {L} × 4 × {tokens} × ({D} + 4) = {value(page, 'bytes-total'):,} bytes" in shown(
        page, "formula"
    )
    choose(page, "bytes", 0.5)  # int4: two codes to a byte, as chapter 9's cache packs them
    int4 = value(page, "bytes-total")
    assert int4 == quantized_kv_cache_bytes(L, 2, tokens, 4, D, bits=4) == 2 * L * 2 * tokens * 4 * (D // 2 + 4)
    assert f"(D / 2 + 4) = 2 × 2 × {L} × 4 × {tokens} × ({D} / 2 + 4) = {value(page, 'bytes-total'):,} bytes" in shown(
        page, "formula"
    )
    assert "type=int4" in page.url

    # Sizes side by side read alike, three digits each: 36.0 MiB next to 1.13 MiB, not 36.00 MiB, and
    # 0.984 MiB (not 0.98) just below a mebibyte.
    sizes = [1000, 1024, 4915, 58752, 208896, 1032192, 1048575, 1185792, 37748736, 3 * 2**30 + 2**29]
    texts = page.evaluate("sizes => sizes.map(window.KVExplorer.formatBytes)", sizes)
    assert texts[0] == "1,000 B"
    for size, text in zip(sizes[1:], texts[1:], strict=True):
        m = re.fullmatch(r"(0\.\d\d\d|[1-9]\.\d\d|\d\d\.\d|\d\d\d) (KiB|MiB|GiB)", text)
        assert m, f"{size} bytes shown as {text!r}"
        scale = 1024 ** (["KiB", "MiB", "GiB"].index(m[2]) + 1)
        assert abs(float(m[1]) * scale - size) <= 0.005 * size, f"{size} bytes shown as {text!r}"
    choose(page, "batch", 1)
    choose(page, "kvHeads", 12)
    choose(page, "context", 1024)
    choose(page, "bytes", 2)
    assert shown(page, "bytes-limit") == "36.0 MiB"
    watch.assert_clean("explorer int8")


def _explorer_state(page: Page) -> dict:
    return page.evaluate(
        """() => ({
            selects: Object.fromEntries([...document.querySelectorAll('[data-kv-explorer] select')]
                .map(s => [s.dataset.kvxSetting, s.value])),
            cache: document.querySelector('[data-kv-explorer] [data-kvx="cache-toggle"]').getAttribute('aria-pressed'),
            status: document.querySelector('[data-kv-explorer] [data-kvx="status"]').textContent,
            bytes: document.querySelector('[data-kv-explorer] [data-kvx="bytes-total"]').dataset.value,
        })"""
    )


def test_explorer_keeps_its_settings_in_the_address(page: Page, book_server):
    """The address holds the settings and the step: a reload restores them, the address can be shared,
    a change replaces the history entry (Back leaves the page) and Back/Forward return to the same view."""
    watch = open_page(page, book_server, "book/glossary")
    explorer(page, book_server)
    history = page.evaluate("() => history.length")
    choose(page, "prompt", 6)
    choose(page, "kvHeads", 4)
    choose(page, "bytes", 1)
    choose(page, "window", 4)
    page.locator('[data-kv-explorer] [data-kvx="next"]').click()
    page.locator('[data-kv-explorer] [data-kvx="next"]').click()
    page.keyboard.press("c")
    query = dict(parse_qsl(urlsplit(page.url).query))
    assert query == {"prompt": "6", "kv": "4", "type": "int8", "window": "4", "cache": "off", "step": "2"}, page.url
    assert page.evaluate("() => history.length") == history, "each change added a history entry"
    before = _explorer_state(page)
    assert "Forward call 3 of 8" in before["status"] and before["cache"] == "false"

    page.reload(wait_until="load")
    page.locator("[data-kv-explorer] .kvx-strip").wait_for()
    assert _explorer_state(page) == before, "a reload lost the settings"

    # Another page and back: the same view; Back once more leaves for the page before the explorer.
    page.locator("article.bd-article a[href*='glossary.html']").first.click()
    page.wait_for_url("**/glossary.html**")
    page.go_back(wait_until="load")
    page.locator("[data-kv-explorer] .kvx-strip").wait_for()
    assert _explorer_state(page) == before, "Back did not return to the same settings"
    page.go_back(wait_until="load")
    assert urlsplit(page.url).path.endswith("/book/glossary.html"), page.url

    # A shared address opens the same view in a fresh page; unknown values keep their defaults.
    fresh = page.context.new_page()
    fresh.goto(f"{book_server}book/explorer.html?" + urlencode(query), wait_until="load")
    fresh.locator("[data-kv-explorer] .kvx-strip").wait_for()
    assert _explorer_state(fresh) == before, "a shared address did not restore the view"
    fresh.goto(f"{book_server}book/explorer.html?prompt=999&kv=5&type=int3&step=x&batch=2", wait_until="load")
    fresh.locator("[data-kv-explorer] .kvx-strip").wait_for()
    state = _explorer_state(fresh)
    defaults = fresh.evaluate("() => window.KVExplorer.DEFAULTS")
    assert state["selects"]["prompt"] == str(defaults["prompt"]) and state["selects"]["kvHeads"] == str(
        defaults["kvHeads"]
    )
    assert state["selects"]["bytes"] == str(defaults["bytes"]) and state["selects"]["batch"] == "2"
    assert dict(parse_qsl(urlsplit(fresh.url).query)) == {"batch": "2"}, "the address was not cleaned up"
    fresh.close()
    watch.assert_clean("explorer address")


def test_explorer_step_buttons_never_leave_one_alone(page: Page, book_server):
    """"Last »" never wraps onto a row of its own: one row of four, or two rows of two."""
    explorer(page, book_server)
    for width in (DESKTOP, PHONE):
        page.set_viewport_size({"width": width, "height": 900})
        rows = page.evaluate(
            """() => { const rows = {};
                       for (const b of document.querySelectorAll('[data-kv-explorer] .kvx-nav .kvx-btn')) {
                         const top = Math.round(b.getBoundingClientRect().top);
                         (rows[top] = rows[top] || []).push(b.textContent.trim());
                       }
                       return Object.values(rows); }"""
        )
        assert sum(map(len, rows)) == 4 and all(len(r) >= 2 for r in rows), f"at {width} px the buttons sit {rows}"
        assert all(len(r) == len(rows[0]) for r in rows), f"at {width} px the rows are uneven: {rows}"


def test_glued_values_read_as_part_of_their_sentence(browser, book_server):
    """A value inserted with {glue:text} has its paragraph's weight, not myst-nb's bold (bold is for what
    the reader must not miss, and the authors write it as **...** around the value)."""
    doc = next((d for d in CHAPTERS if "07_counting" in d), None) or (CHAPTERS[0] if CHAPTERS else None)
    if doc is None:
        pytest.skip("no chapters in _toc.yml yet")
    context = browser.new_context(viewport={"width": DESKTOP, "height": 900})
    try:
        page = context.new_page()
        open_page(page, book_server, doc)
        weights = page.evaluate("""() => [...document.querySelectorAll('article p span.pasted-text')]
            .filter(s => !s.closest('strong, b, th, h1, h2, h3, h4'))
            .map(s => [getComputedStyle(s).fontWeight, getComputedStyle(s.parentElement).fontWeight])""")
        assert weights, f"{doc}: no glued value in a paragraph"
        assert all(own == parent for own, parent in weights), f"{doc}: glued values set apart: {weights[:5]}"
    finally:
        context.close()
