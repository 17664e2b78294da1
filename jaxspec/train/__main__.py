"""python -m jaxspec.train --config configs/train/<x>.yaml [key=value ...]

`kind: data` builds the distillation records (jaxspec.train.data); `kind: train` trains a drafter
(jaxspec.train.train). Overrides are YAML scalars: `steps=10`, `method_args.ttt_steps=2`.
"""

from __future__ import annotations

# Imported inside functions: jax, transformers and torch (and the jaxspec modules that load
# them) load only when a command runs, so its --help answers in a second (tests/test_help.py).

import argparse
import dataclasses
import sys
import time

import yaml

from jaxspec.errors import JaxspecError, short


def _set(d: dict, dotted: str, raw: str) -> None:
    *path, key = dotted.split(".")
    if not key or not all(path):
        raise JaxspecError(f"override {short(dotted + '=' + raw)} is not key=value")
    for p in path:
        d = d.setdefault(p, {})
        if not isinstance(d, dict):
            raise JaxspecError(f"override {short(dotted)}: {p} is not a mapping of keys")
    try:
        d[key] = yaml.safe_load(raw)
    except yaml.YAMLError:
        d[key] = raw


def make_parser() -> argparse.ArgumentParser:
    from jaxspec.cli_support import ArgumentParser

    ap = ArgumentParser(
        prog="python -m jaxspec.train",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Keys: python -m jaxspec.train --list-keys. Outputs go under out/ (export_dir, "
        "ckpt_dir); an existing jaxspec checkpoint at export_dir is replaced only with --force, "
        "and a directory jaxspec did not write never is.",
    )
    ap.add_argument("--config", help="YAML file (kind: data | train, then keys)")
    ap.add_argument(
        "--force", action="store_true", help="replace export_dir if it holds a checkpoint"
    )
    ap.add_argument("--list-keys", action="store_true", help="print the valid keys and exit")
    ap.add_argument("overrides", nargs="*", help="key=value (dotted keys for nested fields)")
    return ap


def list_keys() -> str:
    from jaxspec.train.data import DataConfig
    from jaxspec.train.train import TrainConfig

    lines = []
    for kind, cls in (("train", TrainConfig), ("data", DataConfig)):
        lines.append(f"kind: {kind}")
        for f in dataclasses.fields(cls):
            default = (
                "(required)"
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                else (f.default if f.default is not dataclasses.MISSING else f.default_factory())
            )
            lines.append(f"  {f.name}: {default!r}")
    return "\n".join(lines)


def read_config(path: str) -> dict:
    from pathlib import Path

    from jaxspec.validate import regular_file

    p = Path(path)
    if not p.exists():
        raise JaxspecError(
            f"config file {path} does not exist: pass --config configs/train/<x>.yaml"
        )
    regular_file(p, "config file", max_bytes=1 << 20)
    try:
        cfg = yaml.safe_load(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise JaxspecError(f"config file {path} is not UTF-8 text") from None
    except yaml.YAMLError as e:
        raise JaxspecError(
            f"config file {path} is not valid YAML: {short(' '.join(str(e).split()))}"
        ) from None
    if cfg is None:
        return {}
    if not isinstance(cfg, dict):
        raise JaxspecError(
            f"config file {path} must be a mapping of keys, not a {type(cfg).__name__}"
        )
    return cfg


def run(argv=None) -> int:
    args = make_parser().parse_args(argv)
    if args.list_keys:
        print(list_keys())
        return 0
    if not args.config:
        raise JaxspecError(
            "--config is required: pass --config configs/train/<x>.yaml (see --list-keys)"
        )
    cfg = read_config(args.config)
    for item in args.overrides:
        if "=" not in item:
            raise JaxspecError(f"override {short(item)} is not key=value")
        k, v = item.split("=", 1)
        _set(cfg, k, v)
    kind = cfg.pop("kind", "train")
    t0 = time.time()
    if kind == "data":
        from jaxspec.train.data import DataConfig, build

        if isinstance(cfg.get("layers"), list):
            cfg["layers"] = tuple(cfg["layers"])
        _check_keys(DataConfig, cfg, args.config)
        _check_types(DataConfig, cfg)
        out = build(DataConfig(**cfg))
        print(f"data in {out} ({time.time() - t0:.0f} s)")
    elif kind == "train":
        from jaxspec.train.train import TrainConfig, train

        if args.force:
            cfg["force"] = True
        _check_keys(TrainConfig, cfg, args.config)
        args_ = cfg.get("method_args") or {}
        if not isinstance(args_, dict):
            raise JaxspecError(f"method_args={short(args_)} in {args.config} must be a mapping")
        for k, v in list(args_.items()):
            if isinstance(v, list):
                args_[k] = tuple(v)
        try:
            tc = TrainConfig(**cfg)
        except TypeError as e:  # a required key (method) missing
            raise JaxspecError(f"{args.config}: {e}: see --list-keys") from None
        train(tc)
        print(f"done in {time.time() - t0:.0f} s")
    else:
        raise JaxspecError(f"kind={short(kind)} in {args.config} is invalid: use data or train")
    return 0


def main(argv=None) -> int:
    """The CLI: one `error:` line and exit 2 for bad input, 130 on Ctrl-C (cli_support.run)."""
    from jaxspec.cli_support import run as run_cli

    return run_cli(run, argv)


def _check_keys(cls, cfg: dict, path: str) -> None:
    names = {f.name for f in dataclasses.fields(cls)}
    bad = sorted(map(str, set(cfg) - names))
    if bad:
        raise JaxspecError(f"unknown keys {short(bad)} in {path}: valid keys are {sorted(names)}")


def _check_types(cls, cfg: dict) -> None:
    import typing

    from jaxspec.options import coerce

    hints = typing.get_type_hints(cls)
    for key, value in cfg.items():
        hint = hints[key]
        if key == "layers" and isinstance(value, tuple):
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
                raise JaxspecError(f"layers={short(value)} is invalid: use a list of integers")
            continue
        cfg[key] = coerce(key, value, hint)
        if isinstance(cfg[key], int) and not isinstance(cfg[key], bool) and cfg[key] < 0:
            raise JaxspecError(f"{key}={cfg[key]} is invalid: use an integer >= 0")


if __name__ == "__main__":
    sys.exit(main())
