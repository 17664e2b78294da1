"""python -m jaxspec.train --config configs/train/<x>.yaml [key=value ...]

`kind: data` builds the distillation records (jaxspec.train.data); `kind: train` trains a drafter
(jaxspec.train.train). Overrides are YAML scalars: `steps=10`, `method_args.ttt_steps=2`.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import yaml

from jaxspec.errors import JaxspecError


def _set(d: dict, dotted: str, raw: str) -> None:
    *path, key = dotted.split(".")
    for p in path:
        d = d.setdefault(p, {})
    d[key] = yaml.safe_load(raw)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxspec.train", description=__doc__)
    ap.add_argument("--config", required=True)
    ap.add_argument("overrides", nargs="*", help="key=value (dotted keys for nested fields)")
    args = ap.parse_args(argv)
    try:
        with open(args.config) as f:
            cfg = yaml.safe_load(f) or {}
        for item in args.overrides:
            if "=" not in item:
                raise JaxspecError(f"override {item!r} is not key=value")
            k, v = item.split("=", 1)
            _set(cfg, k, v)
        kind = cfg.pop("kind", "train")
        t0 = time.time()
        if kind == "data":
            from jaxspec.train.data import DataConfig, build

            if "layers" in cfg:
                cfg["layers"] = tuple(cfg["layers"])
            _check_keys(DataConfig, cfg, args.config)
            out = build(DataConfig(**cfg))
            print(f"data in {out} ({time.time() - t0:.0f} s)")
        elif kind == "train":
            from jaxspec.train.train import TrainConfig, train

            _check_keys(TrainConfig, cfg, args.config)
            args_ = cfg.get("method_args") or {}
            for k, v in list(args_.items()):
                if isinstance(v, list):
                    args_[k] = tuple(v)
            train(TrainConfig(**cfg))
            print(f"done in {time.time() - t0:.0f} s")
        else:
            raise JaxspecError(f"kind={kind!r} in {args.config} is invalid: use data or train")
    except JaxspecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _check_keys(cls, cfg: dict, path: str) -> None:
    names = {f.name for f in dataclasses.fields(cls)}
    bad = sorted(set(cfg) - names)
    if bad:
        raise JaxspecError(f"unknown keys {bad} in {path}: valid keys are {sorted(names)}")


if __name__ == "__main__":
    sys.exit(main())
