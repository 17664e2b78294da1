"""The verify forward of a step's window: the target over the window's entries -> the sampling
law (or the argmax) per entry, the taps the drafter reads, and the window's k/v for compaction
(`commit_kv`) -- or, for a root-only window and a chain written in place, none (the forward
wrote the cache itself)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxspec.decode import processors, sampling, tree
from jaxspec.decode.state import LoopSpec
from jaxspec.models import base
from jaxspec.models.cache import KVCache
from jaxspec.models.paged_attention import PagedKVCache


def verify(spec: LoopSpec, tparams, cache, window: tree.Window, sp, width: int,
           extras: processors.Carries | None = None, aux: dict | None = None,
           write: bool = False):
    """Target over the first `width` window entries -> (probs [B, T, V] -- in a greedy program
    (sp.mode "greedy") the argmax tokens int32[B, T] instead (`sampling.greedy_tokens`) --, hidden
    [len(hidden_layers), B, T, D] or None, cache, the window's k/v); outputs padded back to T
    entries (past `width`: zeros, never accepted). extras: the processors on (their carries,
    `processors.carries`) with `aux` their `prepare` data: each entry's logits go through
    `processors.adjust` before the sampling transform, and a fifth output holds what their
    `read` hooks take from the entries (padded to T), for their commits.

    With draft nodes the cache is only read and the window's k/v come back for `commit_kv`
    (nodes share positions; which are kept is known only after acceptance). A root-only window
    (plain decoding) always keeps its one entry, so it is written in place (window_kv None):
    writing it after the forward made XLA copy the whole cache every step. write: a chain's
    window, written in place too (`chain_in_place`): causal, at slots cache.lengths + 0..T-1
    (a padding entry's own position is its root's: it is written past the chain instead)."""
    t = window.tokens.shape[1]
    hidden_layers = spec.drafter.hidden_layers if spec.drafter is not None else ()
    in_place = t == 1 or write
    positions = window.positions[:, :width]
    if write:  # [B, T] contiguous from the root's slot; equal to window.positions on the chain
        positions = positions[:, :1] + jnp.arange(width, dtype=positions.dtype)[None]
    out = spec.target.forward(
        tparams, window.tokens[:, :width], cache, positions=positions,
        window_mask=None if in_place else window.mask[:, :width, :width],
        write_cache=in_place, taps=hidden_layers,
    )
    logits = spec.target.logits(tparams, out.hidden)  # [B, width, V]
    adjusted = logits if not extras else processors.adjust(
        extras, aux, logits, window.tokens[:, :width], window.mask[:, :width, :width])
    if sp.mode == "greedy":  # the argmax alone: no one-hot law over the vocabulary
        probs = jnp.pad(sampling.greedy_tokens(adjusted), [(0, 0), (0, t - width)])  # [B, T]
    else:
        probs = sampling.logits_to_probs(adjusted, sp)  # [B, width, V]
        probs = jnp.pad(probs, [(0, 0), (0, t - width), (0, 0)])
    pad = [(0, 0), (0, t - width), (0, 0)]
    layer_hidden = out.taps
    if layer_hidden is not None:
        layer_hidden = jnp.pad(layer_hidden, [(0, 0), *pad])
    window_kv = None if in_place else base.pad_window(spec.target, out.window_kv, t)
    if extras is None:
        return probs, layer_hidden, out.cache, window_kv
    reads = processors.read(spec, sp, extras, logits, adjusted)
    reads = {f: jnp.pad(r, pad + [(0, 0)] * (r.ndim - 3)) for f, r in reads.items()}
    return probs, layer_hidden, out.cache, window_kv, reads


def verify_any_width(spec: LoopSpec, tparams, cache, window: tree.Window, sp, num_nodes,
                      extras: processors.Carries, aux: dict):
    """`verify` in the narrowest compiled width that holds every row's nodes -> (probs,
    hidden, cache, window_kv, the processors' reads). On a GPU the widest window runs always:
    XLA:GPU reads a switch's branch index back to the host (a sync a step), and a window there
    costs about a one-token step anyway (BENCHMARKS.md, "Device")."""
    widths = spec.verify_windows()
    run = lambda c, w: verify(spec, tparams, c, window, sp, w, extras, aux)  # noqa: E731
    if len(widths) == 1:
        return run(cache, widths[0])
    need = jnp.max(num_nodes) + 1
    branch = jnp.sum(jnp.asarray(widths)[:-1] < need)

    def branch_fn(c, w):  # with nodes, verify only reads the cache: it stays out of the switch
        probs, hidden, _, window_kv, reads = run(c, w)
        return probs, hidden, window_kv, reads

    switch = lambda c: jax.lax.switch(  # noqa: E731
        branch, [functools.partial(branch_fn, w=w) for w in widths], c)
    widest = functools.partial(branch_fn, w=widths[-1])
    probs, hidden, window_kv, reads = jax.lax.platform_dependent(
        cache, cuda=widest, rocm=widest, default=switch)
    if spec.mesh is not None and base.target_traits(spec.target).cache_axes is not None:
        # k/v laid out as the cache (else GSPMD may gather it)
        window_kv = spec.mesh.constrain_window_kv(window_kv)
    return probs, hidden, cache, window_kv, reads


def commit_kv(target: base.Target, cache, window_kv, path: jax.Array):
    """Compaction: the path's window k/v (path int32[B, P] window indices) into slots
    cache.lengths .. cache.lengths + P - 1 (entries past the accepted count are garbage past the
    new length: masked, overwritten later). window_kv None: verify already wrote the root."""
    if window_kv is None:
        return cache
    return target.commit_window(cache, window_kv, path, cache.positions(path.shape[1]))


def writes_chains(spec: LoopSpec, cache) -> bool:
    """Whether a chain's verify window is written in place (`LoopSpec.write_chains`): only into
    a KV cache (contiguous or paged), where entries past a row's length are masked; a hybrid
    model's recurrent state would advance over the rejected entries too."""
    if not isinstance(cache, (KVCache, PagedKVCache)):
        return False
    return jax.default_backend() != "cpu" if spec.write_chains is None else spec.write_chains


def chain_in_place(spec, tparams, cache, window: tree.Window, sp, extras, aux):
    """`verify` of a chain's whole window, its k/v written into slots cache.lengths + 0..N
    (window_kv None): the accepted path of a chain is a prefix of the window, already in its
    slots, and the rest lies past the row's new length (masked, overwritten later), so no
    compaction follows and the attention reads the window from the cache as decode does."""
    return verify(spec, tparams, cache, window, sp, window.tokens.shape[1], extras, aux,
                  write=True)
