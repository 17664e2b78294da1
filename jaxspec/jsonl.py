"""Reading JSON-lines input files (prompts, Spec-Bench questions) with one-line errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jaxspec.errors import JaxspecError
from jaxspec.validate import regular_file


def read_jsonl(path: str | Path, label: str, missing_hint: str = "") -> list[tuple[int, Any]]:
    """[(line number, parsed object)] for the non-blank lines of `path`; `label` names the file
    in errors ("data file", "prompts file"), `missing_hint` is appended when it does not exist."""
    if Path(path).exists():
        regular_file(Path(path), label, max_bytes=1 << 30)  # a FIFO or device would hang the read
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise JaxspecError(f"{label} {path} does not exist{missing_hint}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise JaxspecError(f"cannot read {label} {path}: {' '.join(str(e).split())}") from None
    rows = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rows.append((n, json.loads(line)))
        except json.JSONDecodeError as e:
            raise JaxspecError(f"{label} {path} line {n}: invalid JSON ({e.msg})") from None
    return rows
