"""The built book: a clean build with warnings as errors, every page present and non-empty, no broken
internal links or anchors, nothing loaded from another site, MathJax served from the book."""

from __future__ import annotations

import datetime as dt
import re
from functools import cache
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from bs4 import BeautifulSoup

from conftest import ROOT, toc_files

# Attributes through which a page loads or links to something.
LINK_ATTRS = {
    "a": "href",
    "link": "href",
    "script": "src",
    "img": "src",
    "source": "src",
    "iframe": "src",
    "video": "src",
    "audio": "src",
}
# Resources the browser fetches by itself (as opposed to links a reader may follow).
RESOURCE_TAGS = {"script", "link", "img", "source", "iframe", "video", "audio"}


def _pages(html: Path) -> list[Path]:
    """Every HTML page of the book (not the copied sources or static assets)."""
    skip = {"_static", "_sources", "_images"}
    return sorted(p for p in html.rglob("*.html") if not skip & set(p.relative_to(html).parts))


@cache
def _soup(path: Path) -> BeautifulSoup:
    return BeautifulSoup(path.read_text(encoding="utf-8"), "html.parser")


@cache
def _ids(path: Path) -> frozenset[str]:
    soup = _soup(path)
    return frozenset(
        [t["id"] for t in soup.find_all(id=True)] + [t["name"] for t in soup.find_all("a", attrs={"name": True})]
    )


def _article(path: Path):
    return _soup(path).find("article", class_="bd-article")


def test_book_builds_with_warnings_as_errors(book_build):
    assert book_build.returncode == 0, "jupyter-book build -W failed:\n" + book_build.log[-6000:]
    assert (book_build.html / "index.html").exists()


def test_every_toc_entry_exists_and_has_a_page(book_html):
    missing_source = [f for f in toc_files() if not any((ROOT / f"{f}{ext}").exists() for ext in (".md", ".ipynb"))]
    assert not missing_source, f"_toc.yml names files that do not exist: {missing_source}"
    missing_page = [f for f in toc_files() if not (book_html / f"{f}.html").exists()]
    assert not missing_page, f"no HTML page was built for {missing_page}"


def test_toc_has_the_planned_parts():
    import yaml

    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    assert toc["root"] == "book/intro"
    captions = [part["caption"] for part in toc["parts"]]
    for caption in ("Getting started", "Verification", "Reference"):
        assert caption in captions, captions
    for page in ("book/running", "book/verification", "book/explorer", "book/glossary", "book/references"):
        assert page in toc_files(), page


def test_no_page_is_empty(book_html):
    thin = {}
    for f in toc_files():
        article = _article(book_html / f"{f}.html")
        text = article.get_text(" ", strip=True) if article else ""
        if article is None or article.find("h1") is None or len(text) < 300:
            thin[f] = text[:120]
    assert not thin, f"pages without a title or with almost no content: {thin}"


def _internal_targets(html: Path):
    """(page, raw reference, target file, fragment) for every relative href/src in the book."""
    for page in _pages(html):
        for tag, attr in LINK_ATTRS.items():
            for node in _soup(page).find_all(tag, attrs={attr: True}):
                ref = node[attr].strip()
                parts = urlsplit(ref)
                if parts.scheme or ref.startswith("//") or not ref:
                    continue
                target = page if not parts.path else (page.parent / unquote(parts.path)).resolve()
                if parts.path.endswith("/"):
                    target = target / "index.html"
                yield page, ref, target, unquote(parts.fragment)


def test_no_broken_internal_links_or_anchors(book_html):
    broken = []
    checked = 0
    for page, ref, target, fragment in _internal_targets(book_html):
        checked += 1
        where = f"{page.relative_to(book_html)} -> {ref}"
        if not target.is_relative_to(book_html.resolve()) or not target.exists():
            broken.append(f"{where} (missing file)")
        elif fragment and target.suffix == ".html" and fragment not in _ids(target):
            broken.append(f"{where} (no element with id {fragment!r})")
    assert checked > 100, f"only {checked} internal references found: is the parser looking at the pages?"
    assert not broken, "broken internal links:\n" + "\n".join(broken[:40])


