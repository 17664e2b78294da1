"""llama.cpp GGUF files: hyperparameters from metadata, tensors dequantized with `gguf.quants`.

The file is read by `gguf_header.GGUFHeader` (one pass with `struct`), not `gguf.GGUFReader`,
which builds a numpy view per element of every array field: 7.4 of SmolLM2's 9.8 s load went to
its 49k-token vocabulary and merges.

Shape order: GGUF lists dims fastest-first (`ne = [in, out]`); the header's tensor shapes, and what
they dequantize to, are the reverse (`[out, in]`), which is already our torch-`Linear` layout.

llama.cpp's converter permutes the q/k projection rows of `llama`-arch models so that each head's
rotary pairs sit interleaved (its rope kernel rotates adjacent pairs), where HF rotates the two
halves of the head (`rotate_half`). `unpermute_qk` undoes that; `qwen2`/`qwen3` files use the
half-split ("NEOX") rope in llama.cpp and are stored unpermuted.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q

from jaxspec.errors import JaxspecError
from jaxspec import validate
from jaxspec.loading.gguf_header import GGUFHeader
from jaxspec.models.decoder import ModelConfig

ARCHITECTURES = ("llama", "qwen2", "qwen3")
SUPPORTED_TYPES = frozenset(
    {Q.F32, Q.F16, Q.BF16, Q.F64, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1}
    | {Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K}
)

GLOBAL_NAMES = {
    "token_embd.weight": "embed",
    "output_norm.weight": "final_norm",
    "output.weight": "lm_head",
}
LAYER_NAMES = {
    "attn_norm.weight": "attn_norm",
    "attn_q.weight": "wq",
    "attn_k.weight": "wk",
    "attn_v.weight": "wv",
    "attn_output.weight": "wo",
    "attn_q.bias": "bq",
    "attn_k.bias": "bk",
    "attn_v.bias": "bv",
    "attn_q_norm.weight": "q_norm",
    "attn_k_norm.weight": "k_norm",
    "ffn_norm.weight": "mlp_norm",
    "ffn_gate.weight": "w_gate",
    "ffn_up.weight": "w_up",
    "ffn_down.weight": "w_down",
}
_MISSING = object()
_BLOCK_RE = re.compile(r"blk\.(\d+)\..+")


def open_gguf(path: Path) -> GGUFHeader:
    """The file's metadata (`fields`, each with `contents()`) and tensors; a damaged file is one
    JaxspecError line."""
    validate.regular_file(path, "GGUF file", max_bytes=None)
    return GGUFHeader(path)


def metadata(reader: GGUFHeader, key: str, default=_MISSING):
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise JaxspecError(
                f"GGUF metadata lacks {key}: the file is incomplete or not a decoder model"
            )
        return default
    try:
        return field.contents()
    except Exception as e:  # noqa: BLE001 -- a damaged field
        raise JaxspecError(f"GGUF metadata {key} is damaged ({type(e).__name__}): re-download the file") from None


def architecture(reader: GGUFHeader, source: str) -> str:
    arch = metadata(reader, "general.architecture")
    if not isinstance(arch, str) or arch not in ARCHITECTURES:
        raise JaxspecError(
            f"{source}: GGUF architecture {validate.short(arch)} is not supported: use one of {', '.join(ARCHITECTURES)}"
        )
    return arch


def config_from_gguf(reader: GGUFHeader, *, dtype: str, source: str) -> ModelConfig:
    arch = architecture(reader, source)

    def get(key, default=_MISSING):
        value = metadata(reader, f"{arch}.{key}", default)
        if isinstance(value, list):
            raise JaxspecError(f"{source}: per-layer {arch}.{key} is not supported")
        return value

    scaling = get("rope.scaling.type", "none")
    names = {t.name for t in reader.tensors}
    if scaling not in ("none", None) or "rope_freqs.weight" in names:
        raise JaxspecError(
            f"{source}: GGUF rope scaling ({scaling if scaling != 'none' else 'rope_freqs'}) is not "
            f"supported: load the HF safetensors checkpoint instead"
        )
    f = validate.Fields(lambda key: get(key, validate.MISSING), source, f"{arch}.")
    dims = validate.decoder_dims(f, gguf=True)
    head_dim = dims["head_dim"]
    rot = f.int("rope.dimension_count", head_dim, lo=0)
    if rot != head_dim:
        raise JaxspecError(
            f"{source}: partial rotary (rope dims {rot} of {head_dim}) is not supported"
        )
    validate.check_layer_count(
        dims["num_layers"], names, _BLOCK_RE, source, f"{arch}.block_count"
    )  # before a param tree of that many layers is built
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise JaxspecError(f"{source} has no token_embd.weight: the file is incomplete")
    return ModelConfig(
        vocab_size=int(embed.shape[0]),  # [V, D] (ne = [D, V])
        **dims,
        rope_theta=f.float("rope.freq_base", 10000.0, lo=0.0, lo_open=True),
        rms_norm_eps=f.float("attention.layer_norm_rms_epsilon", 1e-5, lo=0.0, hi=1.0, lo_open=True),
        tie_word_embeddings="output.weight" not in names,
        attention_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
        max_position_embeddings=f.int("context_length", 2048, lo=1, hi=(1 << 31) - 1),
        dtype=dtype,
    )


def load_gguf_tensors(
    reader: GGUFHeader, cfg: ModelConfig, *, source: str, lazy: bool = False
) -> dict[str, np.ndarray]:
    """Every tensor dequantized, under our flat names, q/k rows un-permuted, cast to cfg.dtype
    one tensor at a time (a big model never sits in host memory as float32 all at once).
    `lazy`: `LazyTensor`s instead, each dequantized only when read (loading onto a mesh)."""
    arch = architecture(reader, source)
    out_dtype = np.dtype(cfg.compute_dtype)
    flat: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        ours = _our_name(t.name)
        if ours is None:
            raise JaxspecError(
                f"{source}: unexpected tensor {t.name}: this model variant is not supported"
            )
        if t.tensor_type not in SUPPORTED_TYPES:
            raise JaxspecError(
                f"{source}: tensor {t.name} is {t.tensor_type.name}, which jaxspec cannot dequantize: "
                f"use a GGUF quantized as {', '.join(sorted(q.name for q in SUPPORTED_TYPES))}"
            )
        read = lambda t=t, ours=ours: _read(t, ours, arch, cfg, out_dtype)
        flat[ours] = LazyTensor(t.shape, read) if lazy else read()
    return flat


def _read(t, ours: str, arch: str, cfg: ModelConfig, out_dtype) -> np.ndarray:
    w = t.dequantize()  # [out, in]
    if arch == "llama" and ours.endswith((".wq", ".bq")):
        w = unpermute_qk(w, cfg.num_heads)
    elif arch == "llama" and ours.endswith((".wk", ".bk")):
        w = unpermute_qk(w, cfg.num_kv_heads)
    return w.astype(out_dtype, copy=False)


class LazyTensor:
    """A tensor whose shape is known up front and whose data is produced by `read()` on first
    index, then kept until `release()` (the mesh loader holds one tensor in flight)."""

    lazy = True  # loading.params: checked for NaN / inf slice by slice, as the mesh loader reads

    def __init__(self, shape: tuple[int, ...], read):
        self.shape, self._read, self._data = tuple(shape), read, None
        self.ndim = len(self.shape)

    def __getitem__(self, idx) -> np.ndarray:
        if self._data is None:
            self._data = self._read()
        return self._data[idx]

    def release(self) -> None:
        self._data = None


def _our_name(name: str) -> str | None:
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_NAMES:
        return f"layers.{parts[1]}.{LAYER_NAMES[parts[2]]}"
    return None


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF -> llama.cpp: per head, rows [first half | second half] -> interleaved pairs."""
    h = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, h // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp -> HF: per head, row 2i+j (pair i, member j) goes back to row j*h/2 + i."""
    h = w.shape[0] // n_heads
    return w.reshape(n_heads, h // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
