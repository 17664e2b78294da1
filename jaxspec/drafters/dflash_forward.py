"""The DFlash draft network (block diffusion drafting, z-lab `dflash`), as pure functions over a
params pytree: one forward over a block of γ+1 entries gives γ next-token distributions at once.

Row b at committed length L (tokens 0..L-1; token L-1 was sampled but not yet run through the
target, so target features exist for positions 0..L-2):

  context   c_j = hidden_norm(fc(concat_i h_i[j]))  for j < L-1, h_i = the target's hidden state
            after layer target_layer_ids[i] (HF hidden_states[id + 1]). Every draft layer reads
            the context only through its own k/v projections of c_j (k-normed, roped at j): the
            state caches them per layer; no layer runs over the context otherwise.
  block     entries at positions L-1 .. L-1+γ: token L-1, then γ copies of mask_token_id, all
            embedded with the target's raw embedding table times input_embedding_scale.
  layers    Qwen3 decoder layers (q/k RMS norms over head_dim); a block query attends the
            context slots and the block entries under its layer's mask (below); DFlash 2 wraps
            attention and MLP in grouped dynamic causal convolutions over the block entries.
  logits    final norm, the target's LM-head rows, times output_multiplier, then
            tanh soft-cap by final_logit_softcapping; entry i >= 1 predicts token L-1+i.

Block attention per layer (absolute positions: context key j, block key L-1+j, query L-1+i):
  is_causal (default: the layer is a sliding one)  keys at positions <= the query's only;
  sliding window w (sliding layers)                 query - key < w, and when not causal also
                                                    key - query < w.
  The default DFlash layer is neither: every block entry sees the whole block.

Params `dparams` (torch `[out, in]` layout; D = the target's hidden size):
  fc [D, n*D], hidden_norm [D], norm [D]
  layers  tuple of {attn_norm, wq, wk, wv, wo, q_norm [Hd], k_norm [Hd], mlp_norm, w_gate, w_up,
          w_down}; DFlash 2 adds attn_conv and mlp_conv: {base [2, Kc, D], proj [2*Kc*Gc, D]}
  selector (DFlash 2)  {pred [V, R], succ [V, R], proj [R, D]}
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec import kernels
from jaxspec.models import blocks, decoder, llama


@dataclasses.dataclass(frozen=True)
class DFlashSpec:
    """A DFlash network's static settings (hashable: part of the drafter's jit key)."""

    layer: llama.ModelConfig  # dims of every draft layer: hidden, heads, head_dim, rope, eps, mlp
    num_layers: int
    target_layer_ids: tuple[int, ...]  # the reference's ids: output of target layer i
    block_size: int  # entries per block: the last committed token + block_size - 1 masks
    mask_token_id: int
    causal: tuple[bool, ...]  # per draft layer
    windows: tuple[int | None, ...]  # per draft layer: sliding window, None = full
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    # DFlash 2 (None: DFlash 1)
    conv_kernel_size: int | None = None
    conv_group_size: int | None = None
    selector_top_k: int | None = None
    selector_rank: int | None = None

    @property
    def version(self) -> int:
        return 1 if self.conv_kernel_size is None else 2


def _rms(x, w, eps):
    return llama.rms_norm(x, w, eps)


def context_features(spec: DFlashSpec, dparams, feats) -> jax.Array:
    """Target features [n, B, T, D] (one per target_layer_id) -> context entries c [B, T, D]."""
    x = jnp.concatenate(list(feats), axis=-1).astype(spec.layer.compute_dtype)
    return _rms(decoder.linear(x, dparams["fc"]), dparams["hidden_norm"], spec.layer.rms_norm_eps)


def _heads(spec, lp, y, positions, inv_freq, which):
    """y [B, T, D] -> normed, roped q [B, T, N, Hd] or k [B, T, K, Hd] at positions [B, T]."""
    c = spec.layer
    n = c.num_heads if which == "q" else c.num_kv_heads
    x = decoder.linear(y, lp["w" + which]).reshape(*y.shape[:-1], n, c.head_dim)
    x = _rms(x, lp[which + "_norm"], c.rms_norm_eps)
    return blocks.apply_rope(x, positions, inv_freq)


def context_kv(spec: DFlashSpec, lp, c, positions):
    """One layer's keys and values of context entries c [B, T, D] at positions [B, T]:
    k [B, T, K, Hd] (k-normed, roped), v [B, T, K, Hd]."""
    k = _heads(spec, lp, c, positions, llama.rope_frequencies(spec.layer), "k")
    v = decoder.linear(c, lp["wv"]).reshape(*c.shape[:-1], spec.layer.num_kv_heads, -1)
    return k, v


def attend(q, blk_k, blk_v, ctx_k, ctx_v, q_pos, ctx_len, causal: bool, window: int | None):
    """q [B, G, N, Hd] at absolute positions q_pos [B, G] attends the context cache ctx_k/v
    [B, K, S, Hd] (slot = position, valid below ctx_len int32[B]) and the block's own entries
    blk_k/v [B, G, K, Hd] (at q_pos) under the layer's mask -> [B, G, N*Hd]; one softmax, f32."""
    b, g, n, hd = q.shape
    kv, s = ctx_k.shape[1], ctx_k.shape[2]
    r = n // kv
    qg = q.reshape(b, g, kv, r, hd)
    f32 = jnp.float32
    # The context cache is contracted with dot_general in XLA's canonical batch order ([B, K]
    # first, as models/blocks.py does): an einsum let XLA copy the whole cache transposed at
    # batch 1 (tests/test_accelerator_path.py counts those copies).
    batch = ((0, 1), (0, 1))
    qk = qg.transpose(0, 2, 3, 1, 4).reshape(b, kv, r * g, hd)  # rows ordered (r, g)
    s_ctx = jax.lax.dot_general(qk, ctx_k.astype(qk.dtype), (((3,), (3,)), batch),
                                preferred_element_type=f32).reshape(b, kv, r, g, s)
    s_blk = jnp.einsum("bgkrh,bjkh->bkrgj", qg, blk_k, preferred_element_type=f32)
    qp = q_pos[:, :, None]  # [B, G, 1]
    ctx_pos = jnp.arange(s, dtype=jnp.int32)[None, None, :]
    ok_ctx = ctx_pos < ctx_len[:, None, None]  # [B, 1, S]; every context key precedes the block
    kp = q_pos[:, None, :]  # [B, 1, G]
    ok_blk = jnp.ones((b, g, g), bool)
    if causal:
        ok_blk &= kp <= qp
    if window is not None:
        ok_ctx = ok_ctx & (qp - ctx_pos < window)
        ok_blk &= qp - kp < window
        if not causal:
            ok_blk &= kp - qp < window
    neg = jnp.finfo(f32).min
    s_ctx = jnp.where(ok_ctx[:, None, None], s_ctx, neg)
    s_blk = jnp.where(ok_blk[:, None, None], s_blk, neg)
    w = jax.nn.softmax(jnp.concatenate([s_ctx, s_blk], axis=-1) * hd**-0.5, axis=-1)
    w_ctx, w_blk = w[..., :s].astype(ctx_v.dtype), w[..., s:].astype(blk_v.dtype)
    o_ctx = jax.lax.dot_general(w_ctx.reshape(b, kv, r * g, s), ctx_v, (((3,), (2,)), batch))
    o_ctx = o_ctx.reshape(b, kv, r, g, hd).transpose(0, 3, 1, 2, 4)  # [B, G, K, R, Hd]
    out = o_ctx + jnp.einsum("bkrgj,bjkh->bgkrh", w_blk, blk_v)
    return out.reshape(b, g, n * hd)


