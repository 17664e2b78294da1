"""What each trained drafter learns, from the distillation records (see `jaxspec.train.data`).

A method knows its trainable params, its frozen pieces taken from the target, its loss, and how to
turn params into a runtime drafter:

  eagle3  the published EAGLE-3 architecture (drafters/eagle3.py: fc, midlayer over
          [input_layernorm(embed), hidden_norm(g)], norm, head rows over the draft vocabulary):
          exportable exactly to the eagle3 / speculators layouts (jaxspec.export); same TTT.
  eagle   fuse + in_proj + one decoder layer + norm; EAGLE-3 training-time test (TTT): step 0 runs
          on the target's features, step s > 0 on the drafter's own outputs of step s-1, with the
          attention pattern drafting sees (real entries up to j-s, then its own provisional ones).
  medusa  K residual heads on the final-normed hidden h_t; head k learns the target's
          distribution for token t+k+1 (recorded at position t+k).
  draft   a few target layers (initialised from it) + final norm, tied to the target's embedding;
          learns the target's next-token distribution at every position.

Each head is named by its drafter's registration (`register_drafter(..., train="module:Class")`
in `jaxspec/drafters/<method>.py`): training (`train.make_method`) and loading an exported
checkpoint (`train.load`, `from_arch` of its meta.json "arch") look it up by name, so a new trained
method is a class here (or in its own module) and its drafter's one registration.

All losses are soft cross-entropies against the target's top-K next-token probabilities over the
draft vocabulary (the N most frequent target tokens; `d2t` maps back to the target's ids).

The target is read through the target protocol only (models/base.py): `target_cfg` arguments
take the target object (`LoadedModel.target`; a Llama ModelConfig still works), `init` takes a
model with `.target` and `.params` and reads its `embedding_table`, `head_table`, `layer_config`
and, where present, `layer_weights` / `final_norm` (else the head's layer starts at random).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.models.cache import init_cache
from jaxspec.train.registry import METHODS, from_arch  # noqa: F401 -- the trained heads, by name
from jaxspec.drafters import eagle_head as eagle_lib
from jaxspec.drafters import eagle3 as eagle3_lib
from jaxspec.drafters import feature_chain
from jaxspec.drafters import medusa as medusa_lib
from jaxspec.drafters.draft_model import ModelDrafter
from jaxspec.models import base, decoder, llama


def build_vocab(tokens, lengths, topk_ids, size: int, vocab: int) -> np.ndarray:
    """d2t int32[size]: target ids by frequency in the data (tokens and the target's top-1),
    ties and never-seen ids filled by lowest id first (BPE puts common pieces first)."""
    valid = np.arange(tokens.shape[1])[None] < lengths[:, None]
    counts = np.bincount(tokens[valid], minlength=vocab) + np.bincount(
        topk_ids[..., 0][valid], minlength=vocab
    )
    order = np.lexsort((np.arange(vocab), -counts))  # count desc, then id asc
    return np.sort(order[: min(size, vocab)]).astype(np.int32)


def inverse_vocab(d2t: np.ndarray, vocab: int) -> np.ndarray:
    t2d = np.full((vocab,), -1, np.int32)
    t2d[d2t] = np.arange(len(d2t), dtype=np.int32)
    return t2d


def soft_ce(logits, topk_ids, topk_probs, t2d, mask):
    """logits f32[..., N] (draft vocab); targets: top-K target ids/probs [..., K]; mask [...].
    Returns (mean loss, mean top-1 agreement with the target) over masked positions."""
    idx = t2d[topk_ids]  # [..., K], -1 = outside the draft vocab
    p = jnp.where(idx >= 0, topk_probs.astype(jnp.float32), 0.0)
    p = p / jnp.maximum(p.sum(-1, keepdims=True), 1e-6)
    logq = jax.nn.log_softmax(logits, axis=-1)
    ce = -jnp.sum(p * jnp.take_along_axis(logq, jnp.maximum(idx, 0), axis=-1), axis=-1)
    top1 = (t2d[topk_ids[..., 0]] == jnp.argmax(logits, axis=-1)).astype(jnp.float32)
    m = mask.astype(jnp.float32)
    n = jnp.maximum(m.sum(), 1.0)
    return jnp.sum(ce * m) / n, jnp.sum(top1 * m) / n


def _valid(batch):  # bool[B, T] positions with a record
    t = batch["tokens"].shape[1]
    return jnp.arange(t)[None] < batch["lengths"][:, None]


def as_target(target_cfg) -> base.Target:
    """The target object (a models.base.Target), from it or from a Llama ModelConfig."""
    if isinstance(target_cfg, llama.ModelConfig):
        return llama.LlamaTarget(target_cfg)
    return target_cfg


def layer_config(target_cfg, who: str, **changes) -> llama.ModelConfig:
    """The Llama-shaped config a head's own decoder layer(s) take (the target's `layer_config`)."""
    cfg = base.require(as_target(target_cfg), "layer_config", who)
    return dataclasses.replace(cfg, **changes)


def _copy_layer(model, index, who: str):
    """Layer `index` of the target in the Llama layer's names (float32), or a random layer where
    the target does not give its layers in that form (`layer_weights`)."""
    t = base.target_traits(model.target)
    if t.layer_weights is not None:
        layer = t.layer_weights(model.params, index)
        return {k: jnp.asarray(v, jnp.float32) for k, v in layer.items()}
    cfg = layer_config(model.target, who, num_layers=1, dtype="float32")
    return llama.init_params(cfg, jax.random.key(index))["layers"][0]


def _final_norm(model):
    t = base.target_traits(model.target)
    if t.final_norm is not None:
        return jnp.asarray(t.final_norm(model.params), jnp.float32)
    return jnp.ones((model.target.hidden_size,), jnp.float32)


def frozen_pieces(model, d2t):
    """What a head takes from the target (`model`: .target, .params), untrained: its embedding,
    the LM-head rows of the draft vocabulary, the vocabulary maps."""
    target = model.target
    embed = base.require(target, "embedding_table", "a trained drafter")(model.params)
    head = base.require(target, "head_table", "a trained drafter")(model.params)
    return {
        "embed": jnp.asarray(embed, jnp.float32),
        "head": jnp.asarray(head, jnp.float32)[d2t],
        "d2t": jnp.asarray(d2t),
        "t2d": jnp.asarray(inverse_vocab(d2t, target.vocab_size)),
    }


def feature_taps(hidden_layers, target_cfg) -> tuple[int, ...]:
    """The target hidden states (HF indexing) an EAGLE head fuses: as configured, else the
    target's low / mid / high layers (2, L//2, L-3)."""
    if hidden_layers is not None:
        return tuple(hidden_layers)
    return eagle3_lib.default_layers(as_target(target_cfg).num_layers)


