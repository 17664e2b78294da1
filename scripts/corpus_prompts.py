"""Write distillation prompts over real text (German and English fortune files, the FOLDOC and
Jargon File dictionaries) in the request kinds Spec-Bench measures, and a held-out tuning set
in Spec-Bench's format from texts the training prompts never use.

    python scripts/corpus_prompts.py            # -> out/corpus.jsonl, out/tuning-corpus.jsonl
    python -m jaxspec.train --config configs/train/data-corpus.yaml

The texts come from Debian packages (`apt-get download`, no root needed; the package registry is
reachable here). --root uses an already unpacked tree instead.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

PACKAGES = ("fortunes-de", "fortunes", "dict-foldoc", "dict-jargon")


def fetch(root: Path) -> Path:
    """Download and unpack PACKAGES under root (once)."""
    if (root / "usr/share/games/fortunes/de").is_dir() and (root / "usr/share/dictd").is_dir():
        return root
    debs = root.parent / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    try:
        subprocess.run(["apt-get", "download", *PACKAGES], cwd=debs, check=True, capture_output=True)
        for deb in sorted(debs.glob("*.deb")):
            subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", b"") or str(e).encode()
        sys.exit(f"error: could not fetch {' '.join(PACKAGES)} with apt-get/dpkg-deb "
                 f"({detail.decode(errors='replace').strip().splitlines()[-1]}); unpack them yourself and pass --root")
    return root


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out/corpus.jsonl")
    ap.add_argument("--tuning-out", default="out/tuning-corpus.jsonl")
    ap.add_argument("--root", default="out/corpora/root", help="unpacked package tree")
    ap.add_argument("-n", type=int, default=2800, help="training prompts")
    ap.add_argument("--tuning-per-kind", type=int, default=6)
    args = ap.parse_args(argv)

    from jaxspec.train.corpus import corpus_prompts, load_corpora

    german, english, entries = load_corpora(fetch(Path(args.root)))
    # every 10th text is held out: the tuning set draws only from those, training never does
    held = lambda xs: [x for i, x in enumerate(xs) if i % 10 == 9]  # noqa: E731
    train = lambda xs: [x for i, x in enumerate(xs) if i % 10 != 9]  # noqa: E731
    rows = corpus_prompts(train(german), train(english), train(entries), args.n, seed=0)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        for cat, prompt in rows:
            f.write(json.dumps({"category": cat, "prompt": prompt}) + "\n")
    tune = corpus_prompts(held(german), held(english), held(entries), 7 * args.tuning_per_kind, seed=1)
    with open(args.tuning_out, "w") as f:
        for qid, (cat, prompt) in enumerate(tune):
            f.write(json.dumps({"question_id": qid, "category": cat, "turns": [prompt]}) + "\n")
    print(f"{len(german)} German / {len(english)} English fortunes, {len(entries)} dictionary entries: "
          f"{len(rows)} prompts -> {args.out}, {len(tune)} held-out questions -> {args.tuning_out}")


if __name__ == "__main__":
    main()