def grouped_conv(x, dynamic, base, group_size: int):
    """DFlash 2's grouped dynamic causal convolution over the block axis: x [B, G, D], per-entry
    kernels dynamic [B, G, Kc, Gc] (one weight per group), static base [Kc, D] ->
    y[t] = sum_o (base[o] + dynamic[t, o, group]) * x[t - o] (x before the block: 0)."""
    g = x.shape[1]
    out = jnp.zeros_like(x)
    for o in range(base.shape[0]):
        shifted = jnp.pad(x, [(0, 0), (o, 0), (0, 0)])[:, :g]
        dyn = jnp.repeat(dynamic[:, :, o, :], group_size, axis=-1)  # [B, G, D]
        out = out + (base[o].astype(x.dtype) + dyn) * shifted
    return out


def _conv_prepare(spec, cp, y):
    """The first convolution and the kernels of the second, both from y [B, G, D]."""
    kc = spec.conv_kernel_size
    dyn = decoder.linear(y, cp["proj"]).reshape(*y.shape[:-1], 2, kc, -1)  # [B, G, 2, Kc, Gc]
    return grouped_conv(y, dyn[:, :, 0], cp["base"][0], spec.conv_group_size), dyn[:, :, 1]


def _conv_finish(spec, cp, y, dyn):
    return grouped_conv(y, dyn, cp["base"][1], spec.conv_group_size)


