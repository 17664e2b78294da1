"""The target protocol: what the speculative loop, the drafters, calibration, sharding and the
tools may ask of a target model. A target is a frozen (hashable) object -- part of the jit key,
like a drafter -- whose methods are pure functions of the params and the cache it hands out;
nothing in jaxspec names a family. The Llama family (`models/llama.py`, `LlamaTarget`) is one
implementation; a researcher's own model is a class with these methods (docs/targets.md).

Required (dimension letters as elsewhere: B batch, T window, S slots, D model dim, V vocab):

  vocab_size, hidden_size, num_layers, max_position_embeddings: int;  dtype: str (compute)
  init_cache(params, batch, capacity) -> cache
      a pytree with `lengths: int32[B]` (committed tokens per row), `with_lengths(lengths)` and
      `positions(T) -> int32[B, T]` (`lengths[:, None] + arange(T)`); `jaxspec.models.cache.KVCache`
      is one. Entries past a row's length are never read (rollback is not advancing it).
  forward(params, tokens, cache, *, positions=None, window_mask=None, write_cache=True, taps=())
      -> TargetOutput(hidden, taps, window_kv, cache)
      tokens int32[B, T] at positions int32[B, T] (None: cache.positions(T)); attends the cache
      below `cache.lengths` and the window entries `window_mask` bool[B, T, T] allows (None:
      causal; a draft tree passes ancestors-and-self, only with write_cache=False). `taps`:
      HF `hidden_states` indices (0 = embeddings, i = after layer i, num_layers = final-normed).
      write_cache=True writes the window's k/v at `positions` (lengths NOT advanced);
      write_cache=False leaves the cache untouched and returns the window's k/v for
      `commit_window`.
  logits(params, hidden [..., D]) -> f32[..., V]
  commit_window(cache, window_kv, path int32[B, P], positions int32[B, P]) -> cache
      the window entries `path` picks (window indices, 0 = the root) written at `positions`
      (the slots of a linear cache); lengths NOT advanced.

Optional traits (read through `target_traits`, never with getattr elsewhere); a drafter or tool
that needs one the target lacks is refused in one line (`require`):

  embed(params, tokens) -> [..., D]   the token embedding the target's first layer reads
                                      (EAGLE / EAGLE-3 / MTP heads share it)
  embedding_table(params) -> [V, D]   the embedding matrix (training, export)
  head_table(params) -> [V, D]        the LM-head rows when logits are one matmul (trained heads
                                      gather their draft vocabulary from it)
  head_weight(params)                 the same head as stored, for `decoder.linear` ([V, D] or the
                                      CPU kernels' PackedWeight): a drafter that runs the whole
                                      head every step (DFlash) reads it without unpacking it
  prefix(num_layers) -> Target        the same params run through only the first num_layers
                                      layers, then the final norm and head (layer skip)
  layer_config                        a `llama.ModelConfig` with the target's dims (hidden,
                                      heads, head dim, mlp, rope, eps): what a drafter's own
                                      decoder layer is sized from when no checkpoint says
  layer_weights(params, i) -> dict    layer i in the Llama layer's names (wq .. w_down, norms),
                                      unpacked: a trained head's layer starts from it
  final_norm(params) -> [D]           the final norm's weight (a trained head's norm starts there)
  init_params(key, layout) -> params  random params in a layout ("unrolled" | "stacked"): tests,
                                      and the roofline's abstract shapes (jax.eval_shape)
  param_axes(params)                  logical axis names of every param leaf (sharding.py)
  cache_axes(cache)                   logical axis names of every cache leaf
  head_counts() -> {"heads": N, "kv_heads": K}   tensor parallelism by whole heads
  pad_window(window_kv, T) -> window_kv   the window k/v of a narrower forward padded to T
                                      entries (the loop's window-width switch needs one shape);
                                      absent: every leaf is [B, T', ...], padded on axis 1
  layout(params) -> str               "unrolled" | "stacked" | "packed" (reported, calibrated)
  uses_cpu_kernels(params) -> bool    the CPU panel/attention kernels run these params
  forward_prompt(params, tokens, cache, prompt_lengths, taps) -> TargetOutput
                                      forward (write_cache=True) over right-padded prompts whose
                                      rows hold prompt_lengths int32[B] tokens: a target with
                                      recurrent state (models/qwen3_5.py) keeps each row's state
                                      at its own length; absent: forward (padding is masked)
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp

from jaxspec.errors import JaxspecError


class TargetOutput(NamedTuple):
    hidden: jax.Array  # [B, T, D] final-normed (feed to `logits`)
    taps: jax.Array | None  # [len(taps), B, T, D]; None when no taps were asked for
    window_kv: Any  # write_cache=False: the window's k/v (for commit_window); else None
    cache: Any  # written at positions (write_cache=True) or the input cache


class Target(Protocol):
    name: str  # the architecture, e.g. "llama", "qwen3"
    vocab_size: int
    hidden_size: int
    num_layers: int
    max_position_embeddings: int
    dtype: str

    def init_cache(self, params: Any, batch: int, capacity: int) -> Any: ...

    def forward(
        self,
        params: Any,
        tokens: jax.Array,
        cache: Any,
        *,
        positions: jax.Array | None = None,
        window_mask: jax.Array | None = None,
        write_cache: bool = True,
        taps: tuple[int, ...] = (),
    ) -> TargetOutput: ...

    def logits(self, params: Any, hidden: jax.Array) -> jax.Array: ...

    def commit_window(self, cache: Any, window_kv: Any, path: jax.Array, positions: jax.Array): ...


class Traits(NamedTuple):
    embed: Any  # bound method or None
    embedding_table: Any
    head_table: Any
    head_weight: Any
    prefix: Any
    layer_config: Any  # llama.ModelConfig or None
    layer_weights: Any
    final_norm: Any
    init_params: Any
    param_axes: Any
    cache_axes: Any
    head_counts: Any
    pad_window: Any
    layout: Any
    uses_cpu_kernels: Any
    forward_prompt: Any


TRAIT_NAMES = Traits._fields
# what each trait gives a drafter or tool, for the one-line refusal
_WHAT = {
    "embed": "a shared token embedding",
    "embedding_table": "an embedding table",
    "head_table": "an LM-head matrix",
    "head_weight": "an LM-head weight",
    "prefix": "a layer prefix",
    "layer_config": "a decoder-layer shape (layer_config)",
    "layer_weights": "Llama-named layer weights",
    "final_norm": "a final norm weight",
    "init_params": "random params (init_params)",
    "param_axes": "param sharding axes",
    "cache_axes": "cache sharding axes",
    "head_counts": "head counts",
    "pad_window": "window padding",
    "layout": "a layout",
    "uses_cpu_kernels": "CPU-kernel support",
    "forward_prompt": "a padded-prompt forward",
}


def target_traits(target: Target) -> Traits:
    """The optional protocol attributes of `target` (None where absent)."""
    return Traits(*(getattr(target, n, None) for n in TRAIT_NAMES))


def require(target: Target, trait: str, who: str):
    """The trait, or a one-line JaxspecError saying why `who` cannot run on this target."""
    found = getattr(target_traits(target), trait)
    if found is None:
        raise JaxspecError(
            f"{who} cannot run on target {describe(target)}: it needs {_WHAT[trait]} "
            f"(`{trait}`), which this target does not provide"
        )
    return found


def describe(target: Target) -> str:
    return f"{getattr(target, 'name', type(target).__name__)!r} ({type(target).__name__})"


def layout(target: Target, params: Any) -> str:
    """The params' layout as the target reports it ("custom" when it does not say)."""
    fn = target_traits(target).layout
    return "custom" if fn is None else fn(params)


