"""The engine's surface for the serving scheduler: its own programs over rows it manages
(prefill into a page pool, prompt chunks, decode calls), each also as (jitted function, args,
kwargs) so a warm-up compiles ahead, or `tools.programs` exports, exactly what serving calls.
A mixin of `runner.Engine`: it reads the engine's `spec`, `model` and `drafter_params`."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxspec import kernels
from jaxspec.decode import penalties as penalties_lib, speculate
from jaxspec.decode.sampling import SamplingParams
from jaxspec.engine import prompt_scores
from jaxspec.models import base

SERVED_LOGPROBS = 20  # top alternatives a server records when generation.logprobs is unset
# (OpenAI's and vLLM's most)

# a prefill written into a cache the caller passes in (a serving page pool), donated: updated in
# place, never copied
prefill_into_cache = jax.jit(speculate.prefill, static_argnames=("spec", "capacity"),
                             donate_argnames=("cache",))


@functools.partial(jax.jit, static_argnums=0, donate_argnums=3)
def _write_prompt(target, params, tokens, cache):
    """tokens [B, C] run at cache.lengths.. through `target`, their k/v written (the cache
    donated); lengths not advanced."""
    return target.forward(kernels.for_prompts(params), tokens, cache).cache


class ServingSurface:
    # compiled programs the calls below run through when set (`serving.executables.Table`: a
    # server's warm-up loads them without tracing); None: through the jit
    serving_programs = None

    def _call(self, fn, *args, **kwargs):
        if self.serving_programs is None:
            return fn(*args, **kwargs)
        return self.serving_programs.call(fn, args, kwargs)

    def serving_spec(self, target: Any = None) -> speculate.LoopSpec:
        """The program continuous batching runs, with `target` in place of the model's (None:
        the model's; a paged one). Its rows hold different requests: no batch-wide hand-off to
        plain decoding, and a row that ends is replaced (the cap buys tokens, not a shorter
        tail). Its programs carry every extra a request may ask for as traced per-row inputs
        (penalties and logit_bias at their neutral values, the logprob record of the top
        `SERVED_LOGPROBS` unless generation.logprobs says otherwise), so no request compiles a
        program of its own."""
        spec = self.spec
        if spec.logprobs is None:  # every request may ask: recorded always, sent where asked
            k = min(SERVED_LOGPROBS, spec.target.vocab_size)  # a tiny vocabulary has fewer
            spec = dataclasses.replace(spec, logprobs=k)
        if spec.adaptive is not None:
            ctl = spec.adaptive
            spec = dataclasses.replace(spec, adaptive=dataclasses.replace(
                ctl, settings=dataclasses.replace(ctl.settings, handoff_after=0),
                rows_replaced=True))
        return spec if target is None else dataclasses.replace(spec, target=target)

    @property
    def target(self) -> base.Target:
        """The model's target (what a serving cache wraps)."""
        return self.model.target

    def cache_shape(self, target: Any, batch: int, capacity: int):
        """The shapes of `target`'s empty cache (traced only: nothing is allocated)."""
        return jax.eval_shape(lambda: target.init_cache(self.model.params, batch, capacity))

    def empty_cache(self, target: Any, batch: int, capacity: int):
        return target.init_cache(self.model.params, batch, capacity)

    def prefill_rows(self, spec, prompt, lengths, max_new, sp, key, row_ids, capacity: int,
                     cache=None, penalties=None, grammar=None):
        """`speculate.prefill` of these rows on `spec` (prompt int32[B, P], the rest per row),
        jitted; into `cache` where given (a page pool with these rows' tables, donated);
        penalties: the rows' `penalties.Penalties` (None: off); grammar: the rows' constraints
        (constrain.loop.Grammar) or None."""
        args = (spec, self.model.params, self.drafter_params, prompt, lengths, max_new, sp, key,
                row_ids)
        if cache is None:
            return self._call(speculate.prefill_jit, *args, capacity=capacity,
                              penalties=penalties, grammar=grammar)
        return self._call(prefill_into_cache, *args, capacity=capacity, cache=cache,
                          penalties=penalties, grammar=grammar)

    def row_penalties(self, settings):
        """The serving state's `penalties.Penalties`: one (presence, frequency, repetition,
        logit_bias) per row, carried even when all are off (rows come and go)."""
        return penalties_lib.make(settings, self.model.target.vocab_size, always=True)

    def compile_prefill(self, spec, batch: int, width: int, capacity: int, cache=None,
                        penalties: bool = False):
        """`prefill_rows` compiled ahead for `batch` prompts of `width` tokens (greedy values;
        `cache`: the shapes of the cache it writes into, or None; penalties: with the rows'
        `row_penalties`)."""
        fn, args, kwargs = self.prefill_program(spec, batch, width, capacity, cache, penalties)
        return fn.lower(*args, **kwargs).compile()

    def prefill_program(self, spec, batch: int, width: int, capacity: int, cache=None,
                        penalties: bool = False, grammar=None):
        """(jitted function, args, kwargs) of `prefill_rows` for these shapes (abstract: to
        compile ahead, or export for another platform); penalties: with the rows'
        `row_penalties`, as the serving state carries them; grammar: the rows' Grammar (or its
        shapes) where the server carries one (serving.structured), else None."""
        z = jax.ShapeDtypeStruct((batch,), jnp.int32)
        sp = SamplingParams.rows([(0.0, 0, 1.0, 0.0)] * batch)
        args = (spec, self.model.params, self.drafter_params,
                jax.ShapeDtypeStruct((batch, width), jnp.int32), z, z, sp,
                jax.random.key(0), z)
        pen = self.row_penalties([penalties_lib.OFF] * batch) if penalties else None
        if cache is None:
            return speculate.prefill_jit, args, {"capacity": capacity, "penalties": pen,
                                                 "grammar": grammar}
        return prefill_into_cache, args, {"capacity": capacity, "cache": cache, "penalties": pen,
                                          "grammar": grammar}

    def write_prompt(self, target: Any, tokens, cache):
        """A prompt chunk [B, C] run at cache.lengths.. and its k/v written into `cache` (donated:
        updated in place); lengths not advanced. Chunked prefill's chunks before the last."""
        return self._call(_write_prompt, target, self.model.params, tokens, cache)

    def compile_write_prompt(self, target: Any, batch: int, chunk: int, cache):
        """`write_prompt` compiled ahead for `batch` chunks of `chunk` tokens into a cache of
        `cache`'s shapes (a ShapeDtypeStruct tree)."""
        fn, args, kwargs = self.write_prompt_program(target, batch, chunk, cache)
        return fn.lower(*args, **kwargs).compile()

    def write_prompt_program(self, target: Any, batch: int, chunk: int, cache):
        """(jitted function, args, kwargs) of `write_prompt` for these shapes."""
        tokens = jax.ShapeDtypeStruct((batch, chunk), jnp.int32)
        return _write_prompt, (target, self.model.params, tokens, cache), {}

    def score_program(self):
        """(jitted function, args, kwargs) of the chunk program that scores a prompt's own tokens
        (echo with logprobs: `prompt_scores`), for this engine's max_context."""
        return prompt_scores.score_program(self.model.target, self.model.params, self.max_context)

    def decode_rows(self, spec, state, sp, steps: int):
        """Up to `steps` steps of `spec`'s loop over `state` (donated), jitted."""
        return self._call(speculate.decode_jit, spec, self.model.params, self.drafter_params,
                          state, sp, jnp.int32(steps))

    def compile_decode(self, spec, state, sp, steps: int):
        """`decode_rows` compiled ahead for `state`'s shapes (a ShapeDtypeStruct tree)."""
        fn, args, kwargs = self.decode_program(spec, state, sp, steps)
        return fn.lower(*args, **kwargs).compile()

    def decode_program(self, spec, state, sp, steps: int):
        """(jitted function, args, kwargs) of `decode_rows` for `state`'s shapes."""
        args = (spec, self.model.params, self.drafter_params, state, sp, jnp.int32(steps))
        return speculate.decode_jit, args, {}
