"""Plant known-dangerous mutations one at a time in a scratch copy of the repository and run the
tests that should catch each; report which survive (docs/testing.md records the last run).

    python scripts/mutation_check.py                  # every mutation
    python scripts/mutation_check.py residual tree_path --timeout 600

A mutation is (name, file, the exact text it replaces, its replacement, the pytest arguments
that must fail). The text must occur exactly once in the file: when the code moves on, the
script says the mutation is stale instead of planting nothing. Each run uses the fast code
generation and the kept XLA cache, as tests/conftest.py sets them (`scripts/test.sh` does).
Exit status: 0 when every mutation is caught, 1 when one survives or is stale.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]


class Mutation(NamedTuple):
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
    what: str


MUTATIONS = (
    Mutation("acceptance_rule", "jaxspec/decode/acceptance.py",
             "ok = u[:g] * q_t < p_t", "ok = u[:g] < p_t",
             ("tests/test_acceptance.py",),
             "accept a draft with probability p instead of min(1, p/q)"),
    Mutation("residual", "jaxspec/decode/acceptance.py",
             "resid = jnp.maximum(p_n - q_n, 0.0)", "resid = p_n",
             ("tests/test_acceptance.py",),
             "after a rejection draw from p instead of the residual max(0, p - q)"),
    Mutation("tree_path", "jaxspec/decode/logprobs.py",
             "nodes = jnp.clip(path, 0, logits.shape[1] - 1)",
             "nodes = jnp.clip(jnp.broadcast_to(jnp.arange(path.shape[1]), path.shape), 0, "
             "logits.shape[1] - 1)",
             ("tests/test_loop_logprobs.py", "-k", "non_first"),
             "score a tree's accepted path as if it were window nodes 0..D in order"),
    Mutation("logprob_position", "jaxspec/decode/logprobs.py",
             "at = jnp.take_along_axis(logits, nodes[:, :, None], axis=1)",
             "at = jnp.take_along_axis(logits, jnp.minimum(nodes + 1, logits.shape[1] - 1)"
             "[:, :, None], axis=1)",
             ("tests/test_loop_logprobs.py", "-k", "equal_a_full_forward and ngram"),
             "read each token's logprob at its own node, one position late"),
    Mutation("rollback", "jaxspec/decode/speculate.py",
             "cache=cache.with_lengths(out.lengths - 1),",
             "cache=cache.with_lengths(state.cache.lengths + out.path.shape[1]),",
             ("tests/test_speculative.py", "-k", "token_identical"),
             "keep the whole verified window in the cache after a rejection (no rollback)"),
    Mutation("mask_handoff", "jaxspec/constrain/draft.py",
             "new_q = new_q if report_masked else q", "new_q = q",
             ("tests/test_structured_loop.py", "-k", "exact_law and eagle"),
             "report the drafter's unmasked q for drafts put under the grammar"),
    Mutation("hybrid_rollback", "jaxspec/models/qwen3_5.py",
             "ssm = tuple(hybrid_cache.write_states(r, pick(w), positions + 1)",
             "ssm = tuple(hybrid_cache.write_states(r, jnp.broadcast_to(pick(w)[:, -1:], "
             "pick(w).shape), positions + 1)",
             ("tests/test_qwen3_5.py", "-k", "token_identical and draft_model"),
             "a hybrid target keeps the last path entry's recurrent state at every committed "
             "length (no rollback of the linear layers' state after a rejection)"),
    Mutation("page_reservation", "jaxspec/serving/kv_manager.py",
             "return min(grow + self.num_nodes + 1, self.capacity)",
             "return min(grow, self.capacity)",
             ("tests/test_kv_manager.py", "tests/test_prefix_cache.py"),
             "reserve pages for a row's growth but not its verify window"),
)


def scratch_copy() -> Path:
    """The working tree (what git would commit, untracked files included) in a temp dir."""
    dest = Path(tempfile.mkdtemp(prefix="jaxspec-mutants-"))
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def environment(scratch: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(scratch), JAXSPEC_TEST_FAST_CODEGEN="1")
    env.setdefault("JAX_COMPILATION_CACHE_DIR",
                   str(Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache", "jaxspec", "test-xla")))
    env.pop("CI", None)
    return env


def run(mutation: Mutation, scratch: Path, timeout: int) -> tuple[str, float]:
    """-> (caught | survived | stale | error: ..., seconds)."""
    path = scratch / mutation.path
    text = path.read_text()
    if text.count(mutation.old) != 1:
        return f"stale ({mutation.old!r} occurs {text.count(mutation.old)} times)", 0.0
    path.write_text(text.replace(mutation.old, mutation.new))
    start = time.monotonic()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-x", "-q", *mutation.tests],
            cwd=scratch, env=environment(scratch), capture_output=True, text=True, timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        path.write_text(text)
    seconds = time.monotonic() - start
    if rc is None:
        return f"error: timed out after {timeout} s", seconds
    if rc == 0:
        return "survived", seconds
    if rc == 1:
        return "caught", seconds
    return f"error: pytest exit {rc}: {(proc.stdout + proc.stderr).strip().splitlines()[-1:]}", seconds


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="*", help=f"mutations to plant (default all: "
                   f"{', '.join(m.name for m in MUTATIONS)})")
    p.add_argument("--timeout", type=int, default=900, help="seconds per mutation's tests")
    args = p.parse_args(argv)
    known = {m.name: m for m in MUTATIONS}
    unknown = [n for n in args.names if n not in known]
    if unknown:
        p.error(f"unknown mutation {unknown[0]!r}: choose from {', '.join(known)}")
    chosen = [known[n] for n in args.names] if args.names else list(MUTATIONS)
    scratch = scratch_copy()
    bad = 0
    try:
        print(f"{'mutation':18} {'result':9} {'s':>5}  tests | what", flush=True)
        for m in chosen:
            result, seconds = run(m, scratch, args.timeout)
            bad += result != "caught"
            print(f"{m.name:18} {result:9} {seconds:5.0f}  {' '.join(m.tests)} | {m.what}", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"{len(chosen) - bad} of {len(chosen)} caught", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
