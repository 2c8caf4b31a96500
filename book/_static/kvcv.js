/* "KV Cache, Verified": search-result summaries that read as prose.
 *
 * Sphinx's search page (searchtools.js) shows under each result a passage of the page's text,
 * taken from the element with role="main". In pydata-sphinx-theme that element also holds the
 * page's toolbar and its "Contents" sidebar, and the page source holds maths as raw LaTeX (\(...\))
 * because MathJax typesets it only in the browser. This replaces Search.htmlToText, on the search
 * page only, with one that reads the article alone and writes maths as plain text.
 * tests/test_browser.py checks the summaries.
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

  window.KVCVSearch = { texToText: texToText, articleText: articleText };
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", install);
  else install();
})();
