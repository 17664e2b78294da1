"""Is a restructuring free? The optimised HLO of the fixed-γ decode loops (plain, n-gram chain,
n-gram tree, EAGLE chain) on a tiny random Llama, compiled from this tree and from git revision
REV, compared program by program (op metadata such as source lines stripped).

    python -m jaxspec.tools.hlo_diff REV       # exit 0: every loop identical; 1: a difference

Each tree compiles in its own process (XLA's dump of `after_optimizations`, the persistent
compilation cache off), through the engine's public API only, so any revision with
`jaxspec.Engine` can be compared.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOOPS = ("plain", "ngram", "ngram_tree", "eagle")

# runs in a subprocess with PYTHONPATH=<tree>: one engine per loop, one generate each (compiles
# the loop), dumping into $HLO_DIFF_OUT/<loop>/
COMPILE = r"""
import os, jax, numpy as np
from jaxspec import Engine, NgramDrafter
from jaxspec.models import llama
from jaxspec.loading.params import pack_params
from jaxspec import kernels
from jaxspec.train import methods

cfg = llama.ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256)
params = llama.init_params(cfg, jax.random.key(0), scale=0.3)
if kernels.available():
    params = pack_params(params)

class Target:
    cfg, params, tokenizer, eos_token_ids, name = cfg, params, None, (0,), "tiny"
    target = llama.LlamaTarget(cfg)

def eagle():
    m = methods.Eagle(hidden_layers=(0, 1, 1), input_scale=1.0)
    p, frozen = m.init(Target, np.arange(0, 64, 2, dtype=np.int32), jax.random.key(7))
    return m.drafter(Target.target), m.runtime(p, frozen), 3

loop = os.environ["HLO_DIFF_LOOP"]
drafter, dparams, gamma = {
    "plain": lambda: (None, None, 0),
    "ngram": lambda: (NgramDrafter(64, 1, 3), None, 3),
    "ngram_tree": lambda: (NgramDrafter(64, 1, 3, branches=2, depth=3), None, 1),
    "eagle": eagle,
}[loop]()
engine = Engine(Target, drafter, dparams, num_speculative_tokens=gamma, max_context=128)
engine.generate([[5, 9, 3, 5, 9, 3, 5]], max_new_tokens=8)
"""


def dump(tree: Path, out: Path, loops=LOOPS) -> None:
    """Compile each loop from `tree`, its optimised HLO dumped under out/<loop>/."""
    for loop in loops:
        env = {**os.environ, "PYTHONPATH": str(tree), "HLO_DIFF_LOOP": loop,
               "JAXSPEC_XLA_CACHE": "0", "JAX_ENABLE_COMPILATION_CACHE": "false",
               "XLA_FLAGS": f"--xla_dump_to={out / loop} --xla_dump_hlo_as_text "
                            "--xla_dump_hlo_pass_re=^$"}
        subprocess.run([sys.executable, "-c", COMPILE], cwd=tree, env=env, check=True)


SOURCE_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


def decode_loop(folder: Path) -> str:
    """The decode program's optimised HLO without where it was traced from: the op metadata and
    the source tables (file names, functions, lines, stack frames) XLA writes above the
    computations, which change with any move of code."""
    [path] = sorted(folder.glob("*jit_decode*cpu_after_optimizations.txt"))
    lines, in_table = [], False
    for line in path.read_text().splitlines():
        if line in SOURCE_TABLES:
            in_table = True
        elif in_table and not re.match(r"^\d+ ", line):
            in_table = False
        if not in_table:
            lines.append(re.sub(r",? ?metadata=\{[^}]*\}", "", line))
    return "\n".join(lines)


def compare(before: Path, after: Path, loops=LOOPS) -> dict[str, tuple[str, str]]:
    """loop -> (sha256 before, sha256 after) of its decode program."""
    digest = lambda t: hashlib.sha256(t.encode()).hexdigest()[:16]
    return {loop: (digest(decode_loop(before / loop)), digest(decode_loop(after / loop)))
            for loop in loops}


def export(rev: str, into: Path) -> Path:
    """The tree of git revision `rev`, extracted under `into`."""
    archive = into / "rev.tar"
    subprocess.run(["git", "archive", "-o", str(archive), rev], cwd=ROOT, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into / "tree", filter="data")
    return into / "tree"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxspec.tools.hlo_diff",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("rev", help="the git revision to compare this tree with (e.g. HEAD~3)")
    ap.add_argument("--loops", nargs="+", choices=LOOPS, default=list(LOOPS))
    ap.add_argument("--keep", metavar="DIR", help="keep the dumps (DIR/before, DIR/after)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hlo_diff.") as tmp:
        tmp = Path(tmp)
        keep = Path(args.keep) if args.keep else tmp
        old = export(args.rev, tmp)
        dump(old, keep / "before", args.loops)
        dump(ROOT, keep / "after", args.loops)
        result = compare(keep / "before", keep / "after", args.loops)
    for loop, (a, b) in result.items():
        same = "identical" if a == b else "DIFFERENT"
        print(f"{loop:12s} {args.rev}: {a}  this tree: {b}  {same}")
    return 0 if all(a == b for a, b in result.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
