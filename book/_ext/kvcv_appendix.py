"""Figure and table numbers of the appendix: "Fig. A.1", as the chapters have "Fig. 7.1".

An appendix sits in an unnumbered part of _toc.yml, so Sphinx numbers its figures 1, 2, ... with no
chapter in front, and "Fig. 1" of the appendix reads like a figure of chapter 1. Each page named in
`kvcv_appendices` (page -> letter, in _config.yml) gets its letter in front of every number instead.
"""

from __future__ import annotations


def letter_appendix_numbers(app, env):
    """After Sphinx numbers the figures (env-get-updated), put each appendix's letter in front."""
    changed = []
    for docname, letter in app.config.kvcv_appendices.items():
        numbers = env.toc_fignumbers.get(docname)
        if not numbers:
            continue
        for figtype, ids in numbers.items():
            numbers[figtype] = {i: (letter, number[-1]) for i, number in ids.items()}
        changed.append(docname)
    return changed


def setup(app):
    app.add_config_value("kvcv_appendices", {}, "env", [dict])
    app.connect("env-get-updated", letter_appendix_numbers, priority=900)  # after the toctree collector (500)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
