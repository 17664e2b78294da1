"""Write a jaxspec `method: eagle3` drafter checkpoint at its INITIALISATION (0 training steps:
the midlayer copied from the target's last layer, fc picking the high feature, the first N token
ids as the draft vocabulary), so that the EAGLE-3 export path (python -m jaxspec.export --format
eagle3) and vLLM's EAGLE-3 can be run on SmolLM2 without a trained EAGLE-3 head.

The shipped trained head (checkpoints/smollm2-135m-eagle) is jaxspec's own `eagle` architecture
(a per-feature RMS fuse and an in_proj residual), which the EAGLE-3 layout cannot express and the
exporter refuses; no `eagle3` head is trained in this repository yet. This one is the same
architecture vLLM runs, untrained: its acceptance says nothing about EAGLE-3's, only that both
engines run the same head and agree on the tokens.

    python scripts/eagle3_init_checkpoint.py --out out/checkpoints/smollm2-135m-eagle3-init
    python -m jaxspec.export --checkpoint out/checkpoints/smollm2-135m-eagle3-init \\
        --format eagle3 --out out/formats/smollm2-135m-eagle3-init
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp

    from jaxspec.loading import load_model
    from jaxspec.train import checkpoint as ckpt
    from jaxspec.train.methods import Eagle3

    target = load_model(args.model, layout="unrolled")
    method = Eagle3()
    d2t = jnp.arange(args.draft_vocab, dtype=jnp.int32)
    params, _ = method.init(target, d2t, jax.random.key(0))
    arch = method.arch(target.cfg) | {"draft_vocab": args.draft_vocab}
    training = {"command": " ".join(sys.argv), "steps": 0,
                "note": "initialisation only (scripts/eagle3_init_checkpoint.py): untrained"}
    path = ckpt.save_drafter(args.out, "eagle3", {**params, "d2t": d2t}, arch,
                             ckpt.fingerprint(target.cfg, target.params), training,
                             force=args.force)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