@dataclasses.dataclass(frozen=True)
class Eagle:
    hidden_layers: tuple[int, ...] | None = None  # None: low/mid/high of the target (2, L//2, L-3)
    ttt_steps: int = 3
    ttt_decay: float = 0.8
    init_layer: int = -1  # target layer the drafter layer starts from (-1: the last)
    input_scale: float = 15.0  # initial layer-input scale (~ the target's residual stream RMS there)
    name: str = "eagle"
    feature_slots: tuple[int, ...] = (0, 1, 2)  # which recorded layers are the features

    def layer_cfg(self, target_cfg):
        return layer_config(target_cfg, "method eagle", num_layers=1, dtype="float32")

    def taps(self, target_cfg) -> tuple[int, ...]:
        return feature_taps(self.hidden_layers, target_cfg)

    def init(self, target, d2t, key):
        d = target.target.hidden_size
        k1, k2 = jax.random.split(key)
        eye = jnp.eye(d, dtype=jnp.float32)
        fuse = 0.02 * jax.random.normal(k1, (d, 3 * d))
        fuse = fuse.at[:, 2 * d :].add(eye)  # start from the high feature
        in_proj = 0.02 * jax.random.normal(k2, (d, 2 * d))
        in_proj = in_proj.at[:, :d].add(eye).at[:, d:].add(eye) * self.input_scale
        init_layer = self.init_layer % target.target.num_layers
        params = {
            "fuse": fuse,
            "in_proj": in_proj,
            "layer": _copy_layer(target, init_layer, "method eagle"),
            "norm": _final_norm(target),
        }
        return params, frozen_pieces(target, d2t)

    def runtime(self, params, frozen):
        return {**params, "head": frozen["head"], "d2t": frozen["d2t"]}

    def drafter(self, target_cfg):
        """The runtime drafter: its layer in the target's dtype (trained in float32; the engine's
        build casts the layer weights, `eagle.in_dtype`), so a bf16 target's drafter can attend
        on the kernels."""
        t = as_target(target_cfg)
        return eagle_lib.EagleDrafter(
            cfg=dataclasses.replace(self.layer_cfg(target_cfg), dtype=t.dtype),
            target_vocab=as_target(target_cfg).vocab_size,
            hidden_layers=self.taps(target_cfg),
        )

    def arch(self, target_cfg):
        return {"hidden_layers": list(self.taps(target_cfg)), "ttt_steps": self.ttt_steps}

    def loss(self, params, frozen, batch, target_cfg):
        cfg = self.layer_cfg(target_cfg)
        dp = self.runtime(params, frozen)
        tok = batch["tokens"]
        b, t = tok.shape
        emb = frozen["embed"][tok]  # [B, T, D]
        feats = batch["hidden"][jnp.asarray(self.feature_slots)].astype(jnp.float32)
        f = eagle_lib.fuse(dp, feats)  # [B, T, D]
        shift = lambda x, n: jnp.pad(x, [(0, 0), (n, 0)] + [(0, 0)] * (x.ndim - 2))[:, :t]
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        j = jnp.arange(t)
        causal = jnp.broadcast_to(j[None, :] <= j[:, None], (b, t, t))
        valid = _valid(batch)
        x = eagle_lib.layer_input(dp, emb, shift(f, 1))
        h, k0, v0 = eagle_lib.train_layer(cfg, params["layer"], x, pos, causal)
        losses, tops, weights = [], [], []
        prev_k, prev_v = [], []  # keys/values of steps 1..s-1
        for s in range(self.ttt_steps):
            if s > 0:
                x = eagle_lib.layer_input(dp, emb, shift(h, 1))
                ctx_k = [k0] + [shift(kk, s - r) for r, kk in enumerate(prev_k, start=1)]
                ctx_v = [v0] + [shift(vv, s - r) for r, vv in enumerate(prev_v, start=1)]
                diag = jnp.broadcast_to(jnp.eye(t, dtype=bool), (b, t, t))
                masks = [j[None, :] <= j[:, None] - s] + [
                    jnp.eye(t, dtype=bool) & (j[:, None] >= s - r)
                    for r in range(1, s)
                ]
                ctx_mask = jnp.concatenate([jnp.broadcast_to(m, (b, t, t)) for m in masks], axis=2)
                h, ks, vs = eagle_lib.train_layer(
                    cfg, params["layer"], x, pos, diag,
                    jnp.concatenate(ctx_k, axis=1), jnp.concatenate(ctx_v, axis=1), ctx_mask,
                )
                prev_k.append(ks)
                prev_v.append(vs)
            logits = eagle_lib.head_logits(dp, h)
            mask = valid & (j[None] >= max(s, 1))
            loss, top1 = soft_ce(logits, batch["topk_ids"], batch["topk_probs"], frozen["t2d"], mask)
            losses.append(loss)
            tops.append(top1)
            weights.append(self.ttt_decay**s)
        w = jnp.asarray(weights) / sum(weights)
        metrics = {"top1": tops[0]} | {f"top1_s{s}": a for s, a in enumerate(tops)}
        return jnp.sum(jnp.stack(losses) * w), metrics


