"""The drafter-case registry (tests/cases.py) covers every registered drafter method: registering
one without cases (or a pointer to where each property is tested) fails here."""

from __future__ import annotations

import subprocess
import sys

import cases
import pytest

from jaxspec.drafters import registry


def shipped_drafters() -> dict:
    """The methods jaxspec itself registers, read in a fresh process (other test modules register
    toy drafters of their own into this one)."""
    names = subprocess.run(
        [sys.executable, "-c", "from jaxspec.drafters import registry; print(*registry.DRAFTERS)"],
        capture_output=True, text=True, check=True).stdout.split()
    return {name: None for name in names}


def test_every_registered_drafter_has_cases():
    gaps = cases.missing(shipped_drafters())
    assert not gaps, f"add cases for {gaps} to tests/cases.py (or say where they are tested)"


def test_a_new_drafter_without_cases_is_caught(monkeypatch):
    drafters = shipped_drafters() | {"newcomer": registry.DRAFTERS["ngram"]}
    assert cases.missing(drafters) == [f"newcomer: {s}" for s in cases.SUITES]
    monkeypatch.setitem(cases.CASES, "newcomer", {"law": ["newcomer"], "identity": "elsewhere",
                                                  "greedy": "elsewhere", "hlo": "elsewhere"})
    assert not cases.missing(drafters)
    assert "newcomer" in cases.names("law")  # ... and the law test now runs it
    with pytest.raises(ValueError, match="unknown suite"):
        cases.names("speed")
