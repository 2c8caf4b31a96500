/* The KV-cache explorer of "KV Cache, Verified".
 *
 * Plain JavaScript, no dependencies, no network. The counting functions mirror
 * labcode/cost.py (kv_cache_elements, kv_cache_bytes, codes_per_byte, quantized_kv_cache_bytes,
 * positions_computed) and labcode/generate.py (new_token_budget), in the same argument order; the
 * browser tests call window.KVExplorer and compare the results with the Python functions.
 *
 * The widget mounts on every element with the attribute data-kv-explorer; the script is
 * loaded on every page and does nothing where there is none. The first explorer on a page keeps
 * its settings in the page's address (?prompt=6&kv=4...), so that a reload restores them and
 * the address can be shared; it replaces the history entry rather than adding one per change.
 */
(function () {
  "use strict";

  // ---- the counting functions (same names and argument order as labcode) ----

  function cacheElements(nLayers, batch, tokens, nKvHeads, headDim) {
    // 2 (K and V) * L * B * T * Hkv * D
    return 2 * nLayers * batch * tokens * nKvHeads * headDim;
  }

  function cacheBytes(nLayers, batch, tokens, nKvHeads, headDim, bytesPerElement) {
    return cacheElements(nLayers, batch, tokens, nKvHeads, headDim) * bytesPerElement;
  }

  function codesPerByte(bits) {
    // Codes of 2 or 4 bits pack 8 / bits to a byte; any other width takes a byte each.
    return bits === 2 || bits === 4 ? 8 / bits : 1;
  }

  function quantizedCacheBytes(nLayers, batch, tokens, nKvHeads, headDim, groupSize, bits) {
    // Codes plus one float32 scale (4 bytes) per group of each token's head vector; a group is the
    // whole head vector by default: D + 4 bytes per token and head in int8, D / 2 + 4 in int4.
    var group = groupSize === undefined || groupSize === null ? headDim : groupSize;
    var b = bits === undefined ? 8 : bits;
    if (!(Number.isInteger(group) && group > 0 && headDim % group === 0)) {
      throw new RangeError("group_size: expected null or a positive divisor of head_dim=" + headDim + ", got " + groupSize);
    }
    if (!(Number.isInteger(b) && b >= 2 && b <= 8)) throw new RangeError("bits: expected an int in [2, 8], got " + bits);
    var per = codesPerByte(b);
    if (headDim % per) throw new RangeError("head_dim: expected a multiple of " + per + " for " + b + "-bit codes");
    return 2 * nLayers * batch * tokens * nKvHeads * (headDim / per + 4 * (headDim / group));
  }

  // Bytes held for `tokens` positions under settings s: dense for float32 and float16, codes and
  // scales for int8 and int4 (as chapter 9's QuantizedCache stores them; s.bytes is 1 or 0.5).
  function heldBytes(s, nLayers, tokens) {
    if (s.bytes < 2) return quantizedCacheBytes(nLayers, s.batch, tokens, s.kvHeads, MODEL.headDim, null, 8 * s.bytes);
    return cacheBytes(nLayers, s.batch, tokens, s.kvHeads, MODEL.headDim, s.bytes);
  }

  function positionsComputed(promptLen, newTokens, cached) {
    // Positions run through the model at each forward call of a generation of newTokens.
    var out = [];
    if (newTokens <= 0) return out;
    for (var i = 0; i < newTokens; i++) {
      if (cached) out.push(i === 0 ? promptLen : 1);
      else out.push(promptLen + i);
    }
    return out;
  }

  function newTokenBudget(promptLen, maxNewTokens, contextLength) {
    // How many tokens fit, and why generation stops: the position table is a hard limit.
    var room = Math.max(0, contextLength - promptLen);
    if (maxNewTokens <= room) return [maxNewTokens, "max_new_tokens"];
    return [room, "context_length"];
  }

  function sum(xs) {
    var s = 0;
    for (var i = 0; i < xs.length; i++) s += xs[i];
    return s;
  }

  // The fixed model of the explorer: GPT-2 124M shapes (labcode preset "gpt2-124m").
  var MODEL = { nLayers: 12, nHeads: 12, headDim: 64 };

  var OPTIONS = {
    prompt: range(1, 24),
    newTokens: range(1, 32),
    context: [8, 10, 12, 16, 24, 32, 48, 64, 1024],
    window: [0, 2, 3, 4, 6, 8, 12, 16],
    kvHeads: [12, 6, 4, 3, 2, 1],
    bytes: [4, 2, 1, 0.5],
    batch: [1, 2, 4, 8],
  };
  var DEFAULTS = { prompt: 4, newTokens: 8, context: 32, window: 0, kvHeads: 12, bytes: 2, batch: 1, cache: true };

  // The address keeps the settings under these names; element types by name.
  var QUERY = {
    prompt: "prompt", newTokens: "new", context: "rows", window: "window", kvHeads: "kv", bytes: "type",
    batch: "batch",
  };
  var TYPES = { 4: "float32", 2: "float16", 1: "int8", 0.5: "int4" };

  /* Settings (and step) from a query string such as "?prompt=6&type=int8&cache=off&step=3"; a
   * missing or unknown value keeps its default. */
  function settingsFromQuery(search) {
    var params = new URLSearchParams(search || "");
    var s = Object.assign({}, DEFAULTS);
    Object.keys(QUERY).forEach(function (key) {
      var raw = params.get(QUERY[key]);
      if (raw === null) return;
      var value = NaN;
      if (key === "bytes") {
        Object.keys(TYPES).forEach(function (b) {
          if (TYPES[b] === raw) value = Number(b);
        });
      } else if (/^[0-9]+$/.test(raw)) {
        value = parseInt(raw, 10);
      }
      if (OPTIONS[key].indexOf(value) >= 0) s[key] = value;
    });
    s.cache = params.get("cache") !== "off";
    var step = params.get("step");
    return { settings: s, step: step !== null && /^[0-9]+$/.test(step) ? parseInt(step, 10) : 0 };
  }

  /* The query string for settings s at `step`: only what differs from the defaults. */
  function queryFromSettings(s, step) {
    var params = new URLSearchParams();
    Object.keys(QUERY).forEach(function (key) {
      if (s[key] !== DEFAULTS[key]) params.set(QUERY[key], key === "bytes" ? TYPES[s[key]] : String(s[key]));
    });
    if (!s.cache) params.set("cache", "off");
    if (step > 0) params.set("step", String(step));
    var text = params.toString();
    return text ? "?" + text : "";
  }

  function range(a, b) {
    var xs = [];
    for (var i = a; i <= b; i++) xs.push(i);
    return xs;
  }

  /* Everything the widget shows for settings s at forward call `step` (0 = prefill).
   * Positions are numbered from 0, as in the code. */
  function stepView(s, step) {
    var budget = newTokenBudget(s.prompt, s.newTokens, s.context);
    var n = budget[0];
    var v = {
      calls: n,
      stopReason: budget[1],
      promptTooLong: s.prompt > s.context,
      step: Math.max(0, Math.min(step, n - 1)),
    };
    if (n === 0) {
      v.seqLen = 0;
      v.states = [];
      v.computed = v.reused = v.dropped = v.visible = v.cacheTokens = 0;
      v.cumCached = v.cumUncached = 0;
      v.perCall = { cached: [], uncached: [] };
      return v;
    }
    var k = v.step;
    var p = s.prompt;
    var seqLen = p + k; // positions 0 .. seqLen-1 are read in this call
    var win = s.cache && s.window > 0 ? s.window : 0;
    var firstKept = win ? Math.max(0, seqLen - win) : 0;
    var states = [];
    for (var i = 0; i < seqLen; i++) {
      var st;
      if (!s.cache) st = "computed";
      else if (i < firstKept) st = "dropped";
      else if (k === 0 || i === seqLen - 1) st = "computed";
      else st = "reused";
      states.push(st);
    }
    var perCached = positionsComputed(p, k + 1, true);
    var perUncached = positionsComputed(p, k + 1, false);
    v.seqLen = seqLen;
    v.states = states;
    v.nextPosition = seqLen; // the token this call produces
    v.computed = (s.cache ? perCached : perUncached)[k];
    v.reused = countState(states, "reused");
    v.dropped = countState(states, "dropped");
    v.visible = seqLen - v.dropped; // keys the newest query reads
    v.cacheTokens = s.cache ? (win ? Math.min(seqLen, win) : seqLen) : 0;
    v.cumCached = sum(perCached);
    v.cumUncached = sum(perUncached);
    v.perCall = { cached: perCached, uncached: perUncached };
    v.bytesPerLayer = heldBytes(s, 1, v.cacheTokens);
    v.bytesTotal = heldBytes(s, MODEL.nLayers, v.cacheTokens);
    v.isLast = k === n - 1;
    return v;
  }

  function countState(states, name) {
    var c = 0;
    for (var i = 0; i < states.length; i++) if (states[i] === name) c++;
    return c;
  }

  // ---- formatting ----

  function fmtInt(x) {
    return Math.round(x).toLocaleString("en-US");
  }

  // Three significant digits in every unit, so that neighbouring sizes read alike (36.0 MiB, 1.13 MiB,
  // 0.984 MiB just below a mebibyte).
  function fmtBytes(b) {
    if (b < 1024) return fmtInt(b) + " B";
    var units = ["KiB", "MiB", "GiB", "TiB"];
    var x = b / 1024;
    var i = 0;
    while (x >= 999.5 && i < units.length - 1) {
      x /= 1024;
      i++;
    }
    var digits = x >= 99.95 ? 0 : x >= 9.995 ? 1 : x >= 0.9995 ? 2 : 3;
    return x.toFixed(digits) + " " + units[i];
  }

  function attentionKind(kv) {
    if (kv === MODEL.nHeads) return "multi-head (MHA)";
    if (kv === 1) return "multi-query (MQA)";
    return "grouped-query (GQA)";
  }

  // ---- DOM helpers ----

  function el(tag, attrs, children) {
    var node = document.createElement(tag);
    if (attrs) {
      for (var key in attrs) {
        if (!Object.prototype.hasOwnProperty.call(attrs, key)) continue;
        if (key === "text") node.textContent = attrs[key];
        else if (key === "className") node.className = attrs[key];
        else node.setAttribute(key, attrs[key]);
      }
    }
    (children || []).forEach(function (c) {
      node.appendChild(typeof c === "string" ? document.createTextNode(c) : c);
    });
    return node;
  }

  function selectControl(id, label, name, values, labelFor) {
    var select = el("select", { id: id, "data-kvx-setting": name });
    values.forEach(function (x) {
      select.appendChild(el("option", { value: String(x), text: labelFor ? labelFor(x) : String(x) }));
    });
    var wrap = el("div", { className: "kvx-field" }, [el("label", { for: id, text: label }), select]);
    return { wrap: wrap, select: select };
  }

  function metric(key, label, note) {
    var value = el("span", { className: "kvx-metric-value", "data-kvx": key, "data-value": "0" });
    var box = el("div", { className: "kvx-metric" }, [
      el("span", { className: "kvx-metric-label", text: label }),
      value,
    ]);
    if (note) box.appendChild(el("span", { className: "kvx-metric-note", text: note }));
    return { box: box, value: value };
  }

  // ---- the widget ----

  function Explorer(root, index) {
    this.root = root;
    this.id = "kvx" + index;
    this.keepsAddress = index === 0 && !!(window.history && window.history.replaceState);
    var start = this.keepsAddress ? settingsFromQuery(window.location.search) : { settings: DEFAULTS, step: 0 };
    this.settings = Object.assign({}, start.settings);
    this.step = start.step;
    this.build();
    this.render();
    var self = this;
    if (this.keepsAddress) {
      // Back and Forward across the page's own anchors: the address's settings, whatever they are.
      window.addEventListener("popstate", function () {
        var now = settingsFromQuery(window.location.search);
        self.step = now.step;
        self.set(now.settings);
      });
    }
  }

  Explorer.prototype.build = function () {
    var self = this;
    var id = this.id;
    var root = this.root;
    root.textContent = "";
    root.classList.add("kvx");

    // Settings
    var fs = el("fieldset", { className: "kvx-settings" }, [el("legend", { text: "Settings" })]);
    var grid = el("div", { className: "kvx-grid" });
    this.controls = {};
    var specs = [
      ["prompt", "Prompt length P", OPTIONS.prompt],
      ["newTokens", "New tokens requested", OPTIONS.newTokens],
      ["context", "Position table rows", OPTIONS.context, function (x) {
        return x === 1024 ? "1024 (GPT-2)" : String(x);
      }],
      ["window", "Cache window W", OPTIONS.window, function (x) {
        return x === 0 ? "none (keep all)" : String(x);
      }],
      ["kvHeads", "KV heads Hkv", OPTIONS.kvHeads, function (x) {
        return x + (x === MODEL.nHeads ? " (MHA)" : x === 1 ? " (MQA)" : " (GQA)");
      }],
      ["bytes", "Stored as", OPTIONS.bytes, function (x) {
        return x === 4 ? "float32 (4 B)" : x === 2 ? "float16 (2 B)" : x === 1 ? "int8 + scale" : "int4 + scale";
      }],
      ["batch", "Batch size B", OPTIONS.batch],
    ];
    specs.forEach(function (sp) {
      var c = selectControl(id + "-" + sp[0], sp[1], sp[0], sp[2], sp[3]);
      c.select.value = String(self.settings[sp[0]]);
      c.select.addEventListener("change", function () {
        self.settings[sp[0]] = Number(c.select.value);
        self.render();
      });
      self.controls[sp[0]] = c.select;
      grid.appendChild(c.wrap);
    });
    fs.appendChild(grid);

    this.cacheButton = el("button", {
      type: "button", className: "kvx-toggle", "data-kvx": "cache-toggle", "aria-pressed": "true",
    });
    this.cacheButton.addEventListener("click", function () {
      self.settings.cache = !self.settings.cache;
      self.render();
    });
    fs.appendChild(el("div", { className: "kvx-toggle-row" }, [
      this.cacheButton,
      el("span", { className: "kvx-hint", text: "Shortcut: c. Changing a setting keeps the current step." }),
    ]));
    this.fixedNote = el("p", { className: "kvx-fixed", "data-kvx": "fixed" });
    fs.appendChild(this.fixedNote);
    root.appendChild(fs);

    // Step controls
    var nav = el("div", { className: "kvx-nav", role: "group", "aria-label": "Step through the forward calls" });
    this.buttons = {};
    [
      ["first", "\u00AB Prefill", "Go to the prefill call (Home)"],
      ["prev", "\u25C0 Previous", "Previous forward call (left arrow or p)"],
      ["next", "Next \u25B6", "Next forward call (right arrow or n)"],
      ["last", "Last \u00BB", "Go to the last forward call (End)"],
    ].forEach(function (b) {
      var btn = el("button", { type: "button", className: "kvx-btn", "data-kvx": b[0], title: b[2], text: b[1] });
      btn.addEventListener("click", function () {
        self.go(b[0]);
      });
      self.buttons[b[0]] = btn;
      nav.appendChild(btn);
    });
    root.appendChild(nav);
    root.appendChild(el("p", {
      className: "kvx-hint kvx-keys", // hidden on a touch screen (explorer.css)
      text: "Keys, anywhere in the explorer except inside a menu: \u2192 or n next, \u2190 or p previous, " +
        "Home prefill, End last, c cache on or off.",
    }));

    // Status (read aloud by screen readers)
    this.status = el("p", { className: "kvx-status", role: "status", "aria-live": "polite", "data-kvx": "status" });
    root.appendChild(this.status);
    this.stop = el("p", { className: "kvx-stop", "data-kvx": "stop", hidden: "" });
    root.appendChild(this.stop);

    // Positions strip
    var legend = el("ul", { className: "kvx-legend", "aria-label": "Legend" }, [
      el("li", {}, [el("span", { className: "kvx-swatch kvx-computed" }), "computed in this call"]),
      el("li", {}, [el("span", { className: "kvx-swatch kvx-reused" }), "reused from the cache"]),
      el("li", {}, [el("span", { className: "kvx-swatch kvx-dropped" }), "dropped by the window"]),
      el("li", {}, [el("span", { className: "kvx-swatch kvx-next" }), "token this call produces"]),
    ]);
    this.strip = el("ol", {
      className: "kvx-strip", tabindex: "0", "data-kvx": "strip",
      "aria-label": "Positions read by this forward call; use the arrow keys to step",
    });
    root.appendChild(el("section", { className: "kvx-section", "aria-label": "Positions" }, [
      el("h3", { className: "kvx-h", text: "Positions in this forward call" }), legend, this.strip,
    ]));

    // Metrics
    this.m = {};
    var stepGrid = el("div", { className: "kvx-metrics" });
    [
      ["computed", "Positions computed now", "K/V projections, per sequence and layer"],
      ["reused", "Positions reused", "read from the cache"],
      ["visible", "Keys the newest query reads", "a window shortens this; caching does not"],
      ["dropped", "Positions dropped", "no longer visible"],
    ].forEach(function (d) {
      var x = metric(d[0], d[1], d[2]);
      self.m[d[0]] = x.value;
      stepGrid.appendChild(x.box);
    });
    root.appendChild(el("section", { className: "kvx-section", "aria-label": "This forward call" }, [
      el("h3", { className: "kvx-h", text: "This forward call" }), stepGrid,
    ]));

    var cum = el("div", { className: "kvx-bars" });
    this.bars = {};
    [["cum-cached", "with the cache"], ["cum-uncached", "without the cache"]].forEach(function (d) {
      var value = el("span", { className: "kvx-bar-value", "data-kvx": d[0], "data-value": "0" });
      var fill = el("span", { className: "kvx-bar-fill kvx-" + d[0] });
      cum.appendChild(el("div", { className: "kvx-bar" }, [
        el("span", { className: "kvx-bar-label", text: d[1] }),
        el("span", { className: "kvx-bar-track", "aria-hidden": "true" }, [fill]),
        value,
      ]));
      self.bars[d[0]] = { value: value, fill: fill };
    });
    this.saving = el("p", { className: "kvx-hint", "data-kvx": "saving" });
    root.appendChild(el("section", { className: "kvx-section", "aria-label": "Positions computed so far" }, [
      el("h3", { className: "kvx-h", text: "Positions computed so far (per sequence and layer)" }), cum, this.saving,
    ]));

    // Memory
    var memGrid = el("div", { className: "kvx-metrics" });
    [
      ["cache-tokens", "Cached positions T", "kept between calls"],
      ["bytes-layer", "Cache bytes per layer", ""],
      ["bytes-total", "Cache bytes, all layers", ""],
      ["bytes-limit", "Reserved if preallocated", " "],
    ].forEach(function (d) {
      var x = metric(d[0], d[1], d[2]);
      self.m[d[0]] = x.value;
      memGrid.appendChild(x.box);
    });
    this.limitNote = memGrid.lastChild.querySelector(".kvx-metric-note");
    this.formula = el("p", { className: "kvx-formula", "data-kvx": "formula" });
    root.appendChild(el("section", { className: "kvx-section", "aria-label": "Cache memory" }, [
      el("h3", { className: "kvx-h", text: "Cache memory" }), memGrid, this.formula,
    ]));

    root.addEventListener("keydown", function (e) {
      self.onKey(e);
    });
  };

  Explorer.prototype.onKey = function (e) {
    if (e.ctrlKey || e.metaKey || e.altKey) return;
    var tag = e.target && e.target.tagName;
    if (tag === "SELECT" || tag === "INPUT" || tag === "TEXTAREA") return;
    var action = {
      ArrowRight: "next", n: "next", N: "next",
      ArrowLeft: "prev", p: "prev", P: "prev",
      Home: "first", End: "last", c: "cache", C: "cache",
    }[e.key];
    if (!action) return;
    e.preventDefault();
    if (action === "cache") {
      this.settings.cache = !this.settings.cache;
      this.render();
    } else {
      this.go(action);
    }
  };

  Explorer.prototype.go = function (where) {
    var n = stepView(this.settings, 0).calls;
    if (where === "first") this.step = 0;
    else if (where === "last") this.step = Math.max(0, n - 1);
    else if (where === "next") this.step = Math.min(this.step + 1, Math.max(0, n - 1));
    else if (where === "prev") this.step = Math.max(0, this.step - 1);
    this.render();
  };

  Explorer.prototype.render = function () {
    var s = this.settings;
    var v = stepView(s, this.step);
    this.step = v.step;
    this.view = v;

    this.cacheButton.setAttribute("aria-pressed", s.cache ? "true" : "false");
    this.cacheButton.textContent = s.cache ? "KV cache: on" : "KV cache: off";
    this.controls.window.disabled = !s.cache;
    this.fixedNote.textContent =
      "Fixed: L = " + MODEL.nLayers + " layers, H = " + MODEL.nHeads + " query heads, D = " +
      MODEL.headDim + " (GPT-2 124M shapes). With Hkv = " + s.kvHeads + ", this is " +
      attentionKind(s.kvHeads) + " attention: each KV head serves " + MODEL.nHeads / s.kvHeads +
      " query head" + (MODEL.nHeads / s.kvHeads === 1 ? "" : "s") + "." +
      (s.cache ? "" : " The window applies to the cache, so it is off while the cache is off.");

    var n = v.calls;
    this.buttons.first.disabled = this.buttons.prev.disabled = n === 0 || v.step === 0;
    this.buttons.next.disabled = this.buttons.last.disabled = n === 0 || v.isLast;

    this.renderStrip(v);
    this.renderStatus(s, v);
    this.renderNumbers(s, v);
    this.writeAddress();
  };

  // Keep the settings in the address: a reload restores them and the address can be shared. The
  // current history entry is replaced, so Back still leaves the page instead of undoing settings.
  Explorer.prototype.writeAddress = function () {
    if (!this.keepsAddress) return;
    var query = queryFromSettings(this.settings, this.step);
    if (query === window.location.search) return;
    var url = window.location.pathname + query + window.location.hash;
    window.history.replaceState(window.history.state, "", url);
  };

  Explorer.prototype.renderStrip = function (v) {
    var strip = this.strip;
    strip.textContent = "";
    var words = { computed: "new", reused: "reused", dropped: "dropped" };
    var p = this.settings.prompt;
    for (var i = 0; i < v.states.length; i++) {
      var st = v.states[i];
      var kind = i < p ? "prompt" : "generated";
      strip.appendChild(el("li", {
        className: "kvx-cell kvx-" + st + " kvx-" + kind,
        "data-state": st,
        "data-position": String(i),
        "aria-label": "position " + i + " (" + kind + "): " + words[st],
      }, [
        el("span", { className: "kvx-pos", text: String(i) }),
        el("span", { className: "kvx-word", text: words[st] }),
      ]));
    }
    if (v.calls > 0) {
      strip.appendChild(el("li", {
        className: "kvx-cell kvx-next", "data-state": "next", "data-position": String(v.nextPosition),
        "aria-label": "position " + v.nextPosition + ": the token this call produces",
      }, [el("span", { className: "kvx-pos", text: String(v.nextPosition) }), el("span", { className: "kvx-word", text: "next" })]));
    }
  };

  Explorer.prototype.renderStatus = function (s, v) {
    var stop = this.stop;
    stop.hidden = true;
    stop.textContent = "";
    if (v.promptTooLong) {
      this.status.textContent = "The prompt has " + s.prompt + " tokens but the position table has only " +
        s.context + " rows: the model rejects it before computing anything.";
      stop.textContent = "Nothing to generate: the prompt does not fit the position table.";
      stop.hidden = false;
      return;
    }
    if (v.calls === 0) {
      this.status.textContent = "The prompt already fills all " + s.context + " rows of the position table.";
      stop.textContent = "Nothing to generate: there is no row left for a new position.";
      stop.hidden = false;
      return;
    }
    var k = v.step;
    var phase = k === 0 ? "prefill" : "decode";
    var text = "Forward call " + (k + 1) + " of " + v.calls + " (" + phase + "): computes " + v.computed +
      " position" + (v.computed === 1 ? "" : "s");
    if (v.dropped && k === 0) {
      text += " (in chunks of at most W = " + s.window + ", so the window drops " + v.dropped + " of them again)";
    }
    text += ", reuses " + v.reused + " from the cache";
    if (v.dropped && k > 0) text += ", " + v.dropped + " dropped by the window";
    text += ", and produces the token at position " + v.nextPosition + ". So far " + v.cumCached +
      " positions computed with the cache, " + v.cumUncached + " without.";
    this.status.textContent = text;
    if (v.isLast) {
      if (v.stopReason === "context_length") {
        stop.textContent = "Stopped after " + v.calls + " of " + s.newTokens + " requested tokens: prompt plus " +
          "generated tokens now fill all " + s.context + " rows of the position table, and a new position " +
          "would have no row. A cache window does not lift this limit.";
      } else {
        stop.textContent = s.newTokens === 1 ? "Done: the one requested token generated." :
          "Done: all " + s.newTokens + " requested tokens generated.";
      }
      stop.hidden = false;
    }
  };

  function setValue(node, value, text) {
    node.setAttribute("data-value", String(value));
    node.textContent = text === undefined ? fmtInt(value) : text;
  }

  Explorer.prototype.renderNumbers = function (s, v) {
    setValue(this.m.computed, v.computed);
    setValue(this.m.reused, v.reused);
    setValue(this.m.visible, v.visible);
    setValue(this.m.dropped, v.dropped);
    setValue(this.bars["cum-cached"].value, v.cumCached);
    setValue(this.bars["cum-uncached"].value, v.cumUncached);
    var most = Math.max(1, v.cumUncached);
    this.bars["cum-cached"].fill.style.width = (100 * v.cumCached) / most + "%";
    this.bars["cum-uncached"].fill.style.width = (100 * v.cumUncached) / most + "%";
    this.saving.textContent = v.calls === 0 ? "" :
      "The cache avoids " + fmtInt(v.cumUncached - v.cumCached) + " position computations per sequence and layer so far.";

    var bytesLayer = v.calls ? v.bytesPerLayer : 0;
    var bytesTotal = v.calls ? v.bytesTotal : 0;
    // What a cache preallocated at its full size reserves: every row of the position table, or W rows with a
    // window (a generation fills at most one row fewer: its last token is never fed back).
    var maxTokens = !s.cache ? 0 : s.window > 0 ? Math.min(s.context, s.window) : s.context;
    var limit = heldBytes(s, MODEL.nLayers, maxTokens);
    this.limitNote.textContent = !s.cache ? "no cache" : "T = " + maxTokens +
      (s.window > 0 && s.window < s.context ? " (the window)" : " (the position table)");
    setValue(this.m["cache-tokens"], v.cacheTokens);
    setValue(this.m["bytes-layer"], bytesLayer, fmtBytes(bytesLayer));
    setValue(this.m["bytes-total"], bytesTotal, fmtBytes(bytesTotal));
    setValue(this.m["bytes-limit"], limit, fmtBytes(limit));
    this.formula.setAttribute("data-value", String(bytesTotal));
    if (!s.cache) {
      this.formula.textContent = "No cache is kept between calls, so nothing is held; each call still " +
        "builds its keys and values temporarily.";
    } else if (s.bytes < 2) { // int8 or int4: codes, packed in int4, and a scale
      var codes = s.bytes === 1 ? ["", "a one-byte code per element"] : [" / 2", "two four-bit codes to a byte"];
      this.formula.textContent = "2 \u00D7 B \u00D7 L \u00D7 Hkv \u00D7 T \u00D7 (D" + codes[0] + " + 4) = 2 \u00D7 " +
        s.batch + " \u00D7 " + MODEL.nLayers + " \u00D7 " + s.kvHeads + " \u00D7 " + v.cacheTokens + " \u00D7 (" +
        MODEL.headDim + codes[0] + " + 4) = " + fmtInt(bytesTotal) + " bytes: " + codes[1] + ", and a " +
        "four-byte float32 scale per position and head.";
    } else {
      this.formula.textContent = "2 \u00D7 B \u00D7 L \u00D7 Hkv \u00D7 T \u00D7 D \u00D7 bytes = 2 \u00D7 " +
        s.batch + " \u00D7 " + MODEL.nLayers + " \u00D7 " + s.kvHeads + " \u00D7 " + v.cacheTokens + " \u00D7 " +
        MODEL.headDim + " \u00D7 " + s.bytes + " = " + fmtInt(bytesTotal) + " bytes";
    }
  };

  Explorer.prototype.set = function (changes) {
    Object.assign(this.settings, changes);
    for (var key in this.controls) {
      if (Object.prototype.hasOwnProperty.call(this.controls, key)) this.controls[key].value = String(this.settings[key]);
    }
    this.render();
  };

  var api = {
    MODEL: MODEL,
    OPTIONS: OPTIONS,
    DEFAULTS: DEFAULTS,
    cacheElements: cacheElements,
    cacheBytes: cacheBytes,
    codesPerByte: codesPerByte,
    quantizedCacheBytes: quantizedCacheBytes,
    positionsComputed: positionsComputed,
    newTokenBudget: newTokenBudget,
    stepView: stepView,
    settingsFromQuery: settingsFromQuery,
    queryFromSettings: queryFromSettings,
    formatBytes: fmtBytes,
    instances: [],
  };
  window.KVExplorer = api;

  function mountAll() {
    var roots = document.querySelectorAll("[data-kv-explorer]");
    for (var i = 0; i < roots.length; i++) {
      if (roots[i].getAttribute("data-kvx-mounted")) continue;
      roots[i].setAttribute("data-kvx-mounted", "true");
      api.instances.push(new Explorer(roots[i], i));
    }
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", mountAll);
  else mountAll();
})();