def block_hidden(spec: DFlashSpec, dparams, x, positions, contexts, ctx_len, *, causal=None):
    """The draft layers over the block: x [B, G, D] at positions [B, G]; contexts: per layer
    (k, v) [B, K, S, Hd]; ctx_len int32[B] -> final-normed h [B, G, D]. `causal` overrides every
    layer's block mask (tests: a causal variant of a bidirectional head)."""
    c = spec.layer
    eps = c.rms_norm_eps
    inv_freq = llama.rope_frequencies(c)
    for i, (lp, (ck, cv)) in enumerate(zip(dparams["layers"], contexts)):
        y = _rms(x, lp["attn_norm"], eps)
        if spec.version == 2:
            y, dyn = _conv_prepare(spec, lp["attn_conv"], y)
        q = _heads(spec, lp, y, positions, inv_freq, "q")
        k, v = context_kv(spec, lp, y, positions)
        layer_causal = spec.causal[i] if causal is None else causal
        a = attend(q, k, v, ck, cv, positions, ctx_len, layer_causal, spec.windows[i])
        a = decoder.linear(a.astype(x.dtype), lp["wo"])
        if spec.version == 2:
            a = _conv_finish(spec, lp["attn_conv"], a, dyn)
        x = x + a
        y = _rms(x, lp["mlp_norm"], eps)
        if spec.version == 2:
            y, dyn = _conv_prepare(spec, lp["mlp_conv"], y)
        y = decoder.linear(jax.nn.silu(decoder.linear(y, lp["w_gate"])) * decoder.linear(y, lp["w_up"]),
                         lp["w_down"])
        if spec.version == 2:
            y = _conv_finish(spec, lp["mlp_conv"], y, dyn)
        x = x + y
    return _rms(x, dparams["norm"], eps)


def logits(spec: DFlashSpec, head, h) -> jax.Array:
    """h [..., D] through the target's LM-head rows head [V, D] (or the CPU kernels'
    PackedWeight of them) -> f32[..., V], scaled and soft-capped as the checkpoint says."""
    if not isinstance(head, kernels.PackedWeight):
        head = head.astype(h.dtype)
    out = decoder.linear(h, head).astype(jnp.float32) * spec.output_multiplier
    cap = spec.final_logit_softcapping
    return out if not cap else jnp.tanh(out / cap) * cap


def selector_scores(dparams, hp, unary, candidates, predecessor):
    """DFlash 2's candidate score at one block position: unary [B, Kc] (the candidates' logits)
    + <pred[predecessor] * hp, succ[candidate]> over the rank R; hp [B, R] the position's
    projected hidden, candidates int32[B, Kc], predecessor int32[B] -> f32[B, Kc]."""
    sel = dparams["selector"]
    a = sel["pred"][predecessor].astype(jnp.float32) * hp.astype(jnp.float32)  # [B, R]
    succ = sel["succ"][candidates].astype(jnp.float32)  # [B, Kc, R]
    return unary + jnp.einsum("br,bkr->bk", a, succ)


