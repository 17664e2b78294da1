"""Checks on every file a checkpoint hands jaxspec, applied before anything is allocated.

One layer per file kind, shared by the loaders:
  - any file: a regular file (a FIFO, a device or a symlink to one is refused, never opened for
    reading), inside the checkpoint directory, under a size bound;
  - JSON files (config.json, generation_config.json, tokenizer_config.json, indexes, drafter
    configs): UTF-8, standard JSON (no NaN / Infinity literals), an object at the top;
  - fields (`Fields`): the type each field must have (an int is never a bool or a string), its
    range, finite floats;
  - safetensors headers (`check_safetensors_header`): dtypes, shapes, offsets inside the file,
    byte counts equal to the shape's, no two tensors sharing bytes;
  - counts against tensors (`check_layer_count`): a config's layer count must match the layers
    whose tensors are present, so a huge count fails before a param tree of that size is built.

Every failure is a `JaxspecError` naming the file, the field and the fix.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from jaxspec.errors import JaxspecError, short

MAX_JSON_BYTES = 64 << 20  # config files; tokenizer.json is bounded separately
MAX_TOKENIZER_BYTES = 512 << 20
MAX_SAFETENSORS_HEADER = 100 << 20  # the safetensors library's own limit
MAX_LAYERS = 4096  # no released decoder comes near; a bigger count is a damaged config
MAX_DIM = 1 << 20  # hidden / intermediate / vocabulary sizes and head dims
MISSING = object()

# ---- files --------------------------------------------------------------------------------


def regular_file(path: Path, what: str, max_bytes: int | None = MAX_JSON_BYTES) -> int:
    """The size of `path`, which must be a regular file (after symlinks) under `max_bytes`."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise JaxspecError(
            f"{path} cannot be read ({e.strerror}): {what} must be a readable file"
        ) from None
    if not stat.S_ISREG(st.st_mode):
        raise JaxspecError(
            f"{path} is not a regular file (a FIFO, device or directory): {what} must be a plain "
            f"file; replace it with the real file"
        )
    if max_bytes is not None and st.st_size > max_bytes:
        raise JaxspecError(
            f"{path} is {st.st_size} bytes, more than the {max_bytes >> 20} MiB a {what} may be: "
            f"the file is damaged or not a {what}"
        )
    return st.st_size


