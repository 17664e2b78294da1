"""python -m jaxspec.export --checkpoint DIR --format eagle3|speculators|medusa|medusa_fd|dflash|dspark|peagle --out DIR

Write a drafter checkpoint in a published layout (safetensors + config.json) that vLLM, SGLang
or `speculators` read, from:
  - a jaxspec checkpoint (python -m jaxspec.train): method eagle3 -> eagle3 / speculators;
    method medusa -> medusa (vLLM, token_map = the draft vocabulary); method dflash -> dflash
    (the authors' DFlashDraftModel layout, which the `dflash` package, vLLM and SGLang load);
    method dspark -> dspark and method peagle -> peagle (speculators 0.9.0's layouts). The
    frozen pieces (the
    target's LM-head rows) come from the target (--model), as when jaxspec loads the checkpoint.
  - a published checkpoint: eagle3 <-> speculators, medusa_fd <-> medusa (conversion).

Only exact exports are written. jaxspec's own `eagle` head (per-feature RMS fuse, in_proj residual)
is not the EAGLE-3 architecture and is refused: train `method: eagle3` for a servable head.
FasterDecoding's layout has no draft vocabulary: heads over one are refused for medusa_fd.
Bad input prints one line `error: ...` and exits with status 2.
"""

from __future__ import annotations

# Imported inside functions: jax, transformers and torch (and the jaxspec modules that load
# them) load only when a command runs, so its --help answers in a second (tests/test_help.py).

import argparse
import json
import sys
import time
from pathlib import Path

from jaxspec.cli_support import ArgumentParser
from jaxspec.errors import JaxspecError
from jaxspec.output_dir import check_output_dir, replace_dir

OUT_FORMATS = ("eagle3", "speculators", "medusa", "medusa_fd", "dflash", "dspark", "peagle")
FAMILY = {"eagle3": "eagle3", "speculators": "eagle3", "medusa": "medusa", "medusa_fd": "medusa",
          "dflash": "dflash", "dspark": "dspark", "peagle": "peagle"}


def make_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="python -m jaxspec.export", description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, help="drafter checkpoint directory")
    ap.add_argument("--format", required=True, choices=OUT_FORMATS, help="layout to write")
    ap.add_argument(
        "--out",
        required=True,
        help="output directory: new or empty (an earlier export is replaced only with --force; "
        "any other non-empty directory is refused)",
    )
    ap.add_argument(
        "--force", action="store_true", help="replace --out when it holds an earlier jaxspec export"
    )
    ap.add_argument(
        "--model",
        default=None,
        help="target of a jaxspec checkpoint (name, HF dir or .gguf; default smollm2-135m); "
        "also recorded as the verifier / base model in the written config",
    )
    ap.add_argument("--from-format", default="auto", help="layout of --checkpoint (auto: detected)")
    ap.add_argument(
        "--include-embed",
        action="store_true",
        help="eagle3/speculators from a jaxspec checkpoint: also write the target's "
        "embedding as embed_tokens.weight (for servers that do not share it)",
    )
    return ap


def export(
    checkpoint,
    fmt: str,
    out,
    model: str | None = None,
    from_format: str = "auto",
    include_embed: bool = False,
    target=None,
    force: bool = False,
) -> dict:
    """Write `checkpoint` to `out` in layout `fmt`; returns a summary. `target`: an already
    loaded target (else --model is loaded when the source is a jaxspec checkpoint)."""
    from jaxspec import formats
    from jaxspec.formats import eagle3, medusa

    if fmt not in OUT_FORMATS:
        raise JaxspecError(f"--format {fmt!r} is invalid: use one of {', '.join(OUT_FORMATS)}")
    out = Path(out)
    check_output_dir(out, force=force, what="--out")  # before any model is loaded
    src = formats.detect_format(checkpoint) if from_format == "auto" else from_format
    if src not in formats.FORMATS:
        raise JaxspecError(
            f"--from-format {src!r} is invalid: use auto or one of {', '.join(formats.FORMATS)}"
        )
    if src == "mtp":
        raise JaxspecError(
            f"{checkpoint} is an MTP module stored with its target: it is served from there, not exported"
        )
    if fmt in ("dflash", "dspark", "peagle"):
        return _block_head(checkpoint, fmt, src, out, model, target, force)
    if src == "jaxspec":
        head, method = _from_jaxspec(checkpoint, fmt, model, include_embed, target)
    else:
        if FAMILY.get(src) != FAMILY[fmt]:
            raise JaxspecError(
                f"{checkpoint} is a {src} checkpoint: it can be written as "
                f"{' or '.join(k for k, v in FAMILY.items() if v == FAMILY.get(src))}, not {fmt}"
            )
        head, method = formats.read_head(checkpoint, src), FAMILY[src]
    with replace_dir(out, force=force, what="--out", marker=True) as tmp:  # atomic
        if FAMILY[fmt] == "eagle3":
            eagle3.write(head, tmp, fmt, verifier=model)
        else:
            medusa.write(head, tmp, fmt, base_model=model)
    return {
        "checkpoint": str(checkpoint),
        "from": src,
        "method": method,
        "format": fmt,
        "out": str(out),
    }