LINEAR_KEYS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")  # per layer, read by linear


def pack_for_cpu(dparams):
    """Every weight the network reads only through `decoder.linear` (fc, the layers' projections
    and MLP, DFlash 2's convolution and selector projections) as CPU-kernel panels
    (`kernels.PackedWeight`): the block forward and the commit are multi-row matmuls (γ + 1 rows),
    where XLA:CPU's matmul first copies each weight; the panel kernel streams it once."""
    def layer(lp):
        out = {k: kernels.pack(w) if k in LINEAR_KEYS else w for k, w in lp.items()}
        for name in ("attn_conv", "mlp_conv"):
            if name in lp:
                out[name] = {**lp[name], "proj": kernels.pack(lp[name]["proj"])}
        return out

    out = {**dparams, "fc": kernels.pack(dparams["fc"]),
           "layers": tuple(layer(lp) for lp in dparams["layers"])}
    if "selector" in dparams:
        out["selector"] = {**dparams["selector"], "proj": kernels.pack(dparams["selector"]["proj"])}
    return out


def make_spec(target_cfg: llama.ModelConfig, num_target_layers: int, *, num_layers: int = 1,
              block_size: int = 16, mask_token_id: int, target_layer_ids=None,
              intermediate_size: int | None = None, **extra) -> DFlashSpec:
    """A bidirectional DFlash spec sized from a target's layer shape (a new head: training,
    tests); target_layer_ids default to the reference's spread. `extra`: DFlashSpec fields."""
    if target_layer_ids is None:
        if num_layers == 1:
            target_layer_ids = (num_target_layers // 2,)
        else:
            span = num_target_layers - 4
            target_layer_ids = tuple(round(1 + i * span / (num_layers - 1))
                                     for i in range(num_layers))
    layer = dataclasses.replace(
        target_cfg, num_layers=num_layers, qk_norm=True, attention_bias=False,
        sliding_window=None, sliding_layers=None,
        intermediate_size=intermediate_size or target_cfg.intermediate_size,
    )
    return DFlashSpec(layer=layer, num_layers=num_layers,
                      target_layer_ids=tuple(target_layer_ids), block_size=block_size,
                      mask_token_id=mask_token_id, causal=(False,) * num_layers,
                      windows=(None,) * num_layers, **extra)


def init_params(spec: DFlashSpec, key, scale: float = 1.0):
    """Random params: weights N(0, scale^2 / fan_in), norms near 1."""
    c = spec.layer
    d, hd, f = c.hidden_size, c.head_dim, c.intermediate_size
    keys = iter(jax.random.split(key, 64 * (spec.num_layers + 1)))

    def w(*shape):
        return scale * jax.random.normal(next(keys), shape) / shape[-1] ** 0.5

    def norm(n):
        return 1.0 + 0.1 * jax.random.normal(next(keys), (n,))

    layers = []
    for _ in range(spec.num_layers):
        lp = {"attn_norm": norm(d), "wq": w(c.num_heads * hd, d), "wk": w(c.num_kv_heads * hd, d),
              "wv": w(c.num_kv_heads * hd, d), "wo": w(d, c.num_heads * hd), "q_norm": norm(hd),
              "k_norm": norm(hd), "mlp_norm": norm(d), "w_gate": w(f, d), "w_up": w(f, d),
              "w_down": w(d, f)}
        if spec.version == 2:
            kc, gc = spec.conv_kernel_size, d // spec.conv_group_size
            for name in ("attn_conv", "mlp_conv"):
                lp[name] = {"base": 0.3 * jax.random.normal(next(keys), (2, kc, d)),
                            "proj": w(2 * kc * gc, d)}
        layers.append(lp)
    n = len(spec.target_layer_ids)
    out = {"fc": w(d, n * d), "hidden_norm": norm(d), "norm": norm(d), "layers": tuple(layers)}
    if spec.version == 2:
        r = spec.selector_rank
        out["selector"] = {"pred": w(c.vocab_size, r), "succ": w(c.vocab_size, r), "proj": w(r, d)}
    return out
