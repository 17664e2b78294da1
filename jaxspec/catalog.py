"""What ships, read from the files without importing jax (so `--help` stays instant): the
drafting methods the built-in drafter modules register and the shipped configs with the method
each selects. `tests/test_docs.py` checks the method names against the live registry
(`jaxspec.drafters.available_methods`)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
CONFIGS = PACKAGE.parent / "configs"  # a source checkout's; absent from an installed wheel


def registered_methods() -> list[str]:
    """The names passed to `register_drafter("name", ...)` at the top level of the modules
    under jaxspec/drafters/, sorted."""
    names = set()
    for path in sorted((PACKAGE / "drafters").glob("*.py")):
        for node in ast.parse(path.read_text(), str(path)).body:
            call = node.value if isinstance(node, ast.Expr) else None
            if (isinstance(call, ast.Call) and getattr(call.func, "id", "") == "register_drafter"
                    and call.args and isinstance(call.args[0], ast.Constant)):
                names.add(call.args[0].value)
    return sorted(names)


def shipped_configs() -> dict[str, str]:
    """configs/<name>.yaml (relative to the repository root) -> its `speculative.method`
    ("none" when unset); empty where there is no configs/ directory."""
    paths = sorted(CONFIGS.glob("*.yaml"))
    if not paths:  # an installed wheel: no configs/ beside it (and maybe no yaml either)
        return {}
    import yaml  # small, but only when asked

    out = {}
    for path in paths:
        spec = (yaml.safe_load(path.read_text()) or {}).get("speculative") or {}
        out[f"configs/{path.name}"] = str(spec.get("method", "none"))
    return out
