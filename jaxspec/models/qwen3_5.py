"""Qwen3.5 (dense, text) as pure functions over a param pytree: a hybrid decoder whose layers are
Gated DeltaNet linear attention (`models/linear_attention.py`) or gated full attention, in the
order of the config's `layer_types` (three linear layers per full one in the published models).

What sets it apart from Qwen3 (each a block of `models/blocks.py` or `linear_attention.py`):
  * RMS norms scale by (1 + w) (Gemma's), except the linear layers' gated norm (w);
  * full attention: q_proj yields a query and an output gate per head ([q_h; gate_h]), the
    attention output is multiplied by sigmoid(gate); q/k RMS norms; RoPE on the first
    `partial_rotary_factor` of each head (text positions: the three M-RoPE sections coincide);
  * linear layers carry recurrent state instead of k/v (`models/hybrid_cache.py`).

Params (torch `Linear` layout `[out, in]`), per layer a dict by its type:

    full attention  {"attn_norm", "wq": [2 N H, D], "wk", "wv": [K H, D], "wo": [D, N H],
                     "q_norm", "k_norm": [H], "mlp_norm", "w_gate", "w_up", "w_down"}
    linear          {"attn_norm", "in_qkv": [C, D], "in_z": [Hv Dv, D], "in_b", "in_a": [Hv, D],
                     "conv": [C, Kc], "dt_bias", "A_log": [Hv], "norm": [Dv],
                     "out": [D, Hv Dv], "mlp_norm", "w_gate", "w_up", "w_down"}
    {"embed": [V, D], "layers": tuple, "final_norm": [D], "lm_head": [V, D] (untied)}

One layout, per-layer arrays ("unrolled"). The config, its reader and the tensor-name map are in
`models/qwen3_5_config.py`; this module holds the forward, the target and `register_family` with
the HF layout `loading/family_files.py` reads.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxspec.errors import JaxspecError
from jaxspec.models import attention, base, blocks, hybrid_cache, moe, paged_layer, registry
from jaxspec.models import qwen3_5_gguf
from jaxspec.models import linear_attention as la
from jaxspec.models.decoder import ModelConfig, linear, write_kv
from jaxspec.models.qwen3_5_config import (  # noqa: F401  (the family's names, re-exported)
    DEFAULT_RING, HF_LAYER_NAMES, HF_PREFIXES, HF_SKIPPED, LAYER_TYPES, Qwen35Config,
    check_layout, convert, hybrid_config_from_hf, qwen3_5_config_from_hf, text_config)

Params = dict[str, Any]
# ------------------------------------------------------------------------------------ params


def layer_shapes(cfg: Qwen35Config, i: int) -> dict[str, tuple[int, ...]]:
    d = cfg.hidden_size
    common = {"attn_norm": (d,), "mlp_norm": (d,)} | mlp_shapes(cfg)
    if cfg.is_linear(i):
        ld = cfg.linear_dims
        vd = ld.value_heads * ld.value_dim
        return common | {"in_qkv": (ld.channels, d), "in_z": (vd, d),
                         "in_b": (ld.value_heads, d), "in_a": (ld.value_heads, d),
                         "conv": (ld.channels, ld.conv_kernel), "dt_bias": (ld.value_heads,),
                         "A_log": (ld.value_heads,), "norm": (ld.value_dim,), "out": (d, vd)}
    nh, kh = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return common | {"wq": (2 * nh, d), "wk": (kh, d), "wv": (kh, d), "wo": (d, nh),
                     "q_norm": (cfg.head_dim,), "k_norm": (cfg.head_dim,)}


def mlp_shapes(cfg: Qwen35Config) -> dict[str, tuple[int, ...]]:
    """The MLP half of a layer: the gated MLP, or (MoE) routed experts and the shared expert."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    if not cfg.is_moe:
        return {"w_gate": (f, d), "w_up": (f, d), "w_down": (d, f)}
    return (moe.layer_shapes(cfg.num_experts, cfg.moe_intermediate_size, d)
            | moe.shared_shapes(cfg.shared_expert_intermediate_size, d))