def test_nothing_is_loaded_from_another_site(book_html):
    external = []
    for page in _pages(book_html):
        soup = _soup(page)
        for tag in RESOURCE_TAGS:
            attr = LINK_ATTRS[tag]
            for node in soup.find_all(tag, attrs={attr: True}):
                if tag == "link" and not {"stylesheet", "preload", "modulepreload", "icon", "prefetch"} & set(
                    node.get("rel", [])
                ):
                    continue
                if re.match(r"^(https?:)?//", node[attr].strip()):
                    external.append(f"{page.relative_to(book_html)}: <{tag} {attr}={node[attr]}>")
        for style in soup.find_all("style"):
            if re.search(r"(@import|url\()\s*['\"]?(https?:)?//", style.get_text()):
                external.append(f"{page.relative_to(book_html)}: external url in an inline style")
    for css in (book_html / "_static").rglob("*.css"):
        if re.search(r"(@import\s+(url\()?|url\()\s*['\"]?(https?:)?//", css.read_text(errors="replace")):
            external.append(f"{css.relative_to(book_html)}: loads an external url")
    assert not external, "resources from other sites:\n" + "\n".join(sorted(set(external))[:40])


def test_mathjax_is_served_from_the_book(book_html):
    page = book_html / "book" / "explorer.html"  # has display maths
    scripts = [s["src"] for s in _soup(page).find_all("script", src=True) if "mathjax" in s["src"].lower()]
    assert scripts, "no MathJax script on a page with maths"
    for src in scripts:
        assert not urlsplit(src).scheme and not src.startswith("//"), src
        assert (page.parent / urlsplit(src).path).resolve().is_file(), src
    assert "\\cdot" in _article(page).get_text(), "the explorer's formula is missing"


def test_footer_shows_version_and_build_date(book_html):
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), flags=re.M).group(1)
    footers = _soup(book_html / "book" / "intro.html").find_all("footer")
    text = " ".join(f.get_text(" ", strip=True) for f in footers)
    assert f"version {version}" in text, f"footer does not show version {version}: {text!r}"
    m = re.search(r"Last updated on (\d{4}-\d{2}-\d{2})", text)
    assert m, f"no build date in the footer: {text!r}"
    built = dt.date.fromisoformat(m.group(1))
    assert abs((dt.date.today() - built).days) <= 1, built


def test_no_local_paths_in_pages(book_html):
    leaks = [str(p.relative_to(book_html)) for p in _pages(book_html) if str(ROOT) in p.read_text(encoding="utf-8")]
    assert not leaks, f"pages that show this machine's checkout path {ROOT}: {leaks}"


def test_bibliography_lists_every_reference(book_html):
    bib = (ROOT / "book" / "references.bib").read_text()
    titles = re.findall(r"^\s*title\s*=\s*\{(.+)\},?\s*$", bib, flags=re.M)
    assert len(titles) == len(re.findall(r"^@\w+\{", bib, flags=re.M)), titles
    article = _article(book_html / "book" / "references.html")
    entries = [e.get_text(" ", strip=True).lower() for e in article.find_all(attrs={"role": "doc-biblioentry"})]
    assert len(entries) == len(titles), f"{len(entries)} entries shown for {len(titles)} in references.bib"

    def plain(title: str) -> str:
        return re.sub(r"\s+", " ", re.sub(r"[{}]", "", title)).lower()

    missing = [t for t in titles if not any(plain(t) in e for e in entries)]
    assert not missing, f"references missing from the bibliography page: {missing}"


