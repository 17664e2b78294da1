"""The drafter-case registry (tests/cases.py) covers every registered drafter method: registering
one without cases (or a pointer to where each property is tested) fails here."""

from __future__ import annotations

import cases
import pytest

from jaxspec.drafters import registry


def test_every_registered_drafter_has_cases():
    gaps = cases.missing(registry.DRAFTERS)
    assert not gaps, f"add cases for {gaps} to tests/cases.py (or say where they are tested)"


def test_a_new_drafter_without_cases_is_caught(monkeypatch):
    monkeypatch.setitem(registry.DRAFTERS, "newcomer", registry.DRAFTERS["ngram"])
    assert cases.missing(registry.DRAFTERS) == [f"newcomer: {s}" for s in cases.SUITES]
    monkeypatch.setitem(cases.CASES, "newcomer", {"law": ["newcomer"], "identity": "elsewhere",
                                                  "greedy": "elsewhere", "hlo": "elsewhere"})
    assert not cases.missing(registry.DRAFTERS)
    assert "newcomer" in cases.names("law")  # ... and the law test now runs it
    with pytest.raises(ValueError, match="unknown suite"):
        cases.names("speed")
