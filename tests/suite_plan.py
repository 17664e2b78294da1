"""What the suite is made of, as data (no imports: scripts/test.sh reads it before jax loads).

- PRODUCTION_CODEGEN: the modules that measure the compiled programs users run (HLO bytes and
  copies) or depend on their last bit (greedy identity at a near-tie); they compile with XLA's
  defaults in a process of their own (tests/conftest.py says why).
- LONGEST_FIRST: the modules in order of measured wall time, longest first (docs/testing.md,
  `python scripts/test_profile.py`), so xdist's two workers, which take whole files in order, end
  together instead of one long file running alone at the end.
- EXPECTED_SKIPS: the only skips allowed in CI (CI=true): (module, fragment of the reason).
  Anything else the project installs must be there; a skip elsewhere fails the run.
- QUICK: `bash scripts/test.sh --quick`: one case per property, the inner loop (module -> the
  test names, or name prefixes with a trailing *, that run).
"""

PRODUCTION_CODEGEN = (
    "test_greedy_identity.py",
    "test_roofline.py",
    "test_accelerator_path.py",
    "test_tree_chain.py",
)

LONGEST_FIRST: tuple[str, ...] = ()

EXPECTED_SKIPS = (
    ("test_bench_device.py", "set JAXSPEC_DEVICE_SMOKE=1"),
)

QUICK: dict[str, tuple[str, ...]] = {}