def test_citations_read_as_their_bibliography_labels(book_html):
    """Every citation in the text names its entry as the bibliography labels it, the author-year label's
    letter included where two entries share a name and a year ("Hugging Face, 2026a" for the entry
    labelled "Hugging Face 2026a"; book/_ext/kvcv_bibstyle.py)."""
    references = book_html / "book" / "references.html"
    labels = {
        entry["id"]: entry.find(class_="label").get_text(strip=True).strip("[]")
        for entry in _article(references).find_all(attrs={"role": "doc-biblioentry"})
    }
    cited, wrong = 0, []
    for page in _pages(book_html):
        for link in _article(page).find_all("a", href=re.compile(r"references\.html#")) if _article(page) else []:
            target = link["href"].split("#", 1)[1]
            if target not in labels:
                continue
            cited += 1
            text = re.sub(r",\s*(?=\d{4}[a-z]?$)", " ", " ".join(link.get_text().split()))
            if text != labels[target]:
                wrong.append(f"{page.relative_to(book_html)}: {link.get_text(strip=True)!r} for {labels[target]!r}")
    assert cited, "no citation links to the bibliography"
    assert any(label[-1].isalpha() for label in labels.values()), "no label has a letter: the letters go untested"
    assert not wrong, "citations that do not read as their labels:\n" + "\n".join(sorted(set(wrong))[:10])


@pytest.mark.parametrize(
    "term",
    [
        "KV cache",
        "prefill",
        "decode",
        "offset causal mask",
        "window cache",
        "ring buffer",
        "grouped-query attention",
        "multi-query attention",
        "position table",
        "K-shift",
        "paged cache",
        "copy-on-write",
        "online softmax",
        "quantised KV",
        "continuous batching",
        "radix tree",
        "rollback",
        "speculative decoding",
        "beam search",
    ],
)
def test_glossary_defines_term(book_html, term):
    article = _article(book_html / "book" / "glossary.html")
    terms = {dt_.get_text(" ", strip=True).replace("\uf0c1", "").strip().lower() for dt_ in article.find_all("dt")}
    assert term.lower() in {t.rstrip("#").strip() for t in terms}, sorted(terms)


def test_explorer_page_loads_its_script_and_mount_point(book_html):
    soup = _soup(book_html / "book" / "explorer.html")
    assert soup.find(attrs={"data-kv-explorer": True}) is not None, "no mount point for the explorer"
    scripts = [s["src"] for s in soup.find_all("script", src=True)]
    js = [s for s in scripts if urlsplit(s).path.endswith("_static/explorer.js")]
    assert js, scripts
    assert (book_html / "_static" / "explorer.js").is_file()
    assert (book_html / "_static" / "explorer.css").is_file()


def test_ci_publishes_the_book_these_tests_built(book_build):
    """The published HTML is the build the browser tests checked, not a second, unchecked build."""
    import yaml

    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "ci.yml").read_text())
    steps = workflow["jobs"]["test"]["steps"]
    uploads = [step for step in steps if step.get("uses", "").startswith("actions/upload-pages-artifact")]
    assert uploads and ROOT / uploads[0]["with"]["path"] == book_build.html, (uploads, book_build.html)
    assert any(step.get("uses", "").startswith("actions/deploy-pages") for step in workflow["jobs"]["publish"]["steps"])
    build = (ROOT / "scripts" / "build.sh").read_text()
    assert "jupyter-book build . " in build, "build.sh builds the book readers build locally"


def test_intro_and_glossary_link_every_chapter_in_the_book(book_html):
    """The {chapter} role links a chapter once it is in _toc.yml; until then it is plain text."""
    chapters = [f for f in toc_files() if f.startswith("notebooks/")]
    for page in ("book/intro", "book/glossary"):
        article = _article(book_html / f"{page}.html")
        linked = {urlsplit(a["href"]).path for a in article.find_all("a", href=True)}
        missing = [f for f in chapters if f"../{f}.html" not in linked]
        assert not missing, f"{page} does not link the chapters {missing}"
        pending = [e.get_text() for e in article.select(".kvcv-chapter-pending")]
        for f in chapters:
            title = _article(book_html / f"{f}.html").find("h1").get_text().replace("#", "").strip()
            assert title not in pending, f"{page}: {title!r} is in the book but shown as not written yet"
    intro = _article(book_html / "book" / "intro.html")
    if "qa/verdicts" in toc_files():
        assert intro.find("a", href="../qa/verdicts.html"), "the introduction does not link the verification report"


