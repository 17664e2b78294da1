"""XLA:CPU code generation for the tests, as data and flag strings (no jax import: conftest sets
XLA_FLAGS from it before jax loads; tests/mesh_check.py's subprocesses read it too).

- FAST: what JAXSPEC_TEST_FAST_CODEGEN=1 adds (scripts/test.sh sets it for every module but
  suite_plan.PRODUCTION_CODEGEN): LLVM optimisation level 0 and the classic fusion emitters in
  place of the MLIR ones, about a third of the default compile time on tiny models. It changes
  fusion (the optimised HLO) and code generation, so its programs are not the ones users run.
- HLO_CODEGEN: the optimised HLO users' compiles produce, in about half their compile time.
  LLVM's optimisation level acts after the HLO passes, so level 0 with the default (MLIR) fusion
  emitters gives the default compile's optimised HLO text exactly
  (test_roofline.test_the_read_only_compile_gives_the_default_optimised_hlo checks it). For the
  checks that read HLO (cache copies, collectives) and run nothing: as compiler options, or as
  XLA_FLAGS for a subprocess (hlo_codegen_flags).
"""

from __future__ import annotations

FAST = (("xla_backend_optimization_level", "0"), ("xla_cpu_use_fusion_emitters", "false"))
HLO_CODEGEN = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": True}


def production_codegen_flags(xla_flags: str) -> str:
    """XLA_FLAGS without FAST: for subprocesses that depend on the last bit of the programs users
    run."""
    fast = {f"--{flag}={value}" for flag, value in FAST}
    return " ".join(f for f in xla_flags.split() if f not in fast)


def hlo_codegen_flags(xla_flags: str) -> str:
    """XLA_FLAGS for a subprocess whose compiles are only read as HLO (HLO_CODEGEN)."""
    hlo = " ".join(f"--{k}={str(v).lower()}" for k, v in HLO_CODEGEN.items())
    return f"{production_codegen_flags(xla_flags)} {hlo}".strip()
