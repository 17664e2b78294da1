"""Reading a config: a YAML file and `a.b.key=value` overrides into `Config`, every key checked
against the sections' schema, every mistake one line naming the dotted key."""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import yaml

from jaxspec.config.sections import SECTIONS, Config, SpeculativeConfig
from jaxspec.errors import JaxspecError
from jaxspec.options import Section, accepts_str, matches, names
from jaxspec.validate import regular_file

# Keys of earlier layouts -> where they live now (a one-line error names the new key).
MOVED = {
    "tree": "speculative.tree",
    "adaptive": "speculative.adaptive",
    "speculative.min_ngram": "speculative.ngram.min_ngram",
    "speculative.max_ngram": "speculative.ngram.max_ngram (with lookup: speculative.lookup.max_ngram)",
    "speculative.lookup_min_ngram": "speculative.lookup.min_ngram",
    "speculative.draft_model": "speculative.draft_model.model",
    "speculative.layer_skip_layers": "speculative.layer_skip.layers",
    "speculative.checkpoint": "speculative.<method>.checkpoint (e.g. speculative.eagle.checkpoint)",
    "speculative.checkpoint_format": "speculative.<method>.checkpoint_format",
    "speculative.eagle3_layer_ids": "speculative.eagle.eagle3_layer_ids (or speculative.eagle3.)",
    "speculative.draft_confidence": "speculative.eagle.draft_confidence",
}


def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Read a YAML file (None: all defaults), apply `a.b.key=value` overrides, validate.

    Override values are parsed as YAML scalars (`0.7`, `true`, `null`); a field typed `str` keeps
    the raw text when the parsed value is not a string (`model.name=2024`).
    """
    values: dict[str, Any] = {}  # nested: key -> dict (a section) or (value, raw text or None)
    if path is not None:
        path = Path(path)
        _read_section(values, Config, "", _read_yaml(path), f"config file {path}")
    for item in overrides:
        parts, raw = _split_override(item)
        _place(values, Config, "", parts, (_parse_scalar(raw), raw), f"override {item!r}")
    return Config(**{s: _build(cls, values.get(s, {})) for s, cls in SECTIONS.items()})


def _sections_of(cls) -> dict[str, type[Section]]:
    return SECTIONS if cls is Config else cls.subsections()


def _leaves_of(cls) -> list[str]:
    return [] if cls is Config else cls.leaf_keys()


def _read_section(values: dict, cls, prefix: str, body: dict, where: str) -> None:
    """Walk one YAML mapping into `values`, checking every key against the schema."""
    subs, leaves = _sections_of(cls), _leaves_of(cls)
    for key, value in body.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if key in subs:
            if value is None:
                value = {}
            if not isinstance(value, dict):
                moved = f" ({full} moved to {MOVED[full]})" if full in MOVED else ""
                raise JaxspecError(
                    f"{where}: section '{full}' must be a mapping of keys, not a "
                    f"{type(value).__name__}{moved}"
                )
            _read_section(values.setdefault(key, {}), subs[key], full, value, where)
        elif key in leaves:
            values[key] = (value, None)
        else:
            _unknown(cls, full, key, where)


def _place(values: dict, cls, prefix: str, parts: list[str], leaf, where: str) -> None:
    """Put one override `parts = [section, ..., key]` into `values`."""
    key, rest = parts[0], parts[1:]
    full = f"{prefix}.{key}" if prefix else key
    subs = _sections_of(cls)
    if key in subs:
        if not rest:
            moved = f": it moved to {MOVED[full]}" if full in MOVED else ""
            raise JaxspecError(
                f"{where}: '{full}' is a section, not a key{moved} (set {full}.<key>=value; keys: "
                f"{names(_keys(subs[key]))})"
            )
        _place(values.setdefault(key, {}), subs[key], full, rest, leaf, where)
    elif key in _leaves_of(cls) and not rest:
        values[key] = leaf
    else:
        _unknown(cls, full, key, where, ".".join([full, *rest]))


def _keys(cls) -> list[str]:
    return [*_leaves_of(cls), *_sections_of(cls)]


def _unknown(cls, full: str, key: Any, where: str, given: str | None = None) -> None:
    """`full`: the first unknown part of the key (`given`: all of it, for an override)."""
    given = given or full
    for old, new in MOVED.items():
        if given == old or given.startswith(old + "."):
            rest = given[len(old):]
            new = new + rest if " " not in new else new
            raise JaxspecError(f"{where}: '{given}' is an old key: it moved to {new}")
    if cls is Config:
        raise JaxspecError(
            f"{where}: unknown section '{key}': valid sections are {names(SECTIONS)}"
        )
    raise JaxspecError(f"{where}: unknown key '{full}': valid keys are {names(_keys(cls))}")


def _build(cls, values: dict) -> Section:
    """The section from its read values: subsections first, str fields keep raw override text."""
    hints = typing.get_type_hints(cls)
    subs = cls.subsections()
    fields, extra = {}, {}
    for key, value in values.items():
        if key in subs:
            (fields if key in hints else extra)[key] = _build(subs[key], value)
            continue
        value, raw = value
        if raw is not None and not matches(value, hints[key]) and accepts_str(hints[key]):
            value = raw
        fields[key] = value
    if cls is SpeculativeConfig:
        return SpeculativeConfig.from_sections(fields, extra)
    return cls(**fields)


def _read_yaml(path: Path) -> dict[str, Any]:
    if path.exists():
        regular_file(path, "config file", max_bytes=1 << 20)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise JaxspecError(f"config file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise JaxspecError(f"cannot read config file {path}: {_one_line(e)}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise JaxspecError(f"config file {path} is not valid YAML: {_one_line(e)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise JaxspecError(
            f"config file {path} must be a mapping of sections ({names(SECTIONS)}), "
            f"not a {type(data).__name__}"
        )
    return data


def _split_override(item: str) -> tuple[list[str], str]:
    name, sep, raw = item.partition("=")
    parts = name.strip().split(".")
    if not sep or len(parts) < 2 or not all(parts):
        raise JaxspecError(
            f"override {item!r} is not of the form section.key=value "
            f"(e.g. sampling.temperature=0.7 or speculative.ngram.max_ngram=4)"
        )
    return parts, raw.strip()


def _parse_scalar(raw: str) -> Any:
    try:
        value = yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError:
        return raw
    return value if value is None or isinstance(value, (str, int, float, bool)) else raw


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())