def _checkpoint_method(checkpoint) -> str:
    from jaxspec.train.checkpoint import resolve_path

    try:
        return json.loads((resolve_path(checkpoint) / "meta.json").read_text())["method"]
    except (OSError, ValueError, KeyError):
        raise JaxspecError(
            f"{checkpoint}/meta.json is unreadable: not a jaxspec drafter checkpoint"
        ) from None


def _block_head(checkpoint, fmt, src, out, model, target, force) -> dict:
    """A jaxspec checkpoint of method dflash, dspark or peagle -> the authors' layout (DFlash's) or
    the speculators layout (DSpark's, P-EAGLE's); DFlash's config names the target's layer count
    and P-EAGLE's its dims, so the target is loaded for all."""
    from jaxspec.formats import dflash as dflash_format, dspark as dspark_format
    from jaxspec.formats import peagle as peagle_format
    from jaxspec.train.load import load_trained_drafter

    if src != "jaxspec":
        raise JaxspecError(
            f"{checkpoint} is a {src} checkpoint: only a jaxspec checkpoint trained with method "
            f"{fmt} can be written as {fmt}"
            + (" (it is already in that layout)" if src == fmt else "")
        )
    method = _checkpoint_method(checkpoint)
    if method != fmt:
        raise JaxspecError(
            f"{checkpoint} holds a jaxspec '{method}' drafter, which cannot be written as {fmt}: "
            f"train method {fmt}"
        )
    if target is None:
        from jaxspec.loading import load_model

        target = load_model(model or "smollm2-135m", layout="unrolled")
    drafter, dparams = load_trained_drafter(fmt, checkpoint, target)
    with replace_dir(out, force=force, what="--out", marker=True) as tmp:  # atomic
        if fmt == "dflash":
            dflash_format.write(tmp, drafter, dparams, target.target.num_layers)
        elif fmt == "peagle":
            peagle_format.write(tmp, drafter, dparams, target.cfg, verifier=model)
        else:
            dspark_format.write(tmp, drafter, dparams)
    return {"checkpoint": str(checkpoint), "from": src, "method": method, "format": fmt,
            "out": str(out)}


def _from_jaxspec(checkpoint, fmt, model, include_embed, target):
    import numpy as np

    from jaxspec.formats import eagle3, medusa
    from jaxspec.models import base
    from jaxspec.train.checkpoint import resolve_path
    from jaxspec.train.load import load_trained_drafter

    try:
        method = json.loads((resolve_path(checkpoint) / "meta.json").read_text())["method"]
    except (OSError, ValueError, KeyError):
        raise JaxspecError(
            f"{checkpoint}/meta.json is unreadable: not a jaxspec drafter checkpoint"
        ) from None
    if method == "eagle":
        raise JaxspecError(
            f"{checkpoint} is jaxspec's own EAGLE head (per-feature RMS fuse and an in_proj "
            f"residual), which the EAGLE-3 layout cannot express exactly: train method eagle3 "
            f"(python -m jaxspec.train) for a head vLLM/SGLang can serve"
        )
    want = {"eagle3": ("eagle3", "speculators"), "medusa": ("medusa", "medusa_fd")}.get(method, ())
    if fmt not in want:
        raise JaxspecError(
            f"{checkpoint} holds a jaxspec '{method}' drafter, which cannot be written as {fmt}"
            + (f": use --format {' or '.join(want)}" if want else "")
        )
    if target is None:
        from jaxspec.loading import load_model

        target = load_model(model or "smollm2-135m", layout="unrolled")
    drafter, dparams = load_trained_drafter(method, checkpoint, target)
    if method == "medusa":
        return medusa.from_jaxspec(dparams, target.cfg.vocab_size), method
    head = eagle3.from_params(drafter, dparams, target.cfg)
    if include_embed:
        table = base.require(target.target, "embedding_table", "export --include-embed")
        head.params["embed"] = np.asarray(table(target.params), np.float32)
    return head, method


def main(argv=None) -> int:
    try:
        args = make_parser().parse_args(argv)
        t0 = time.time()
        summary = export(
            args.checkpoint, args.format, args.out, args.model, args.from_format, args.include_embed,
            force=args.force,
        )
        print(json.dumps(summary | {"seconds": round(time.time() - t0, 2)}))
    except JaxspecError as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    from jaxspec.cli_support import run as run_cli

    sys.exit(run_cli(main))
