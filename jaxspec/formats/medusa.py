"""Medusa heads in the two published layouts:

  medusa_fd  FasterDecoding: config.json with `medusa_num_heads`, `medusa_num_layers`; tensors
             `{i}.{j}.linear.weight/bias` (block j of head i) and `{i}.{J}.weight` (head i's
             full-vocabulary projection), in `medusa_lm_head.safetensors` or `medusa_lm_head.pt`
             (read with torch.load(weights_only=True)); optional `medusa_head.` prefix.
  medusa     vLLM: config.json with `model_type: medusa`, `num_heads`, `num_hidden_layers`,
             optional `truncated_vocab_size`, `medusa_fc_bias`, `original_lm_head`; tensors
             `blocks.{i}.layers.{j}.weight` (+ `.bias`), `lm_heads.{i}.weight`, optional
             `token_map` (the draft vocabulary: target ids of the head rows).

Exactness: vLLM's layout expresses every jaxspec Medusa head (token_map = d2t); FasterDecoding's
has no draft vocabulary, so only full-vocabulary heads can be written to it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jaxspec.drafters.draft_vocab import check_d2t
from jaxspec.drafters.medusa_blocks import MedusaBlocksDrafter
from jaxspec import validate
from jaxspec.errors import JaxspecError
from jaxspec.formats import tensors as T

LAYOUTS = ("medusa", "medusa_fd")


@dataclasses.dataclass(frozen=True)
class MedusaHead:
    num_heads: int  # K
    num_layers: int  # J blocks per head
    bias: bool  # blocks have biases
    params: dict  # w [K, J, D, D], b [K, J, D], heads [Kh, N, D], d2t int32[N]
    vocab: int  # target vocabulary V


def detect(config: dict) -> str | None:
    if "medusa_num_heads" in config and config.get("model_type") != "medusa":
        return "medusa_fd"
    if config.get("model_type") == "medusa" or "MedusaModel" in (config.get("architectures") or []):
        return "medusa"
    return None


MAX_HEADS = 256  # heads and layers per head a config may name (checked before names are built)


def _int(config, where, *keys, default=None, hi=None):
    f = validate.Fields(config, f"{where}/config.json")
    for k in keys:
        if f.given(k):
            return f.int(k, lo=1, hi=hi)
    if default is not None:
        return default
    raise JaxspecError(f"{where}: config.json lacks {keys[0]}: not a complete Medusa config")


def read(path, layout: str) -> MedusaHead:
    path = Path(path)
    where = str(path)
    config = T.read_config(path)
    raw = T.read_tensors(path)
    if layout == "medusa_fd":
        raw = {k.removeprefix("medusa_head."): a for k, a in raw.items()}
        kh = _int(config, where, "medusa_num_heads", hi=MAX_HEADS)
        j = _int(config, where, "medusa_num_layers", default=1, hi=MAX_HEADS)
        names = lambda i, l: (f"{i}.{l}.linear.weight", f"{i}.{l}.linear.bias")
        head_name = lambda i: f"{i}.{j}.weight"
        bias, shared, token_map = True, False, None
        required = {n for i in range(kh) for l in range(j) for n in names(i, l)}
        required |= {head_name(i) for i in range(kh)}
        optional = set()
    else:
        raw = {k.removeprefix("medusa_heads."): a for k, a in raw.items()}
        kh = _int(config, where, "num_heads", "medusa_num_heads", hi=MAX_HEADS)
        j = _int(config, where, "num_hidden_layers", "medusa_num_layers", default=1, hi=MAX_HEADS)
        f = validate.Fields(config, f"{where}/config.json")
        bias = f.bool("medusa_fc_bias", False)
        shared = f.bool("original_lm_head", False)
        names = lambda i, l: (
            (f"blocks.{i}.layers.{l}.weight",) + ((f"blocks.{i}.layers.{l}.bias",) if bias else ())
        )
        head_name = lambda i: f"lm_heads.{i}.weight"
        required = {n for i in range(kh) for l in range(j) for n in names(i, l)}
        required |= {head_name(0)} if shared else {head_name(i) for i in range(kh)}
        # original_lm_head: vLLM reads lm_heads.0 only; copies of the others are tolerated
        optional = {"token_map"} | ({head_name(i) for i in range(1, kh)} if shared else set())
        token_map = raw.get("token_map")
    T.check_names(where, raw, required, optional)
    if kh < 1 or j < 1:
        raise JaxspecError(f"{where}: a Medusa checkpoint needs >= 1 head and >= 1 layer per head")
    d = raw[names(0, 0)[0]].shape[-1]
    rows = raw[head_name(0)].shape[0]
    vocab = _int(config, where, "vocab_size", default=rows, hi=validate.MAX_DIM)
    n = (
        len(token_map)
        if token_map is not None
        else _int(config, where, "truncated_vocab_size", default=rows, hi=validate.MAX_DIM)
    )
    for i in range(kh):
        for l in range(j):
            T.check_tensor(where, names(i, l)[0], raw[names(i, l)[0]], (d, d))
            if bias:
                T.check_tensor(where, names(i, l)[1], raw[names(i, l)[1]], (d,))
        if not shared or i == 0:
            T.check_tensor(where, head_name(i), raw[head_name(i)], (rows, d))
    if token_map is not None:
        T.check_tensor(where, "token_map", token_map, (n,), "int")
        check_d2t(token_map.astype(np.int64), vocab, f"{where}: token_map")
        if rows not in (n, vocab):
            raise JaxspecError(
                f"{where}: lm_heads have {rows} rows, expected {n} (token_map) or {vocab}"
            )
        d2t = token_map.astype(np.int32)
    else:
        if rows != vocab:
            raise JaxspecError(
                f"{where}: lm_heads have {rows} rows but vocab_size is {vocab} and there is no "
                f"token_map: add the token_map the heads were truncated with"
            )
        d2t = np.arange(vocab, dtype=np.int32)
    heads = [np.asarray(raw[head_name(i)], np.float32) for i in range(1 if shared else kh)]
    if rows != len(d2t):  # full-vocabulary rows with a token_map: keep the draft rows
        heads = [h[d2t] for h in heads]
    w = np.stack(
        [[np.asarray(raw[names(i, l)[0]], np.float32) for l in range(j)] for i in range(kh)]
    )
    b = (
        np.stack(
            [[np.asarray(raw[names(i, l)[1]], np.float32) for l in range(j)] for i in range(kh)]
        )
        if bias
        else np.zeros((kh, j, d), np.float32)
    )
    return MedusaHead(kh, j, bias, {"w": w, "b": b, "heads": np.stack(heads), "d2t": d2t}, vocab)


def to_drafter(
    head: MedusaHead, target_cfg, where="Medusa head"
) -> tuple[MedusaBlocksDrafter, dict]:
    d = head.params["w"].shape[-1]
    if d != target_cfg.hidden_size:
        raise JaxspecError(
            f"{where}: the Medusa heads have hidden size {d}, the target {target_cfg.hidden_size}: "
            f"use heads trained for this model"
        )
    if head.vocab != target_cfg.vocab_size:
        raise JaxspecError(
            f"{where}: the Medusa heads are for a vocabulary of {head.vocab} tokens, the target "
            f"has {target_cfg.vocab_size}: use heads trained for this model's tokenizer"
        )
    drafter = MedusaBlocksDrafter(
        num_heads=head.num_heads,
        target_vocab=target_cfg.vocab_size,
        final_layer=target_cfg.num_layers,
    )
    dparams = {
        k: jnp.asarray(a, jnp.int32 if k == "d2t" else jnp.float32) for k, a in head.params.items()
    }
    return drafter, dparams


def from_jaxspec(dparams, vocab: int) -> MedusaHead:
    """jaxspec's own Medusa runtime params ({"w" [K,D,D], "b" [K,D], "head" [N,D], "d2t"}):
    one block per head, every head sharing the target's LM-head rows (exact)."""
    w = np.asarray(dparams["w"], np.float32)[:, None]
    b = np.asarray(dparams["b"], np.float32)[:, None]
    params = {
        "w": w,
        "b": b,
        "heads": np.asarray(dparams["head"], np.float32)[None],
        "d2t": np.asarray(dparams["d2t"], np.int32),
    }
    return MedusaHead(w.shape[0], 1, True, params, vocab)


