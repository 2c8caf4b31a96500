/* "KV Cache, Verified": the book's small behaviours in the browser. tests/test_browser.py checks each.
 *
 * 1. Search-result summaries that read as prose. Sphinx's search page (searchtools.js) shows under
 *    each result a passage of the page's text, taken from the element with role="main". In
 *    pydata-sphinx-theme that element also holds the page's toolbar and its "Contents" sidebar, the
 *    page source holds maths as raw LaTeX (\(...\)) because MathJax typesets it only in the
 *    browser, and a table's cells have no space between them. This replaces Search.htmlToText, on
 *    the search page only, with one that reads the article alone, writes maths as plain text and
 *    keeps table cells apart ("a · b").
 * 2. A solution's title opens the solution: its link to the exercise would jump away instead; the
 *    space before the link's text stands outside it, not underlined.
 * 3. A figure opens at full size when clicked or tapped (Enter or Space from the keyboard), over
 *    the page, until clicked again or Escape.
 * 4. The verification report's filter (qa/verdicts): by chapter, verdict and words of the claim;
 *    the address keeps the chapter (?chapter=4), so the report's summary links to it.
 * 5. Inline code in a table may break after / _ : (a <wbr>), so a long name or path does not
 *    widen its column and squeeze the others (chapter 9's comparison of engines); so may a name in
 *    its text, after a / or _ between letters (full_vs_truncated, bytes/token).
 *    A number in a table is read whole: one written with an exponent (1e-12) does not break after
 *    its minus sign.
 * 6. A table wider than the text column (on a phone, mostly) first sets closer (kvcv-tight), which
 *    makes most of them fit; one that still does not fit scrolls sideways with its first column
 *    kept in view (kvcv-sticky), so each row keeps its name, unless that column is itself wide.
 *    Measured again when the window's width changes (a phone turned) and once the fonts are in.
 * 7. A short word of inline code in prose that holds a hyphen (--long, top-k) is read whole: the
 *    browser would otherwise end a line after its hyphen ("--" / "long"). A longer one may still
 *    break where it must, so that it never widens the column.
 */