def test_notebook_pages_offer_a_download_and_no_launch_link(book_html):
    """Each notebook page links its own .ipynb for download, and none links Binder or Colab: the launch
    buttons were removed because a chapter opened there fails on its first import of `labcode`."""
    chapters = [f for f in toc_files() if f.startswith(("notebooks/", "qa/"))]
    if not chapters:
        pytest.skip("no notebook pages in _toc.yml yet")
    for f in chapters:
        soup = _soup(book_html / f"{f}.html")
        hrefs = [a["href"] for a in soup.find_all("a", href=True)]
        assert not [h for h in hrefs if "mybinder.org" in h or "colab.research.google.com" in h], f
        assert any(h.endswith(f"_sources/{f}.ipynb") for h in hrefs), f"{f}: no download link for the notebook"


def test_every_chapter_says_how_long_it_takes_to_read(book_html):
    """Each chapter page (notebooks/) carries, right under its title, the reading-time line that
    book/_ext/kvcv_reading_time.py computes from the page's prose, and its minutes follow from its words
    at the extension's pace; pages that are not chapters carry none."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("kvcv_reading_time", ROOT / "book" / "_ext" / "kvcv_reading_time.py")
    ext = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ext)
    chapters = [f for f in toc_files() if f.startswith("notebooks/")]
    if not chapters:
        pytest.skip("no chapters in _toc.yml yet")
    for f in chapters:
        article = _article(book_html / f"{f}.html")
        lines = article.select("p.kvcv-reading-time")
        assert len(lines) == 1, f"{f}: {len(lines)} reading-time lines"
        heading = article.find("h1")
        assert heading is not None and heading.find_next("p") is lines[0], f"{f}: the line is not under the title"
        m = re.fullmatch(r"About (\d+) minutes to read \(([\d,]+) words of prose\)\.", lines[0].get_text(strip=True))
        assert m, f"{f}: {lines[0].get_text()!r}"
        minutes, words = int(m[1]), int(m[2].replace(",", ""))
        assert words > 500, f"{f}: only {words} words counted: the count misses the prose"
        assert lines[0].get_text(strip=True) == ext.reading_line(words)
        assert minutes >= 1
    for f in [f for f in toc_files() if not f.startswith("notebooks/")]:
        assert not _article(book_html / f"{f}.html").select("p.kvcv-reading-time"), f"{f} is not a chapter"


def test_verification_report_tells_its_rows_apart(book_html):
    """The report's rows, as a reader reads them: a value that misses its bound never reads as the
    bound itself (1.302 against 1.3, not 1.3), and two checks of one file that make the same claim
    show their names."""
    if "qa/verdicts" not in toc_files():
        pytest.skip("the verification report is not in _toc.yml yet")
    article = _article(book_html / "qa" / "verdicts.html")
    tables = article.select("table.kvcv-checks, table.kvcv-targets")
    assert len(tables) > 10, "the report shows a table per result file and one of targets"
    for table in tables:
        claims = []
        for row in table.select("tbody tr"):
            cells = row.find_all("td", recursive=False)
            claim = cells[0].find(string=True, recursive=False) or ""
            shown = cells[1].get_text().strip()
            held = cells[2].get_text().replace("\u00a0", " ").split(" ", 1)[1].strip()
            verdict = cells[3].get_text().strip()
            if verdict in ("fail", "not met"):
                assert shown != held, f"{claim!r}: measured {shown} reads as its bound {held}, yet {verdict}"
            claims.append((claim.strip(), cells[0].select_one(".kvcv-reason code")))
        texts = [c for c, _ in claims]
        for claim, name in claims:
            if texts.count(claim) > 1:
                assert name is not None, f"two checks claim {claim!r} and the report cannot tell them apart"