def confined(root: Path, name: Any, source: str, field: str) -> Path:
    """`root / name` for a relative file name that stays inside `root` (no absolute paths, no
    `..`, no symlink leading out)."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise JaxspecError(
            f"{source}: {field}={short(name)} is not a file name: fix or re-download it"
        )
    p = Path(name)
    if p.is_absolute() or ".." in p.parts:
        raise JaxspecError(
            f"{source}: {field}={short(name)} points outside the checkpoint directory: a "
            f"checkpoint may only name files inside its own directory"
        )
    full = root / p
    try:
        real_root, real = os.path.realpath(root), os.path.realpath(full)
    except (OSError, ValueError):
        real_root, real = str(root), str(full)
    # a Hugging Face cache snapshot links its files into the repo's blobs/ (loading.hub)
    roots = [real_root]
    if Path(root).parent.name == "snapshots":
        roots.append(os.path.realpath(Path(root).parent.parent / "blobs"))
    if not any(os.path.commonpath([r, real]) == r for r in roots):
        raise JaxspecError(
            f"{source}: {field}={short(name)} is a link outside the checkpoint directory: a "
            f"checkpoint may only name files inside its own directory"
        )
    return full


def _no_constants(token: str):
    raise ValueError(f"{token} is not valid JSON (use a finite number)")


def read_json(path: Path, what: str = "JSON file", max_bytes: int = MAX_JSON_BYTES) -> dict:
    """A JSON object from a regular, UTF-8, standard-JSON file, or a one-line JaxspecError."""
    regular_file(path, what, max_bytes)
    try:
        text = path.read_bytes().decode("utf-8")
        data = json.loads(text, parse_constant=_no_constants)
    except UnicodeDecodeError:
        raise JaxspecError(f"{path} is not UTF-8 text: fix or re-download the {what}") from None
    except (ValueError, RecursionError) as e:
        raise JaxspecError(
            f"{path} is not valid JSON ({str(e)[:100]}): fix or re-download the {what}"
        ) from None
    except OSError as e:
        raise JaxspecError(f"{path} cannot be read ({e.strerror}): check the file") from None
    if not isinstance(data, dict):
        raise JaxspecError(
            f"{path} holds a JSON {type(data).__name__}, not an object: fix or re-download the {what}"
        )
    return data


# ---- fields -------------------------------------------------------------------------------


class Fields:
    """Typed, range-checked reads of a config mapping; errors name `source` and the field.

    f = Fields(hf, "ckpt/config.json")
    layers = f.int("num_hidden_layers", lo=1, hi=MAX_LAYERS)
    theta = f.float("rope_theta", 10000.0, lo=0.0, lo_open=True)
    """

    def __init__(self, data: dict | Callable[[str], Any], source: str, prefix: str = ""):
        self.get_raw = data if callable(data) else (lambda k: data.get(k, MISSING))
        self.source, self.prefix = source, prefix

    def fail(self, key: str, value: Any, why: str):
        raise JaxspecError(f"{self.source}: {self.prefix}{key}={short(value)} is invalid: {why}")

    def raw(self, key: str, default: Any = MISSING) -> Any:
        value = self.get_raw(key)
        if value is MISSING or value is None:
            if default is MISSING:
                raise JaxspecError(
                    f"{self.source} lacks {self.prefix}{key}: the file is incomplete; add it or "
                    f"re-download the checkpoint"
                )
            return default
        return value

    def given(self, key: str) -> bool:
        value = self.get_raw(key)
        return value is not MISSING and value is not None

    def int(
        self, key: str, default: Any = MISSING, *, lo: int | None = None, hi: int | None = None
    ):
        value = self.raw(key, default)
        if not self.given(key):
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer() and math.isfinite(value):
                value = int(value)  # some converters write 4096.0
            else:
                self.fail(key, value, "use an integer")
        return self._range(key, value, lo, hi)

    def float(
        self,
        key: str,
        default: Any = MISSING,
        *,
        lo: float | None = None,
        hi: float | None = None,
        lo_open: bool = False,
    ) -> float:
        value = self.raw(key, default)
        if not self.given(key):
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.fail(key, value, "use a number")
        value = float(value)
        if not math.isfinite(value):
            self.fail(key, value, "use a finite number")
        if lo is not None and (value < lo or (lo_open and value == lo)):
            self.fail(key, value, f"use a number {'>' if lo_open else '>='} {lo:g}")
        if hi is not None and value > hi:
            self.fail(key, value, f"use a number <= {hi:g}")
        return value

    def bool(self, key: str, default: Any = MISSING) -> bool:
        value = self.raw(key, default)
        if not isinstance(value, bool):
            self.fail(key, value, "use true or false")
        return value

    def str(self, key: str, default: Any = MISSING, choices: Iterable[str] | None = None) -> str:
        value = self.raw(key, default)
        if not isinstance(value, str):
            self.fail(key, value, "use a string")
        if choices is not None and value not in choices:
            self.fail(key, value, f"use one of {', '.join(choices)}")
        return value

    def dict(self, key: str, default: Any = MISSING) -> dict:
        value = self.raw(key, default)
        if not isinstance(value, dict):
            self.fail(key, value, "use a JSON object")
        return value

    def int_list(
        self,
        key: str,
        default: Any = MISSING,
        *,
        lo: int | None = None,
        hi: int | None = None,
        scalar_ok: bool = False,
    ) -> list[int]:
        value = self.raw(key, default)
        if not self.given(key):
            return value
        items = [value] if scalar_ok and not isinstance(value, list) else value
        if not isinstance(items, list) or len(items) > 4096:
            self.fail(key, value, "use a list of integers")
        for v in items:
            if isinstance(v, bool) or not isinstance(v, int):
                self.fail(key, value, "use integers (not strings or true/false)")
            self._range(key, v, lo, hi)
        return list(items)

    def _range(self, key, value, lo, hi):
        if lo is not None and value < lo:
            self.fail(key, value, f"use an integer >= {lo}")
        if hi is not None and value > hi:
            self.fail(key, value, f"use an integer <= {hi}")
        return value


def token_ids(f: Fields, key: str, vocab: int) -> list[int]:
    """An `eos_token_id`-style field (an id or a list of ids), each in the vocabulary."""
    return f.int_list(key, [], lo=0, hi=vocab - 1, scalar_ok=True)


# Where a checkpoint format keeps the attention sizes: (model dim, query heads, kv heads, head dim).
HF_ATTENTION = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")
GGUF_ATTENTION = ("embedding_length", "attention.head_count", "attention.head_count_kv",
                  "attention.key_length")


def attention_dims(f: Fields, keys: tuple[str, str, str, str] = HF_ATTENTION) -> tuple[int, int, int, int]:
    """(model dim, query heads, kv heads, head dim) of a decoder config, each range-checked: the
    query heads a multiple of the kv heads (grouped attention), the head dim given or the model dim
    divided by the heads (which must divide it), and even (rotary embeddings rotate pairs). One
    check for every family and format (HF config.json, GGUF metadata, drafter heads)."""
    hidden_key, heads_key, kv_key, head_key = keys
    dim = dict(lo=1, hi=MAX_DIM)
    hidden, heads = f.int(hidden_key, **dim), f.int(heads_key, **dim)
    kv_heads = f.int(kv_key, heads, **dim)
    if heads % kv_heads:
        f.fail(kv_key, kv_heads, f"{heads_key}={heads} must be a multiple of it")
    if not f.given(head_key) and hidden % heads:
        f.fail(heads_key, heads, f"{hidden_key}={hidden} must be a multiple of it (or set {head_key})")
    head_dim = f.int(head_key, hidden // heads, **dim)
    if head_dim % 2:
        f.fail(head_key, head_dim, "rotary embeddings need an even head size")
    return hidden, heads, kv_heads, head_dim



# Where a checkpoint format keeps the MLP width and the layer count.
HF_STACK = ("intermediate_size", "num_hidden_layers")
GGUF_STACK = ("feed_forward_length", "block_count")


def decoder_dims(f: Fields, *, gguf: bool = False) -> dict[str, int]:
    """The sizes every decoder config carries, under the config fields' names (hidden_size,
    intermediate_size, num_layers, num_heads, num_kv_heads, head_dim): `attention_dims`' checks,
    the MLP width and the layer count range-checked. From config.json keys, or GGUF metadata."""
    (ffn_key, layers_key), attention = (GGUF_STACK, GGUF_ATTENTION) if gguf else (HF_STACK, HF_ATTENTION)
    hidden, heads, kv_heads, head_dim = attention_dims(f, attention)
    return {"hidden_size": hidden, "intermediate_size": f.int(ffn_key, lo=1, hi=MAX_DIM),
            "num_layers": f.int(layers_key, lo=1, hi=MAX_LAYERS), "num_heads": heads,
            "num_kv_heads": kv_heads, "head_dim": head_dim}

# ---- counts against tensors ---------------------------------------------------------------


def check_layer_count(
    num_layers: int,
    names: Iterable[str],
    pattern: re.Pattern,
    source: str,
    field: str,
    below: int | None = None,
) -> None:
    """The config's layer count must equal the number of layers with tensors (`pattern` matches
    a tensor name with the layer index as group 1; indexes >= `below` are skipped)."""
    present = set()
    for n in names:
        m = pattern.fullmatch(n)
        if m and (below is None or int(m.group(1)) < below):
            present.add(int(m.group(1)))
    if not present:
        raise JaxspecError(
            f"{source}: no layer tensors found: the checkpoint is incomplete or not a decoder"
        )
    expect = set(range(num_layers))
    if present != expect:
        raise JaxspecError(
            f"{source}: {field}={num_layers}, but the tensors hold layers "
            f"{min(present)}..{max(present)} ({len(present)} layers): the config and the weights "
            f"disagree; fix {field} or re-download the checkpoint"
        )


# ---- safetensors headers ------------------------------------------------------------------

ITEMSIZE = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


def check_safetensors_header(header: Any, data_bytes: int, file: Path) -> dict[str, dict]:
    """The header's tensor entries, each checked; `__metadata__` must map strings to strings."""
    fix = "the file is damaged: re-download or re-convert it"
    if not isinstance(header, dict):
        raise JaxspecError(f"{file}: the safetensors header is not a JSON object: {fix}")
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise JaxspecError(f"{file}: __metadata__ must map strings to strings: {fix}")
    entries = {k: v for k, v in header.items() if k != "__metadata__"}
    spans = []
    for name, info in entries.items():
        where = f"{file}: tensor {short(name)}"
        if not isinstance(info, dict):
            raise JaxspecError(f"{where} has a header entry that is not an object: {fix}")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in ITEMSIZE:
            raise JaxspecError(
                f"{where} has dtype {short(dtype)}, which jaxspec does not read: convert it to "
                f"F32/BF16/F16 (I64/BOOL for index tensors)"
            )
        if (
            not isinstance(shape, list)
            or len(shape) > 8
            or not all(
                isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 40 for d in shape
            )
        ):
            raise JaxspecError(
                f"{where} has shape {short(shape)} (want a list of sizes >= 0): {fix}"
            )
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        ):
            raise JaxspecError(
                f"{where} has data_offsets {short(offsets)} (want [begin, end]): {fix}"
            )
        begin, end = offsets
        if not 0 <= begin <= end <= data_bytes:
            raise JaxspecError(
                f"{where} has data_offsets {offsets} outside the file's {data_bytes} data bytes: {fix}"
            )
        n = ITEMSIZE[dtype] * math.prod(shape)
        if end - begin != n:
            raise JaxspecError(
                f"{where} spans {end - begin} bytes, its dtype and shape need {n}: {fix}"
            )
        spans.append((begin, end, name))
    spans.sort()
    for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
        if b1 < e0 and e1 > b1:
            raise JaxspecError(f"{file}: tensors {short(n0)} and {short(n1)} share bytes: {fix}")
    return entries


def require_float(file, name: str, dtype: str, purpose: str = "a weight") -> None:
    """Float weights must be stored as floats: int / bool bits are never reinterpreted."""
    if dtype not in FLOAT_DTYPES:
        raise JaxspecError(
            f"{file}: tensor {name} has dtype {dtype}, but it is {purpose} and must be a float "
            f"tensor (F32/BF16/F16): the checkpoint is damaged or not this model"
        )


def check_tree_ranks(choices, draft_vocab: int, field: str = "speculative.tree.choices") -> None:
    """Every rank of a static tree must name a candidate the drafter can rank: rank < its
    (draft) vocabulary, else top-k over the vocabulary cannot produce it."""
    if not choices:
        return
    deepest = max(max(p) for p in choices)
    if deepest >= draft_vocab:
        raise JaxspecError(
            f"{field} uses rank {deepest}, but the drafter ranks only {draft_vocab} tokens (its "
            f"draft vocabulary): use ranks < {draft_vocab} (trees rarely need ranks beyond 10)"
        )