@dataclasses.dataclass(frozen=True)
class Medusa:
    num_heads: int = 4
    name: str = "medusa"
    feature_slots: tuple[int, ...] = (3,)  # the final-normed hidden in the records

    def init(self, target, d2t, key):
        d = target.target.hidden_size
        w = 0.001 * jax.random.normal(key, (self.num_heads, d, d))
        return {"w": w, "b": jnp.zeros((self.num_heads, d))}, frozen_pieces(target, d2t)

    def runtime(self, params, frozen):
        return {**params, "head": frozen["head"], "d2t": frozen["d2t"]}

    def drafter(self, target_cfg):
        t = as_target(target_cfg)
        return medusa_lib.MedusaDrafter(
            num_heads=self.num_heads, target_vocab=t.vocab_size, final_layer=t.num_layers
        )

    def arch(self, target_cfg):
        return {"num_heads": self.num_heads}

    def loss(self, params, frozen, batch, target_cfg):
        h = batch["hidden"][self.feature_slots[0]].astype(jnp.float32)  # [B, T, D]
        logits = medusa_lib.head_logits(self.runtime(params, frozen), h)  # [K, B, T, N]
        t = h.shape[1]
        valid = _valid(batch)
        losses, tops = [], []
        for k in range(1, self.num_heads + 1):
            shift = lambda x: jnp.pad(x[:, k:], [(0, 0), (0, k)] + [(0, 0)] * (x.ndim - 2))
            mask = shift(valid)  # label at position t+k must exist
            loss, top1 = soft_ce(
                logits[k - 1], shift(batch["topk_ids"]), shift(batch["topk_probs"]), frozen["t2d"], mask
            )
            losses.append(loss)
            tops.append(top1)
        del t
        metrics = {"top1": tops[0]} | {f"top1_h{k + 1}": a for k, a in enumerate(tops)}
        return jnp.mean(jnp.stack(losses)), metrics


