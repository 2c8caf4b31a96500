"""OpenAI's GPT-2 weights as a course model, for readers who have them: found without the cost of
importing transformers when they are not there.

Introduced in chapter 1 (its optional GPT-2 cell). `pretrained_available` looks in a local folder
or the Hugging Face cache, asking no network; `load_pretrained_gpt2` answers "not here" from that
alone, and only when the weights are there imports `labcode.weights.hf_gpt2` (and with it
transformers, a few seconds) to convert them (chapter 9 explains the conversion). Nothing is downloaded unless asked
for: `python -m labcode.weights.pretrained --download gpt2` fetches the 124M model once.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from labcode.model import GPT
    from labcode.weights.hf_gpt2 import HFTokenizer


class PretrainedUnavailable(OSError):
    """The pretrained weights are neither in the local Hugging Face cache nor downloadable now."""


def pretrained_available(name: str, cache_dir: str | Path | None = None) -> bool:
    """Whether the weights `name` are on this machine: a local folder holding a config.json, or a model
    whose config.json is in the Hugging Face cache (`cache_dir`, default: the user's). Asks no network."""
    from tqdm import TqdmWarning

    with warnings.catch_warnings():  # in a notebook without ipywidgets, tqdm.auto warns on import
        warnings.simplefilter("ignore", TqdmWarning)
        from huggingface_hub import try_to_load_from_cache
        from huggingface_hub.errors import HFValidationError

    if Path(name).is_dir():
        return (Path(name) / "config.json").is_file()
    try:
        found = try_to_load_from_cache(name, "config.json", cache_dir=cache_dir)
    except HFValidationError:  # not a valid repository name either
        return False
    return isinstance(found, str)


def load_pretrained_gpt2(name: str = "gpt2", *, download: bool = False, dtype: torch.dtype = torch.float32,
                         device: str | torch.device | None = None) -> tuple[GPT, HFTokenizer]:
    """OpenAI's GPT-2 (`name`: "gpt2", "gpt2-medium", ..., or a local folder) as a course model, with its tokenizer.

    Reads the local Hugging Face cache only, unless `download=True` (the 124M "gpt2" is about 550 MB).
    Raises PretrainedUnavailable when the files are not there. Returns the model in eval mode.
    """
    where = "in the local Hugging Face cache or on the Hub" if download else "in the local Hugging Face cache"
    hint = "" if download else " (download them once: python -m labcode.weights.pretrained --download " + name + ")"
    if not download and not pretrained_available(name):  # answered without importing transformers
        raise PretrainedUnavailable(f"name: expected GPT-2 weights {name!r} {where}, got none{hint}")
    from labcode.weights import hf_gpt2  # imports transformers (a few seconds), without the tqdm widget warning

    try:
        return hf_gpt2.read_pretrained(name, download, dtype, device)
    except OSError as e:  # transformers and huggingface_hub report missing files and no network as OSError
        raise PretrainedUnavailable(f"name: expected GPT-2 weights {name!r} {where}, got none{hint}: {e}") from e


def main(argv: list[str] | None = None) -> int:
    """`python -m labcode.weights.pretrained --download [NAME]`: fetch pretrained GPT-2 once into the
    Hugging Face cache."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m labcode.weights.pretrained", description=main.__doc__)
    parser.add_argument("--download", metavar="NAME", nargs="?", const="gpt2", required=True,
                        help="model to fetch from the Hugging Face Hub (default: gpt2, about 550 MB)")
    args = parser.parse_args(argv)
    try:
        model, tok = load_pretrained_gpt2(args.download, download=True, device="cpu")
    except PretrainedUnavailable as e:
        print(e)
        return 1
    print(f"{args.download}: {model.num_params():,} parameters, V = {tok.vocab_size}, "
          f"context {model.cfg.context_length}; cached for load_pretrained_gpt2({args.download!r})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
