"""The drafter protocol, as drafter modules import it.

It is defined beside the loop that consumes it (`jaxspec/decode/drafter.py`), so the loop never
imports the drafters package; this module is where a drafting method takes it from.
"""

from __future__ import annotations

from jaxspec.decode.drafter import (  # noqa: F401
    CommitContext,
    DraftContext,
    Drafter,
    Proposal,
    Traits,
    check_target,
    traits,
)