@dataclasses.dataclass(frozen=True)
class Draft:
    # target layers the draft model starts from; None: first, middle, last (0, L//2 - 1, L - 1)
    layers_from: tuple[int, ...] | None = None
    name: str = "draft_model"
    feature_slots: tuple[int, ...] = ()

    def sources(self, target_cfg) -> tuple[int, ...]:
        if self.layers_from is not None:
            return tuple(self.layers_from)
        n = as_target(target_cfg).num_layers
        return tuple(sorted({0, max(n // 2 - 1, 0), n - 1}))

    def cfg(self, target_cfg):
        n = len(self.sources(target_cfg))
        return layer_config(target_cfg, "method draft_model", num_layers=n, dtype="float32")

    def init(self, target, d2t, key):
        n = target.target.num_layers
        src = self.sources(target.target)
        layers = tuple(_copy_layer(target, i % n, "method draft_model") for i in src)
        return {"layers": layers, "final_norm": _final_norm(target)}, frozen_pieces(target, d2t)

    def runtime(self, params, frozen):
        return {
            "embed": frozen["embed"],
            "layers": params["layers"],
            "final_norm": params["final_norm"],
            "draft_head": frozen["head"],
            "draft_ids": frozen["d2t"],
        }

    def drafter(self, target_cfg):
        return ModelDrafter(
            model=llama.LlamaTarget(self.cfg(target_cfg)),
            target_vocab=as_target(target_cfg).vocab_size,
        )

    def arch(self, target_cfg):
        return {"layers_from": list(self.sources(target_cfg))}

    def loss(self, params, frozen, batch, target_cfg):
        cfg = self.cfg(target_cfg)
        tok = batch["tokens"]
        b, t = tok.shape
        # no history: a zero-slot cache, the window attends itself (the cache part's block loop
        # has a data-dependent trip count, which reverse-mode differentiation cannot take)
        cache = init_cache(cfg.num_layers, b, 0, cfg.num_kv_heads, cfg.head_dim, jnp.float32)
        dp = self.runtime(params, frozen)
        out = llama.forward(dp, tok, cache, cfg, write_cache=False)
        logits = decoder.linear(out.hidden, frozen["head"]).astype(jnp.float32)
        loss, top1 = soft_ce(logits, batch["topk_ids"], batch["topk_probs"], frozen["t2d"], _valid(batch))
        return loss, {"top1": top1}


@dataclasses.dataclass(frozen=True)
class Eagle3:
    """The published EAGLE-3 head, trained with the same TTT as `Eagle`. The LM head is the
    target's frozen rows for the draft vocabulary (exported as `lm_head.weight`), the embedding
    the target's (not exported: readers take the target's)."""

    hidden_layers: tuple[int, ...] | None = None  # None: low/mid/high of the target (2, L//2, L-3)
    ttt_steps: int = 3
    ttt_decay: float = 0.8
    init_layer: int = -1  # target layer the midlayer's weights start from
    norm_before_residual: bool = False
    name: str = "eagle3"
    feature_slots: tuple[int, ...] = (0, 1, 2)

    def layer_cfg(self, target_cfg):
        return layer_config(target_cfg, "method eagle3", num_layers=1, dtype="float32")

    def taps(self, target_cfg) -> tuple[int, ...]:
        return feature_taps(self.hidden_layers, target_cfg)

    def init(self, target, d2t, key):
        d = target.target.hidden_size
        fc = 0.02 * jax.random.normal(key, (d, 3 * d))
        fc = fc.at[:, 2 * d :].add(jnp.eye(d, dtype=jnp.float32))  # start from the high feature
        src = _copy_layer(target, self.init_layer % target.target.num_layers, "method eagle3")
        two = lambda w: 0.5 * jnp.concatenate([w, w], axis=1)  # [out, D] -> [out, 2D]
        layer = {
            "input_norm": src["attn_norm"], "hidden_norm": src["attn_norm"],
            "wq": two(src["wq"]), "wk": two(src["wk"]), "wv": two(src["wv"]), "wo": src["wo"],
            "mlp_norm": src["mlp_norm"], "w_gate": src["w_gate"], "w_up": src["w_up"],
            "w_down": src["w_down"],
        }
        return {"fc": fc, "layer": layer, "norm": _final_norm(target)}, frozen_pieces(target, d2t)

    def runtime(self, params, frozen):
        return {**params, "lm_head": frozen["head"], "d2t": frozen["d2t"]}

    def drafter(self, target_cfg):
        return eagle3_lib.Eagle3Drafter(
            cfg=self.layer_cfg(target_cfg),
            target_vocab=as_target(target_cfg).vocab_size,
            hidden_layers=self.taps(target_cfg),
            norm_before_residual=self.norm_before_residual,
        )

    def arch(self, target_cfg):
        return {
            "hidden_layers": list(self.taps(target_cfg)), "ttt_steps": self.ttt_steps,
            "norm_before_residual": self.norm_before_residual,
        }

    def loss(self, params, frozen, batch, target_cfg):
        """TTT as `Eagle.loss`; position 0 (no feature) is never a key, and a step-s query at
        position j counts only when its chain starts at a real position j - s >= 1."""
        dr = self.drafter(target_cfg)
        cfg, lp = dr.cfg, params["layer"]
        dp = self.runtime(params, frozen)
        tok = batch["tokens"]
        emb = frozen["embed"][tok].astype(jnp.float32)  # [B, T, D] (the target's embedding)
        b, t = tok.shape
        g = dr.fuse(dp, batch["hidden"][jnp.asarray(self.feature_slots)].astype(jnp.float32))
        shift = lambda x, n: jnp.pad(x, [(0, 0), (n, 0)] + [(0, 0)] * (x.ndim - 2))[:, :t]
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        j = jnp.arange(t)
        full = lambda m: jnp.broadcast_to(m, (b, t, t))
        valid = _valid(batch)
        attn_in, res = dr.layer_input(dp, emb, shift(g, 1))
        h, k0, v0 = feature_chain.block(cfg, lp, attn_in, res, pos, full((j[None] <= j[:, None]) & (j[None] >= 1)))
        losses, tops, weights, prev_k, prev_v = [], [], [], [], []
        for s in range(self.ttt_steps):
            if s > 0:
                attn_in, res = dr.layer_input(dp, emb, shift(h, 1))
                ctx_k = [k0] + [shift(kk, s - r) for r, kk in enumerate(prev_k, start=1)]
                ctx_v = [v0] + [shift(vv, s - r) for r, vv in enumerate(prev_v, start=1)]
                eye = jnp.eye(t, dtype=bool)
                masks = [(j[None] <= j[:, None] - s) & (j[None] >= 1)] + [
                    eye & (j[:, None] >= s - r + 1) for r in range(1, s)
                ]
                h, ks, vs = feature_chain.block(
                    cfg, lp, attn_in, res, pos, full(eye), jnp.concatenate(ctx_k, axis=1),
                    jnp.concatenate(ctx_v, axis=1), jnp.concatenate([full(m) for m in masks], axis=2),
                )
                prev_k.append(ks)
                prev_v.append(vs)
            logits = dr.draft_logits(dp, None, h)
            mask = valid & (j[None] >= s + 1)
            loss, top1 = soft_ce(logits, batch["topk_ids"], batch["topk_probs"], frozen["t2d"], mask)
            losses.append(loss)
            tops.append(top1)
            weights.append(self.ttt_decay**s)
        w = jnp.asarray(weights) / sum(weights)
        metrics = {"top1": tops[0]} | {f"top1_s{s}": a for s, a in enumerate(tops)}
        return jnp.sum(jnp.stack(losses) * w), metrics