def param_shapes(cfg: Qwen35Config) -> Params:
    shapes: Params = {"embed": (cfg.vocab_size, cfg.hidden_size), "final_norm": (cfg.hidden_size,),
                      "layers": tuple(layer_shapes(cfg, i) for i in range(cfg.num_layers))}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (cfg.vocab_size, cfg.hidden_size)
    return shapes


ATTENTION_AXES = {"wq": ("heads", "embed"), "wk": ("kv_heads", "embed"),
                  "wv": ("kv_heads", "embed"), "wo": ("embed", "heads"),
                  "q_norm": (None,), "k_norm": (None,)}
LINEAR_AXES = {"in_qkv": ("linear_channels", "embed"), "conv": ("linear_channels", None),
               "in_z": ("linear_heads", "embed"), "in_b": ("linear_heads", "embed"),
               "in_a": ("linear_heads", "embed"), "dt_bias": ("linear_heads",),
               "A_log": ("linear_heads",), "norm": (None,), "out": ("embed", "linear_heads")}
MLP_AXES = {"w_gate": ("mlp", "embed"), "w_up": ("mlp", "embed"), "w_down": ("embed", "mlp")}


def param_axes(cfg: Qwen35Config) -> Params:
    """Logical axis names of every param leaf (`sharding.py`): attention by heads, linear layers
    by value heads and q/k/v channels, the MLP by width or (MoE) whole experts over one axis."""
    mlp = MLP_AXES if not cfg.is_moe else moe.LAYER_AXES | moe.SHARED_AXES
    common = {"attn_norm": (None,), "mlp_norm": (None,)} | mlp
    layers = tuple(common | (LINEAR_AXES if cfg.is_linear(i) else ATTENTION_AXES)
                   for i in range(cfg.num_layers))
    axes: Params = {"embed": ("vocab", "embed"), "final_norm": (None,), "layers": layers}
    if not cfg.tie_word_embeddings:
        axes["lm_head"] = ("vocab", "embed")
    return axes


def init_params(cfg: Qwen35Config, key: jax.Array, scale: float = 0.02) -> Params:
    """Random params: matrices N(0, scale), norms near their neutral value, A_log in log(1..16)."""
    shapes = param_shapes(cfg)
    is_shape = lambda x: isinstance(x, tuple) and all(isinstance(i, int) for i in x)  # noqa: E731
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=is_shape)
    keys = jax.random.split(key, len(leaves))
    out = [(0.1 if len(s) == 1 else scale) * jax.random.normal(k, s)
           for s, k in zip(leaves, keys)]
    params = jax.tree.unflatten(treedef, out)
    for i, lp in enumerate(params["layers"]):
        if cfg.is_linear(i):
            lp["A_log"] = jnp.log(jnp.linspace(1.0, 16.0, lp["A_log"].shape[0]))
            lp["norm"] = 1.0 + lp["norm"]
    return jax.tree.map(lambda x: x.astype(cfg.compute_dtype), params)


# ----------------------------------------------------------------------------------- forward


def norm(x, w, cfg):
    """Qwen3.5's RMS norm: scaled by (1 + w), Gemma's (`blocks.rms_norm` offset 1)."""
    return blocks.rms_norm(x, w, cfg.rms_norm_eps, offset=1.0)


def partial_rope(x, positions, cfg):  # [B, T, N, H]: rotate the first rotary_dim dims
    rd = cfg.rotary_dim
    inv_freq = blocks.rope_inv_freq(rd, cfg.rope_theta)
    rotated = blocks.apply_rope(x[..., :rd], positions, inv_freq)
    return jnp.concatenate([rotated, x[..., rd:]], axis=-1)


