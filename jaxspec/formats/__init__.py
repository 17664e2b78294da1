"""Drafter checkpoints in published layouts: detect, read into a runtime drafter, write.

    FORMATS: jaxspec (orbax, jaxspec.train) | eagle3 | speculators | medusa (vLLM) |
             medusa_fd (FasterDecoding) | mtp (DeepSeek-V3-style module stored with the target) |
             dflash (z-lab DFlash / DFlash 2 heads) | dspark (speculators 0.9.0 DSpark heads) |
             peagle (speculators 0.9.0 P-EAGLE heads)

    fmt = detect_format(path)                                  # from meta.json / config.json
    drafter, dparams = load_drafter_checkpoint("eagle", path, target)   # any eagle-family layout
    # path: a directory, or a Hub id (org/name[@revision]) downloaded on first use

Which method reads which layouts: eagle <- jaxspec, eagle3, speculators; eagle3 <- jaxspec
(trained with method eagle3), eagle3, speculators; medusa <- jaxspec, medusa, medusa_fd;
mtp <- mtp; draft_model <- jaxspec; dflash <- jaxspec (trained with method dflash), dflash;
dspark <- dspark; peagle <- peagle.
"""

from __future__ import annotations

# Imported inside functions: this package's head stays jax-free (configs name formats, --help
# lists them); the format modules and the drafters, which load jax, load when a checkpoint is read.

from pathlib import Path

from jaxspec.errors import JaxspecError

FORMATS = ("jaxspec", "eagle3", "speculators", "medusa", "medusa_fd", "mtp", "dflash", "dspark",
           "peagle")


def method_formats(method: str) -> tuple[str, ...]:
    """The checkpoint layouts `method` reads: its registration's `formats` (register_drafter)."""
    import jaxspec.drafters  # noqa: F401 -- registers the built-in methods (jax: not at import)
    from jaxspec.drafters.registry import DRAFTERS

    m = DRAFTERS.get(method)
    return m.formats if m is not None and m.formats else ("jaxspec",)


def resolve(path) -> Path:
    from jaxspec.train.checkpoint import resolve_path  # configs name checkpoints/... repo-relative

    return resolve_path(path)


def local_or_hub(path):
    """`path` itself when it exists (as given or repo-relative); a Hub id (`org/name[@revision]`)
    that does not: the snapshot directory of the drafter's files, downloaded (loading.hub)."""
    from jaxspec.loading import hub

    hub_id = hub.parse(str(path))
    if hub_id is None or resolve(path).exists():
        return path
    return hub.fetch(hub_id, purpose="drafter").path


def detect_format(path) -> str:
    p = resolve(path)
    if not p.is_dir():
        raise JaxspecError(f"drafter checkpoint {path} does not exist or is not a directory")
    if (p / "meta.json").is_file():
        return "jaxspec"
    if not (p / "config.json").is_file():
        raise JaxspecError(
            f"{path} has neither meta.json (a jaxspec checkpoint) nor config.json (a published "
            f"EAGLE-3, speculators, Medusa or MTP checkpoint)"
        )
    from jaxspec.formats import dflash, dspark, eagle3, medusa, mtp, peagle
    from jaxspec.formats.tensors import read_config

    config = read_config(p)
    for detect in (peagle.detect, dspark.detect, eagle3.detect, medusa.detect, mtp.detect, dflash.detect):
        fmt = detect(config)
        if fmt:
            return fmt
    raise JaxspecError(
        f"{path}/config.json is not a drafter layout jaxspec knows (EAGLE-3 original or "
        f"speculators, Medusa FasterDecoding or vLLM, MTP, DFlash): set speculative.<method>.checkpoint_format "
        f"to one of {', '.join(FORMATS)}"
    )


def read_head(path, fmt: str):
    """A layout-free head (eagle3.Eagle3Head | medusa.MedusaHead) from a published layout."""
    from jaxspec.formats import eagle3, medusa

    p = resolve(path)
    if fmt in eagle3.LAYOUTS:
        return eagle3.read(p, fmt)
    if fmt in medusa.LAYOUTS:
        return medusa.read(p, fmt)
    raise JaxspecError(
        f"format {fmt!r} has no layout-free head reader: use one of eagle3, speculators, medusa, medusa_fd"
    )


def load_drafter_checkpoint(
    method: str, path, target, fmt: str = "auto", eagle3_layer_ids: str = "input"
):
    """(drafter, dparams) for `method` from the checkpoint directory `path` in `fmt` (auto:
    detected); target: LoadedModel (cfg, params). eagle3_layer_ids: how explicit EAGLE-3 tap ids
    are read (formats.eagle3.check_target: input = vLLM, output = SGLang / SpecForge)."""
    if path is None:
        raise JaxspecError(
            f"speculative.{method}.checkpoint is required for method '{method}': point it to a drafter "
            f"checkpoint directory (jaxspec, EAGLE-3, speculators, Medusa or MTP layout)"
        )
    path = local_or_hub(path)
    got = detect_format(path) if fmt == "auto" else fmt
    allowed = method_formats(method)
    if got not in allowed:
        raise JaxspecError(
            f"drafter checkpoint {path} is in the {got} layout, which method '{method}' does not "
            f"read (it reads {', '.join(allowed)}): change speculative.method or speculative.{method}.checkpoint_format"
        )
    if got == "jaxspec":
        from jaxspec.train.load import load_trained_drafter

        return load_trained_drafter(method, path, target)
    if got == "dflash":
        from jaxspec.formats import dflash

        return dflash.read(resolve(path), target.target)
    if got == "dspark":
        from jaxspec.formats import dspark

        return dspark.read(resolve(path), target.target)
    if got == "peagle":
        from jaxspec.formats import peagle

        return peagle.read(resolve(path), target.cfg, eagle3_layer_ids)
    if got == "mtp":
        from jaxspec.formats import mtp

        return mtp.read(resolve(path), target.cfg, str(path))
    from jaxspec.formats import eagle3, medusa

    head = read_head(path, got)
    if got in eagle3.LAYOUTS:
        return eagle3.to_drafter(head, target.cfg, str(path), eagle3_layer_ids)
    return medusa.to_drafter(head, target.cfg, str(path))