def pad_window(target: Target, window_kv: Any, entries: int) -> Any:
    """`window_kv` padded with zeros to `entries` window entries (never accepted: masked)."""
    fn = target_traits(target).pad_window
    if fn is not None:
        return fn(window_kv, entries)
    pad = lambda w: jnp.pad(w, [(0, 0), (0, entries - w.shape[1])] + [(0, 0)] * (w.ndim - 2))  # noqa: E731
    return jax.tree.map(pad, window_kv)


def uses_cpu_kernels(target: Target, params: Any) -> bool:
    fn = target_traits(target).uses_cpu_kernels
    return bool(fn is not None and fn(params))


def forward_prompt(target: Target, params: Any, tokens: jax.Array, cache: Any,
                   prompt_lengths: jax.Array, taps: tuple[int, ...] = ()) -> TargetOutput:
    """The cache written with right-padded prompts (prompt_lengths int32[B] real tokens per row):
    the target's `forward_prompt` where it has one, else its plain forward."""
    fn = target_traits(target).forward_prompt
    if fn is None:
        return target.forward(params, tokens, cache, taps=taps)
    return fn(params, tokens, cache, prompt_lengths, taps=taps)


def compute_dtype(target: Target):
    return jnp.dtype(target.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Bound:
    """A target's params with the target itself (static: a pytree whose only leaves are the
    params'). The loop hands drafters `tparams` in this form, so a drafter reaches the target's
    embedding, head or layer prefix through the protocol, never by a param name."""

    params: Any
    target: Any = dataclasses.field(metadata={"static": True})

    def embed(self, tokens: jax.Array) -> jax.Array:
        return require(self.target, "embed", "this drafter")(self.params, tokens)

    def logits(self, hidden: jax.Array) -> jax.Array:
        return self.target.logits(self.params, hidden)

    @property
    def uses_cpu_kernels(self) -> bool:
        return uses_cpu_kernels(self.target, self.params)


def bind(target: Target, params: Any) -> Bound:
    return params if isinstance(params, Bound) else Bound(params, target)


def unbind(params: Any) -> Any:
    return params.params if isinstance(params, Bound) else params


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Model:
    """A target with its params and tokenizer: what `Engine` runs. `loading.load_model` returns
    its own (LoadedModel, with the same fields); a model of one's own is wrapped in this."""

    target: Any
    params: Any
    tokenizer: Any = None  # a transformers tokenizer, or None (prompts are token ids)
    eos_token_ids: tuple[int, ...] = ()
    name: str = "model"