(function () {
  "use strict";

  var SYMBOLS = {
    cdot: "\u00B7", times: "\u00D7", le: "\u2264", leq: "\u2264", ge: "\u2265", geq: "\u2265", ne: "\u2260",
    neq: "\u2260", approx: "\u2248", to: "\u2192", rightarrow: "\u2192", leftarrow: "\u2190", mapsto: "\u21A6",
    infty: "\u221E", sum: "\u03A3", prod: "\u03A0", ldots: "\u2026", dots: "\u2026", cdots: "\u2026",
    in: "\u2208", pm: "\u00B1", top: "\u1D40", lceil: "\u2308", rceil: "\u2309", lfloor: "\u230A",
    rfloor: "\u230B", alpha: "\u03B1", beta: "\u03B2", gamma: "\u03B3", delta: "\u03B4", epsilon: "\u03B5",
    varepsilon: "\u03B5", theta: "\u03B8", lambda: "\u03BB", mu: "\u03BC", pi: "\u03C0", sigma: "\u03C3",
    tau: "\u03C4", phi: "\u03C6", omega: "\u03C9", ell: "\u2113", Delta: "\u0394", Sigma: "\u03A3",
    quad: " ", qquad: " ", hat: "", bar: "", tilde: "", vec: "", underbrace: "", overbrace: "",
    displaystyle: "", limits: "", nolimits: "",
  };
  var KEEP = { frac: 1, dfrac: 1, tfrac: 1, sqrt: 1 }; // rewritten once their arguments are plain text

  /* LaTeX as a reader would write it in plain text: \frac{a}{b} -> (a)/(b), \text{x} -> x, \cdot -> ·. */
  function texToText(tex) {
    var s = tex.trim()
      .replace(/^\\\(|\\\)$/g, "")
      .replace(/^\\\[|\\\]$/g, "")
      .replace(/^\$\$?|\$\$?$/g, "")
      .replace(/\\begin\{[a-z*]+\}|\\end\{[a-z*]+\}/g, " ")
      .replace(/\\(?:left|right|bigg?|Bigg?)\b\s*\\?/g, "")
      .replace(/\\(?:text|mathrm|mathbf|mathit|mathsf|mathtt|operatorname|textbf|textit)\s*\{([^{}]*)\}/g, "$1")
      .replace(/\\([A-Za-z]+)/g, function (whole, name) {
        if (KEEP[name]) return whole;
        return Object.prototype.hasOwnProperty.call(SYMBOLS, name) ? SYMBOLS[name] : name;
      })
      .replace(/\\[,;:! ]/g, " ")
      .replace(/\\\\|&/g, " ");
    for (var i = 0; i < 6; i++) {
      s = s
        .replace(/\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}/g, "($1)/($2)")
        .replace(/\\sqrt\s*\{([^{}]*)\}/g, "\u221A($1)")
        .replace(/([_^])\{([^{}\s]*)\}/g, "$1$2")
        .replace(/([_^])\{([^{}]*)\}/g, "$1($2)")
        .replace(/(?<!\\[dt]?frac\s*|\}\s*|\\sqrt\s*)\{([^{}]*)\}/g, "$1");
    }
    return s.replace(/\\[A-Za-z]+/g, "").replace(/[{}\\]/g, "").replace(/\s+/g, " ").trim();
  }

  function articleText(htmlString, anchor) {
    var doc = new DOMParser().parseFromString(htmlString, "text/html");
    var article = doc.querySelector("article.bd-article");
    if (!article) return null;
    var drop = article.querySelectorAll(".headerlink, script, style, button, .copybtn, .toggle-details__summary");
    for (var i = 0; i < drop.length; i++) drop[i].remove();
    var maths = article.querySelectorAll(".math");
    for (var j = 0; j < maths.length; j++) maths[j].textContent = " " + texToText(maths[j].textContent) + " ";
    // Table cells and rows kept apart: "a · b · c; d · e · f", not "abcdef".
    var rows = article.querySelectorAll("tr");
    for (var r = 0; r < rows.length; r++) {
      var cells = rows[r].querySelectorAll("th, td");
      for (var c = 0; c < cells.length; c++) {
        cells[c].appendChild(doc.createTextNode(c < cells.length - 1 ? " \u00B7 " : "; "));
      }
    }
    var part = anchor ? doc.getElementById(anchor.replace(/^#/, "")) : null;
    var node = part && article.contains(part) ? part : article;
    return node.textContent.replace(/\s+/g, " ").trim();
  }

  function install() {
    /* global Search */
    if (typeof Search === "undefined" || !Search.htmlToText || Search.kvcvArticleText) return;
    var original = Search.htmlToText;
    Search.htmlToText = function (htmlString, anchor) {
      var text = articleText(htmlString, anchor);
      return text === null ? original(htmlString, anchor) : text;
    };
    Search.kvcvArticleText = true;
  }

  /* 2. A click on the link in a solution's title (sphinx-exercise: "Solution to Exercise 3") would
   * follow it back to the exercise; the title's own handler (sphinx-togglebutton) opens the solution. */
  function solutionTitles() {
    var links = document.querySelectorAll("div.solution.dropdown > .admonition-title a");
    for (var i = 0; i < links.length; i++) {
      // "Solution to<a> Exercise 1.1</a>": the space goes before the link, so it is not underlined.
      var first = links[i].firstChild;
      if (first && first.nodeType === 3 && /^\s/.test(first.data)) {
        first.data = first.data.replace(/^\s+/, "");
        links[i].parentNode.insertBefore(document.createTextNode(" "), links[i]);
      }
      links[i].addEventListener("click", function (event) {
        event.preventDefault();
        event.stopPropagation(); // the title's handler finds no button from a link: press it here
        var button = event.currentTarget.closest(".admonition-title").querySelector(".toggle-button");
        if (button) button.click();
      });
    }
  }

  /* 3. Figures at full size. The overlay is made on the first click, so a page that is only read
   * holds no extra image. */
  function enlargeableFigures() {
    var images = document.querySelectorAll("article.bd-article figure img");
    var overlay = null;
    var big = null;
    var opener = null;
    function close() {
      overlay.hidden = true;
      document.documentElement.classList.remove("kvcv-enlarged-open");
      if (opener) opener.focus();
    }
    function open(img) {
      if (!overlay) {
        overlay = document.createElement("div");
        overlay.className = "kvcv-enlarged";
        overlay.setAttribute("role", "dialog");
        overlay.setAttribute("aria-modal", "true");
        overlay.setAttribute("aria-label", "Figure at full size; click or press Escape to close");
        overlay.tabIndex = -1;
        big = document.createElement("img");
        overlay.appendChild(big);
        overlay.addEventListener("click", close);
        document.addEventListener("keydown", function (event) {
          if (event.key === "Escape" && !overlay.hidden) close();
        });
        document.body.appendChild(overlay);
      }
      opener = img;
      big.src = img.currentSrc || img.src;
      big.alt = img.alt;
      // A phone shows the figure at its size on a desk (its PNG holds twice the pixels: labcode.plotting)
      // and scrolls; a wider screen fits it to the window.
      var shown = img.getBoundingClientRect().width;
      var desk = Math.max(shown, img.naturalWidth / 2);
      var fit = Math.min(img.naturalWidth, window.innerWidth - 24,
                         (window.innerHeight - 24) * img.naturalWidth / img.naturalHeight);
      big.style.width = Math.round(window.innerWidth < 600 ? desk : Math.max(shown, fit)) + "px";
      overlay.hidden = false;
      document.documentElement.classList.add("kvcv-enlarged-open");
      overlay.focus();
    }
    for (var i = 0; i < images.length; i++) {
      var img = images[i];
      img.classList.add("kvcv-enlargeable");
      img.tabIndex = 0;
      img.setAttribute("role", "button");
      img.setAttribute("aria-label", "Show at full size: " + (img.alt || "figure"));
      img.addEventListener("click", function (event) { open(event.currentTarget); });
      img.addEventListener("keydown", function (event) {
        if (event.key === "Enter" || event.key === " ") {
          event.preventDefault();
          open(event.currentTarget);
        }
      });
    }
  }

  /* 4. The report's filter: rows of table.kvcv-checks carry data-chapter and data-verdict. */
  function reportFilter() {
    var mount = document.querySelector("[data-kvcv-report-filter]");
    var rows = document.querySelectorAll("table.kvcv-checks tbody tr");
    if (!mount || !rows.length) return;
    var chapters = [];
    for (var i = 0; i < rows.length; i++) {
      var ch = rows[i].dataset.chapter;
      if (chapters.indexOf(ch) < 0) chapters.push(ch);
    }
    chapters.sort(function (a, b) { return a - b; });
    var options = chapters.map(function (ch) { return '<option value="' + ch + '">Chapter ' + ch + "</option>"; });
    mount.innerHTML =
      '<form class="kvcv-filter" role="search" aria-label="Filter the checks">' +
      '<label>Chapter <select data-kvcv-filter="chapter"><option value="">all</option>' + options.join("") +
      "</select></label>" +
      '<label>Verdict <select data-kvcv-filter="verdict"><option value="">all</option>' +
      '<option value="pass">passed</option><option value="fail">failed</option></select></label>' +
      '<label class="kvcv-filter-words">Claim contains <input type="search" data-kvcv-filter="words" ' +
      'placeholder="e.g. window, float32"></label>' +
      '<output data-kvcv-filter="count" aria-live="polite"></output></form>';
    var chapter = mount.querySelector('[data-kvcv-filter="chapter"]');
    var verdict = mount.querySelector('[data-kvcv-filter="verdict"]');
    var words = mount.querySelector('[data-kvcv-filter="words"]');
    var count = mount.querySelector('[data-kvcv-filter="count"]');
    var wanted = new URLSearchParams(window.location.search).get("chapter");
    if (wanted && chapters.indexOf(wanted) >= 0) chapter.value = wanted;

    function apply() {
      var terms = words.value.toLowerCase().split(/\s+/).filter(Boolean);
      var shown = 0;
      for (var i = 0; i < rows.length; i++) {
        var row = rows[i];
        var text = row.cells[0].textContent.toLowerCase();
        var ok = (!chapter.value || row.dataset.chapter === chapter.value) &&
          (!verdict.value || row.dataset.verdict === verdict.value) &&
          terms.every(function (t) { return text.indexOf(t) >= 0; });
        row.hidden = !ok;
        if (ok) shown++;
      }
      // A result file's section with no row left is hidden with its heading.
      var tables = document.querySelectorAll("table.kvcv-checks");
      for (var j = 0; j < tables.length; j++) {
        var section = tables[j].closest("section");
        if (section) section.hidden = !tables[j].querySelector("tbody tr:not([hidden])");
      }
      count.textContent = shown === rows.length ? "all " + rows.length + " checks" : shown + " of " + rows.length + " checks";
      var address = new URL(window.location.href);
      if (chapter.value) address.searchParams.set("chapter", chapter.value);
      else address.searchParams.delete("chapter");
      window.history.replaceState(window.history.state, "", address);
    }
    mount.querySelector("form").addEventListener("submit", function (event) { event.preventDefault(); });
    chapter.addEventListener("change", apply);
    verdict.addEventListener("change", apply);
    words.addEventListener("input", apply);
    apply();
    // The summary's links (?chapter=N#every-claim) reload the page with the chapter chosen.
  }

  /* 5. Break points in a table's inline code, and in its names (full_vs_truncated, bytes/token). */
  function breakableTableCode() {
    breakPoints("article.bd-article table code.literal", /(?<=[\/_:])(?=.)/);
    breakPoints("article.bd-article table", /(?<=[A-Za-z][\/_])(?=[A-Za-z])/);
  }

  /* Each text node under `selector` that `rewrite` turns into a fragment is replaced by it. */
  function rewriteTexts(selector, rewrite) {
    var roots = document.querySelectorAll(selector);
    for (var i = 0; i < roots.length; i++) {
      var walker = document.createTreeWalker(roots[i], NodeFilter.SHOW_TEXT);
      var texts = [];
      while (walker.nextNode()) texts.push(walker.currentNode);
      texts.forEach(function (node) {
        var frag = rewrite(node.data);
        if (frag) node.parentNode.replaceChild(frag, node);
      });
    }
  }

  function breakPoints(selector, after) {
    rewriteTexts(selector, function (data) {
      var parts = data.split(after);
      if (parts.length < 2) return null;
      var frag = document.createDocumentFragment();
      parts.forEach(function (part, k) {
        if (k) frag.appendChild(document.createElement("wbr"));
        frag.appendChild(document.createTextNode(part));
      });
      return frag;
    });
  }

  var EXPONENT = /[\u2264<>\u2248~]?\d+(?:\.\d+)?e[-+\u2212]\d+/g;

  function wholeTableNumbers() {
    rewriteTexts("article.bd-article table", function (data) {
      if (data.search(EXPONENT) < 0) return null;
      var frag = document.createDocumentFragment(), last = 0;
      data.replace(EXPONENT, function (match, at) {
        frag.appendChild(document.createTextNode(data.slice(last, at)));
        var span = document.createElement("span");
        span.className = "kvcv-nobreak";
        span.textContent = match;
        frag.appendChild(span);
        last = at + match.length;
      });
      frag.appendChild(document.createTextNode(data.slice(last)));
      return frag;
    });
  }

  /* 6. Tables that do not fit the column. */
  var STICKY_SHARE = 0.35; // the most of the column a kept-in-view first column may cover

  function fitTables() {
    var wraps = document.querySelectorAll(
      "article.bd-article .kvcv-table-wrap, article.bd-article .pst-scrollable-table-container");
    for (var i = 0; i < wraps.length; i++) {
      var wrap = wraps[i], table = wrap.querySelector(":scope > table");
      if (!table || table.classList.contains("kvcv-verdicts")) continue; // the report has its own phone layout
      wrap.classList.remove("kvcv-tight", "kvcv-sticky");
      if (wrap.scrollWidth <= wrap.clientWidth + 1) continue;
      wrap.classList.add("kvcv-tight");
      if (wrap.scrollWidth <= wrap.clientWidth + 1) continue;
      var first = table.rows.length ? table.rows[0].cells[0] : null;
      if (first && first.getBoundingClientRect().width <= STICKY_SHARE * wrap.clientWidth) {
        wrap.classList.add("kvcv-sticky");
      }
    }
  }

  function fittedTables() {
    var width = window.innerWidth;
    fitTables();
    window.addEventListener("load", fitTables);
    if (document.fonts && document.fonts.ready) document.fonts.ready.then(fitTables);
    window.addEventListener("resize", function () {
      if (window.innerWidth === width) return; // a phone's toolbar hiding changes only the height
      width = window.innerWidth;
      window.requestAnimationFrame(fitTables);
    });
  }

  /* 7. Short hyphenated words of inline code in prose. */
  var WHOLE_CODE_WORD = 24; // characters: well within a phone's column of code

  function wholeCodeWords() {
    var words = document.querySelectorAll("article.bd-article code.literal span.pre");
    for (var i = 0; i < words.length; i++) {
      var text = words[i].textContent;
      if (text.indexOf("-") < 0 || text.length > WHOLE_CODE_WORD || words[i].closest("table")) continue;
      words[i].classList.add("kvcv-whole");
    }
  }

  function ready() {
    install();
    breakableTableCode();
    wholeTableNumbers();
    wholeCodeWords();
    fittedTables();
    solutionTitles();
    enlargeableFigures();
    reportFilter();
  }

  window.KVCVSearch = { texToText: texToText, articleText: articleText };
  window.KVCVTables = { fit: fitTables, stickyShare: STICKY_SHARE };
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", ready);
  else ready();
})();
