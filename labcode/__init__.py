"""labcode: the code of the course *KV Cache, Verified*.

The single source of truth for every model, cache, mask and generation loop the
chapters teach. Importing it has no side effects: no seeding, printing,
downloading or thread changes.
"""

from labcode.config import PRESETS, GPTConfig, get_config
from labcode.model import GPT

__all__ = ["GPT", "GPTConfig", "PRESETS", "get_config"]