def write(head: MedusaHead, out, layout: str, base_model: str | None = None) -> Path:
    """Write `head` as safetensors + config.json in `layout`; `base_model` is recorded as
    FasterDecoding's `base_model_name_or_path`."""
    out = Path(out)
    p = head.params
    k, j, d = head.num_heads, head.num_layers, p["w"].shape[-1]
    n = len(p["d2t"])
    shared = p["heads"].shape[0] == 1
    tensors = {}
    if layout == "medusa_fd":
        if n != head.vocab or not np.array_equal(p["d2t"], np.arange(n)):
            raise JaxspecError(
                f"these Medusa heads use a draft vocabulary of {n} of the {head.vocab} target "
                f"tokens, which FasterDecoding's layout cannot express: export with --format medusa "
                f"(vLLM's layout, token_map)"
            )
        for i in range(k):
            for l in range(j):
                tensors[f"{i}.{l}.linear.weight"] = p["w"][i, l]
                tensors[f"{i}.{l}.linear.bias"] = p["b"][i, l]
            tensors[f"{i}.{j}.weight"] = p["heads"][0 if shared else i]
        config = {
            "medusa_num_heads": k,
            "medusa_num_layers": j,
            "hidden_size": d,
            "vocab_size": head.vocab,
        }
        if base_model:
            config["base_model_name_or_path"] = base_model
    else:
        for i in range(k):
            for l in range(j):
                tensors[f"blocks.{i}.layers.{l}.weight"] = p["w"][i, l]
                if head.bias:
                    tensors[f"blocks.{i}.layers.{l}.bias"] = p["b"][i, l]
        for i in range(1 if shared else k):
            tensors[f"lm_heads.{i}.weight"] = p["heads"][i]
        config = {
            "model_type": "medusa",
            "architectures": ["MedusaModel"],
            "hidden_size": d,
            "vocab_size": head.vocab,
            "num_heads": k,
            "num_hidden_layers": j,
            "truncated_vocab_size": n,
            "medusa_fc_bias": head.bias,
            "original_lm_head": shared,
        }
        if n != head.vocab or not np.array_equal(p["d2t"], np.arange(n)):
            tensors["token_map"] = p["d2t"].astype(np.int64)
    T.write_safetensors(out, {kk: np.asarray(v) for kk, v in tensors.items()})
    T.write_config(out, config)
    return out
