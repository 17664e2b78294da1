"""One registry-driven list of drafter cases, shared by the tests that every drafter must pass:

    "law"       tests/test_distributions.py    sampled output has the target's exact law (and a
                                               misreported q fails)
    "identity"  tests/test_greedy_identity.py  greedy output == plain at batch 8, large γ
    "greedy"    tests/test_speculative.py      greedy output == plain at γ 1, 3, 5, batch 1 and 4
    "hlo"       tests/test_accelerator_path.py the compiled loop copies no cache-sized buffer

CASES maps every registered drafter method (jaxspec.drafters.registry.DRAFTERS) to its cases per
suite: a list of case names (each test file builds each name; an unknown one fails there), or
a string saying where else that suite's property is tested for the method (or, marked NOT
COVERED, that it is not yet). A method registered
without an entry fails tests/test_cases.py, so a new drafter is covered by registering its cases
here. `names(suite)` is each test's parametrize list.
"""

from __future__ import annotations

SUITES = ("law", "identity", "greedy", "hlo")

CASES: dict[str, dict[str, list[str] | str]] = {
    "ngram": {"law": ["ngram", "eagle_lookup"], "identity": ["ngram", "eagle_lookup"],
              "greedy": ["ngram"], "hlo": ["ngram"]},
    "layer_skip": {"law": ["layer_skip"], "identity": ["layer_skip"], "greedy": ["layer_skip"],
                   "hlo": ["layer_skip"]},
    "draft_model": {"law": ["draft_model"], "identity": ["draft_model"],
                    "greedy": ["draft_model"], "hlo": ["draft_model"]},
    "medusa": {"law": ["medusa"], "identity": ["medusa"],
               "greedy": "tests/test_formats.py (loaded heads: greedy identity)",
               "hlo": "NOT COVERED: no cache-copy count yet (its shipped configs compile for TPU/CUDA)"},
    "eagle": {"law": ["eagle", "eagle_gated", "eagle_lookup"], "identity": ["eagle", "eagle_lookup"],
              "greedy": "tests/test_greedy_identity.py (identity suite)", "hlo": ["eagle"]},
    "eagle3": {"law": "tests/test_formats.py (loaded heads keep the target distribution)",
               "identity": "tests/test_formats.py (loaded heads are greedy identical)",
               "greedy": "tests/test_formats.py (loaded heads are greedy identical)",
               "hlo": "NOT COVERED: no cache-copy count yet"},
    "mtp": {"law": "tests/test_formats.py (loaded heads keep the target distribution)",
            "identity": "tests/test_formats.py (loaded heads are greedy identical)",
            "greedy": "tests/test_formats.py (loaded heads are greedy identical)",
            "hlo": "NOT COVERED: no cache-copy count yet"},
    "block": {"law": "tests/test_block.py (sampled block drafting has the target law)",
              "identity": "tests/test_block.py (greedy block drafting is token identical)",
              "greedy": "tests/test_block.py (greedy block drafting is token identical)",
              "hlo": "NOT COVERED: no cache-copy count yet (its shipped configs compile for TPU/CUDA)"},
    "dflash": {"law": "tests/test_dflash.py (sampled chains, static and dynamic trees: target law)",
               "identity": "tests/test_dflash.py (greedy chains and trees identical at batch 8)",
               "greedy": "tests/test_dflash.py (greedy is token identical at batch 8)",
               "hlo": ["dflash", "dflash_tree"]},
    "dspark": {"law": "tests/test_dspark.py (sampled Markov-biased chains: target law)",
               "identity": "tests/test_dspark.py (greedy chains identical at batch 8)",
               "greedy": "tests/test_dspark.py (greedy is token identical at batch 8)",
               "hlo": "NOT COVERED: no cache-copy count yet"},
    "peagle": {"law": "tests/test_peagle.py (sampled chains and dynamic trees: target law)",
               "identity": "tests/test_peagle.py (greedy chains and trees identical at batch 8)",
               "greedy": "tests/test_peagle.py (greedy is token identical at batch 8)",
               "hlo": "NOT COVERED: no cache-copy count yet"},
    "suffix": {"law": "tests/test_suffix.py (sampled suffix output has the target law)",
               "identity": "tests/test_suffix.py (greedy suffix is token identical)",
               "greedy": "tests/test_suffix.py (greedy suffix is token identical)",
               "hlo": "NOT COVERED: no cache-copy count yet (its shipped configs compile for TPU/CUDA)"},
}


def names(suite: str) -> list[str]:
    """Every case name of `suite`, in registration order, each once."""
    if suite not in SUITES:
        raise ValueError(f"unknown suite {suite!r}: use one of {SUITES}")
    out: list[str] = []
    for per_suite in CASES.values():
        entry = per_suite[suite]
        out += [n for n in entry if n not in out] if isinstance(entry, list) else []
    return out


def missing(registered) -> list[str]:
    """`method: suite` for each registered method without cases (or a pointer) in a suite."""
    out = []
    for method in registered:
        entry = CASES.get(method, {})
        out += [f"{method}: {s}" for s in SUITES if not entry.get(s)]
    return out