def mlp(cfg, lp, x):
    """The MLP half with its residual: x [B, T, D] -> x + MLP(norm(x)); routed experts plus the
    gated shared expert on Qwen3.5-MoE (`moe.moe_block`), else the gated MLP."""
    y = norm(x, lp["mlp_norm"], cfg)
    if cfg.is_moe:
        return x + moe.moe_block(lp, y, top_k=cfg.top_k, norm_topk=True)
    return x + linear(blocks.swiglu(linear(y, lp["w_gate"]), linear(y, lp["w_up"])), lp["w_down"])


def project_attention(cfg, lp, x, positions):
    """Gated attention's projections: x [B, T, D] at positions [B, T] -> q [B, T, N, H] and
    k, v [B, T, K, H] (q/k normed and roped), the output gate [B, T, N H] (pre-sigmoid)."""
    b, t, _ = x.shape
    n, h = cfg.num_heads, cfg.head_dim
    y = norm(x, lp["attn_norm"], cfg)
    qg = linear(y, lp["wq"]).reshape(b, t, n, 2 * h)
    q, gate = qg[..., :h], qg[..., h:].reshape(b, t, n * h)
    k = linear(y, lp["wk"]).reshape(b, t, cfg.num_kv_heads, h)
    v = linear(y, lp["wv"]).reshape(b, t, cfg.num_kv_heads, h)
    q = partial_rope(norm(q, lp["q_norm"], cfg), positions, cfg)
    k = partial_rope(norm(k, lp["k_norm"], cfg), positions, cfg)
    return q, k, v, gate


