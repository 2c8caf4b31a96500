"""The engine constants chapter 9 states, on its two pages, come from one table
(labcode.engines.sources): each row names a file and a function, and what can be checked against an
installed package is."""

from __future__ import annotations

import json
import re
from importlib import metadata
from pathlib import Path

import pytest

from labcode.engines import sources

ROOT = Path(__file__).resolve().parent.parent
# Chapter 9's pages: the engines' caches, then the engines compared.
CH09 = [ROOT / "notebooks" / f"{n}.ipynb" for n in ("09_how_engines_manage_the_cache", "09a_how_the_engines_compare")]


def test_every_row_names_a_repository_a_file_and_a_function():
    keys = [row.key for row in sources.SOURCES]
    assert len(keys) == len(set(keys))
    for row in sources.SOURCES:
        assert re.fullmatch(r"[\w.-]+/[\w.-]+", row.repo), row
        assert re.fullmatch(r"[\w./-]+\.(h|cpp|py|rs)", row.file), row
        assert row.where and row.what and isinstance(row.value, int) and row.value > 0, row


def test_transformers_version_is_the_installed_one():
    assert sources.versions()["transformers"] == metadata.version("transformers")
    assert set(sources.versions()) == {"vllm", "llama.cpp", "candle", "transformers"}


def test_installed_rows_match_the_installed_package():
    from transformers import LlamaConfig

    cfg = LlamaConfig()
    assert sources.value("llama_head_dim") == cfg.hidden_size // cfg.num_attention_heads
    assert all(row.key == "llama_head_dim" for row in sources.SOURCES if row.installed)


def test_an_unknown_key_is_refused_with_the_keys_there_are():
    with pytest.raises(KeyError, match="llama_max_seq"):
        sources.value("no_such_constant")


def test_chapter_9_glues_every_row_and_every_version():
    """Each page glues the whole table, and between them the pages use every row and every version."""
    prose = ""
    for page in CH09:
        cells = json.loads(page.read_text())["cells"]
        code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        prose += "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
        assert 'glue(f"src_{row.key}", row.value)' in code and "sources.versions().items()" in code, page.name
    for row in sources.SOURCES:
        assert f"`src_{row.key}`" in prose, f"chapter 9's prose does not use {row.key}"
    for name in ("vllm", "llama_cpp", "candle", "transformers"):
        assert f"`version_{name}`" in prose, f"chapter 9's prose does not glue {name}'s version"