def finish_attention(cfg, lp, x, attn, gate):
    """Residual x [B, T, D] + wo(attn [B, T, N H] * sigmoid(gate)), then the MLP half."""
    out = (attn.astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(x.dtype)
    return mlp(cfg, lp, x + linear(out, lp["wo"]))


def _attention_layer(cfg, lp, x, k_cache, v_cache, lengths, positions, write, window_mask):
    """Gated full attention + MLP -> (x, k_cache, v_cache) writing, else (x, window k, window v)."""
    q, k, v, gate = project_attention(cfg, lp, x, positions)
    k, v = k.astype(k_cache.dtype), v.astype(v_cache.dtype)
    if write:
        k_cache, v_cache = write_kv(k_cache, k, positions), write_kv(v_cache, v, positions)
    if isinstance(k_cache, paged_layer.PagedLayer):  # a paged pool, read through its table
        attn = paged_layer.attend(q, k_cache, v_cache, k, v, positions,
                                  scale=cfg.head_dim**-0.5, window_mask=window_mask).astype(q.dtype)
    else:
        attn = attention.attend(q, k_cache, v_cache, k, v, lengths, window_mask=window_mask)
    b, t = x.shape[:2]
    x = finish_attention(cfg, lp, x, attn.reshape(b, t, -1), gate)
    return (x, k_cache, v_cache) if write else (x, k, v)


def _linear_layer(cfg, lp, x, ssm_ring, conv_ring, lengths, positions, write, window_mask, limit,
                  snap=None):
    """Gated DeltaNet + MLP -> (x, ssm ring, conv ring) writing (states of entries below `limit`
    int32[B] into the rings), else (x, every entry's ssm state, every entry's conv state).
    snap: (ssm pool, conv pool, index) where a writing forward also keeps states
    (`hybrid_cache.StateSnapshots`); then (x, (ssm ring, ssm pool), (conv ring, conv pool))."""
    b, t, _ = x.shape
    dims = cfg.linear_dims
    mixed, z, g, beta = la.project(lp, norm(x, lp["attn_norm"], cfg), dims, linear)
    inputs = la.conv_inputs(mixed, hybrid_cache.read_state(conv_ring, lengths), positions,
                            window_mask)  # [B, T, Kc, C]
    q, k, v = la.split_heads(la.causal_conv(inputs, lp["conv"]), dims)
    state0 = hybrid_cache.read_state(ssm_ring, lengths)
    parents = la.entry_parents(positions, window_mask)
    conv_states = inputs[:, :, 1:]  # [B, T, Kc-1, C]: the inputs after each entry
    if write:
        slots = (positions + 1) % cfg.state_ring
        valid = positions < limit[:, None]
        snap_ssm, snap_conv, index = snap if snap is not None else (None, None, None)
        if snap is not None:  # [B, T]: padding kept nowhere
            index = jnp.where(valid, index, snap_conv.shape[0])
        out, ssm_ring = la.delta_rule(q, k, v, g, beta, state0, parents, keep_states=False,
                                      chain=True, ring=ssm_ring, ring_slots=slots, ring_valid=valid,
                                      snap=snap_ssm, snap_index=index)
        conv_ring = _write_in_order(conv_ring, conv_states, slots, valid)
        states = (ssm_ring, conv_ring)
        if snap is not None:  # ssm_ring is (ring, pool) here
            snap_conv = snap_conv.at[index].set(conv_states.astype(snap_conv.dtype), mode="drop")
            states = (ssm_ring, (conv_ring, snap_conv))
    else:
        out, ssm_states = la.delta_rule(q, k, v, g, beta, state0, parents, keep_states=True,
                                        chain=window_mask is None)
        states = (ssm_states, conv_states)
    out = la.gated_rms_norm(out.astype(x.dtype), z, lp["norm"], cfg.rms_norm_eps)
    x = mlp(cfg, lp, x + linear(out.reshape(b, t, -1), lp["out"]))
    return (x, *states)


def _write_in_order(ring, states, slots, valid):
    """ring [B, R, ...] <- states [B, T, ...] at slots [B, T] where valid, later entries last."""
    rows = jnp.arange(ring.shape[0])

    def body(r, inp):
        s, slot, ok = inp
        keep = ok.reshape((-1,) + (1,) * (s.ndim - 1))
        return r.at[rows, slot].set(jnp.where(keep, s.astype(r.dtype), r[rows, slot])), None

    xs = (jnp.swapaxes(states, 0, 1), jnp.swapaxes(slots, 0, 1), jnp.swapaxes(valid, 0, 1))
    return jax.lax.scan(body, ring, xs)[0]


def forward(params: Params, tokens: jax.Array, cache: hybrid_cache.HybridCache, cfg: Qwen35Config,
            *, positions=None, window_mask=None, write_cache=True, taps=(), limit=None):
    """tokens int32[B, T] at positions [B, T] -> base.TargetOutput. write_cache=False returns the
    window's (k, v, ssm states, conv states), every leaf [B, T, ...], for `commit_window`.
    limit int32[B]: entries at positions >= limit are padding (a right-padded prompt)."""
    if window_mask is not None and write_cache:
        raise ValueError("forward(window_mask=...) needs write_cache=False (write the kept "
                         "entries after)")
    b, t = tokens.shape
    positions = cache.positions(t) if positions is None else positions
    limit = jnp.full((b,), jnp.iinfo(jnp.int32).max, jnp.int32) if limit is None else limit
    x = params["embed"][tokens].astype(cfg.compute_dtype)
    collected = {0: x}
    k_new, v_new = list(cache.k), list(cache.v)
    ssm_new, conv_new = list(cache.ssm), list(cache.conv)
    snaps = cache.snapshots if write_cache else None
    snap_ssm, snap_conv = (list(snaps.ssm), list(snaps.conv)) if snaps is not None else ((), ())
    for i, lp in enumerate(params["layers"][: cfg.num_layers]):
        j = cfg.slot(i)
        if cfg.is_linear(i) and snaps is not None:  # prompt pages: states kept at page ends
            x, (ssm_new[j], snap_ssm[j]), (conv_new[j], snap_conv[j]) = _linear_layer(
                cfg, lp, x, cache.ssm[j], cache.conv[j], cache.lengths, positions, write_cache,
                window_mask, limit, snap=(snaps.ssm[j], snaps.conv[j], snaps.index))
        elif cfg.is_linear(i):
            x, ssm_new[j], conv_new[j] = _linear_layer(
                cfg, lp, x, cache.ssm[j], cache.conv[j], cache.lengths, positions, write_cache,
                window_mask, limit)
        else:
            x, k_new[j], v_new[j] = _attention_layer(
                cfg, lp, x, cache.k[j], cache.v[j], cache.lengths, positions, write_cache,
                window_mask)
        collected[i + 1] = x
    x = norm(x, params["final_norm"], cfg)
    collected[cfg.num_layers] = x
    tapped = jnp.stack([collected[i] for i in taps]) if taps else None
    new = (tuple(k_new), tuple(v_new), tuple(ssm_new), tuple(conv_new))
    if not write_cache:
        return base.TargetOutput(x, tapped, new, cache)
    k, v, ssm, conv = new
    if snaps is not None:
        snaps = dataclasses.replace(snaps, ssm=tuple(snap_ssm), conv=tuple(snap_conv))
    cache = dataclasses.replace(cache, k=k, v=v, ssm=ssm, conv=conv, snapshots=snaps)
    return base.TargetOutput(x, tapped, None, cache)


def lm_head(params: Params, hidden: jax.Array) -> jax.Array:
    w = params.get("lm_head", params["embed"]).astype(hidden.dtype)
    return linear(hidden, w).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class Qwen35Target:
    """Qwen3.5 as a `models.base.Target` (per-layer arrays). Hashable: part of the jit key."""

    cfg: Qwen35Config
    name: str = "qwen3_5"

    vocab_size = property(lambda self: self.cfg.vocab_size)
    hidden_size = property(lambda self: self.cfg.hidden_size)
    num_layers = property(lambda self: self.cfg.num_layers)
    max_position_embeddings = property(lambda self: self.cfg.max_position_embeddings)
    dtype = property(lambda self: self.cfg.dtype)

    @property
    def num_linear(self) -> int:
        return sum(self.cfg.is_linear(i) for i in range(self.cfg.num_layers))

    def init_cache(self, params: Params, batch: int, capacity: int) -> hybrid_cache.HybridCache:
        c, ld = self.cfg, self.cfg.linear_dims
        return hybrid_cache.init_cache(
            batch=batch, capacity=capacity, num_attention=c.num_layers - self.num_linear,
            num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, num_linear=self.num_linear,
            ring=c.state_ring, ssm_shape=(ld.value_heads, ld.key_dim, ld.value_dim),
            conv_shape=(ld.conv_kernel - 1, ld.channels), dtype=c.compute_dtype)

    def forward(self, params, tokens, cache, *, positions=None, window_mask=None,
                write_cache=True, taps=()) -> base.TargetOutput:
        return forward(params, tokens, cache, self.cfg, positions=positions,
                       window_mask=window_mask, write_cache=write_cache, taps=tuple(taps))

    def forward_prompt(self, params, tokens, cache, prompt_lengths, *, taps=()):
        """A write_cache forward over right-padded prompts holding prompt_lengths int32[B] tokens:
        the linear layers keep each row's states at its own length, not the padding's."""
        return forward(params, tokens, cache, self.cfg, taps=tuple(taps),
                       limit=cache.lengths + prompt_lengths)

    def logits(self, params: Params, hidden: jax.Array) -> jax.Array:
        return lm_head(params, hidden)

    def commit_window(self, cache, window_kv, path, positions):
        """The path's entries (path int32[B, P] window indices) at positions [B, P]: their k/v into
        the attention layers' slots, their states into the rings at lengths positions + 1."""
        if path.shape[1] >= self.cfg.state_ring:
            raise ValueError(f"a path of {path.shape[1]} entries needs state_ring > "
                             f"{path.shape[1]} (it is {self.cfg.state_ring})")
        k_win, v_win, ssm_win, conv_win = window_kv
        pick = lambda w: jnp.take_along_axis(  # noqa: E731  [B, T, ...] -> [B, P, ...]
            w, path.reshape(path.shape + (1,) * (w.ndim - 2)), axis=1)
        k = tuple(write_kv(c, pick(w), positions) for c, w in zip(cache.k, k_win))
        v = tuple(write_kv(c, pick(w), positions) for c, w in zip(cache.v, v_win))
        ssm = tuple(hybrid_cache.write_states(r, pick(w), positions + 1)
                    for r, w in zip(cache.ssm, ssm_win))
        conv = tuple(hybrid_cache.write_states(r, pick(w), positions + 1)
                     for r, w in zip(cache.conv, conv_win))
        return dataclasses.replace(cache, k=k, v=v, ssm=ssm, conv=conv)

    # optional traits
    def embed(self, params: Params, tokens: jax.Array) -> jax.Array:
        return params["embed"][tokens].astype(self.cfg.compute_dtype)

    def embedding_table(self, params: Params) -> jax.Array:
        return params["embed"]

    def head_table(self, params: Params) -> jax.Array:
        return params.get("lm_head", params["embed"])

    def head_weight(self, params: Params):
        return params.get("lm_head", params["embed"])

    def final_norm(self, params: Params) -> jax.Array:
        return 1.0 + params["final_norm"]

    @property
    def layer_config(self) -> ModelConfig:
        """A Llama layer of the target's attention dims (sizes a drafter's decoder layer)."""
        c = self.cfg
        return ModelConfig(
            vocab_size=c.vocab_size, hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size, num_layers=c.num_layers,
            num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
            rope_theta=c.rope_theta, rms_norm_eps=c.rms_norm_eps,
            tie_word_embeddings=c.tie_word_embeddings,
            max_position_embeddings=c.max_position_embeddings, dtype=c.dtype)

    def init_params(self, key: jax.Array, layout: str = "unrolled") -> Params:
        if layout != "unrolled":
            raise JaxspecError(f"layout {layout!r}: Qwen3.5 runs per-layer arrays (unrolled) only")
        return init_params(self.cfg, key)

    def prefix(self, num_layers: int) -> Qwen35Target:
        if not 1 <= num_layers <= self.cfg.num_layers:
            raise ValueError(f"prefix of {num_layers} layers: the target has {self.cfg.num_layers}")
        return dataclasses.replace(self, cfg=dataclasses.replace(
            self.cfg, num_layers=num_layers, layer_types=self.cfg.layer_types[:num_layers]))

    def head_counts(self) -> dict[str, int]:
        return {"heads": self.cfg.num_heads, "kv_heads": self.cfg.num_kv_heads,
                "linear_heads": self.cfg.linear_value_heads}

    def param_axes(self, params: Params) -> Params:
        return param_axes(self.cfg)

    def layout(self, params: Params) -> str:
        return "unrolled"


def _tensor_name(hf_name: str) -> str | None:
    return registry.hf_tensor_name(hf_name, HF_LAYER_NAMES, prefixes=HF_PREFIXES)


def _target_from_hf(hf: dict, *, dtype: str, source: str) -> Qwen35Target:
    return Qwen35Target(qwen3_5_config_from_hf(hf, dtype=dtype, source=source))


def _target_from_gguf(header, *, dtype: str, source: str) -> Qwen35Target:
    return Qwen35Target(qwen3_5_gguf.config_from_gguf(header, dtype=dtype, source=source))


registry.register_family(registry.Family(
    "qwen3_5", ("qwen3_5", "qwen3_5_text"), ("qwen35",), _target_from_hf, _target_from_gguf,
    hf=registry.HfLayout(
        config=qwen3_5_config_from_hf, tensor_name=_tensor_name, param_shapes=param_shapes,
        target=lambda cfg, arch: Qwen35Target(cfg), skip=HF_SKIPPED, convert=convert,
        layout=check_layout, architecture=lambda cfg: "qwen3_5"),
    gguf=registry.FileLayout(
        config=qwen3_5_gguf.config_from_gguf,
        tensor_name=lambda n: registry.gguf_tensor_name(n, qwen3_5_gguf.GGUF_LAYER_NAMES),
        param_shapes=param_shapes, target=lambda cfg, arch: Qwen35Target(cfg),
        convert=qwen3_5_gguf.convert, layout=check_layout, architecture=lambda cfg: "qwen3_5")))
