"""The host side of generation: `Engine` runs batches of requests through the jitted programs and
times them, from small units each with one job:

    prepare.Requests         tokenise, validate, bucket, pack a batch's arrays
    programs.Programs        the compiled-program cache (and the attention each program holds)
    adaptive.host.AdaptiveHost   adaptive speculation's cost curves and cross-batch learner
    results.Report           fetched state -> GenerationResult, text and metrics
    serving_surface.ServingSurface   the programs the serving scheduler calls over its rows

    engine = Engine(model)                          # plain decoding
    engine = Engine(model, drafter, num_speculative_tokens=4)
    results = engine.generate(["Hi!"], max_new_tokens=64)
    for piece in engine.stream("Tell me a story"): print(piece, end="")
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Generator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import progress, sharding, xla_cache
from jaxspec.decode import logprobs as logprobs_lib, penalties as penalties_lib, speculate
from jaxspec.decode.adaptive import Controller, cost_table
from jaxspec.decode.adaptive.host import AdaptiveHost
from jaxspec.config import AdaptiveConfig
from jaxspec.constrain import host as constrain_host
from jaxspec.decode.drafter import check_target, traits
from jaxspec.errors import JaxspecError
from jaxspec.limits import MAX_SPECULATIVE_TOKENS, check_cache_fits
from jaxspec.models import base
from jaxspec.engine.prepare import MIN_PROMPT_BUCKET, Requests, bucket, prompt_bucket
from jaxspec.engine import cache_watch, prompt_scores
from jaxspec.engine.programs import Programs
from jaxspec.engine.results import GenerationResult, Report, fetch
from jaxspec.engine.serving_surface import ServingSurface
from jaxspec.decode.sampling import SamplingParams, check_tokens
from jaxspec.decode.sampling_settings import Sampling

__all__ = ["Engine", "GenerationResult", "bucket", "MIN_PROMPT_BUCKET"]

class Engine(ServingSurface):
    def __init__(
        self,
        model,  # jaxspec.loading.LoadedModel, or models.base.Model (a target of one's own)
        drafter=None,
        drafter_params: Any = None,
        *,
        num_speculative_tokens: int = 0,
        chat_template: bool = True,
        system_prompt: str | None = None,
        mesh=None,  # a sharding.MeshPlan or jax Mesh: params, cache, batch and state sharded on it
        max_context: int | None = None,
        adaptive: AdaptiveConfig | None = None,  # the config section; None (or not enabled): off
        logprobs: int | None = None,  # record emitted tokens' logprobs + this many top (0..20)
        logprobs_mode: str = "raw",  # "raw" (the model's log_softmax) or "processed"
    ):
        xla_cache.enable()  # on by default, as in the CLI (JAXSPEC_XLA_CACHE=0: off)
        if drafter is None:
            num_speculative_tokens = 0
        check_engine_args(model, drafter, drafter_params, num_speculative_tokens, max_context,
                          logprobs, logprobs_mode)
        self.plan = None
        if mesh is not None:
            self.plan = mesh if isinstance(mesh, sharding.MeshPlan) else sharding.MeshPlan(mesh)
            model, drafter_params = self._placed(model, drafter, drafter_params)
        self.max_context = max_context  # fixed cache slots per row (None: per request)
        self.model = model
        self.drafter = drafter
        self.drafter_params = drafter_params
        self.chat_template = chat_template
        self.system_prompt = system_prompt
        on = drafter is not None and adaptive is not None and adaptive.enabled
        self.adaptive = adaptive if on else None
        self.spec, self.plain_spec = self._loop_specs(num_speculative_tokens, logprobs, logprobs_mode)
        self.requests = Requests(
            model, depth=self.spec.depth, num_nodes=self.spec.num_nodes,
            draft_limit=None if drafter is None else traits(drafter).max_context,
            max_context=max_context, chat_template=chat_template, system_prompt=system_prompt,
        )
        self.programs = Programs()
        self._grammar_compiler = None  # constrain.host.GrammarCompiler, made on first use
        self._call_costs: dict[int, tuple] = {}  # batch -> `call_costs` (host arrays)
        self.policy = None if self.adaptive is None else AdaptiveHost(
            self.adaptive, model, self.spec, drafter
        )
        self.report = Report(model, self.spec, self.method, adaptive=self.policy is not None)

    def _placed(self, model, drafter, drafter_params):
        """The target's and the drafter's params placed on the mesh."""
        model = dataclasses.replace(
            model, params=self.plan.place_target(model.params, model.target)
        )
        t = traits(drafter) if drafter is not None else None
        own_layer, own_model = (None, None) if t is None else (t.model_cfg, t.model)
        return model, self.plan.place_drafter(drafter_params, own_layer, own_model)

    def _loop_specs(self, num_speculative_tokens, logprobs, logprobs_mode):
        """The loop's static spec, and plain decoding's (adaptive switch-off: a batch size where
        verification cannot pay runs that program)."""
        model, drafter = self.model, self.drafter
        # adaptive: a chain's length, or the depth a tree is cut to (its levels)
        depth = (traits(drafter).tree_depth if drafter is not None else None) or num_speculative_tokens
        spec = speculate.LoopSpec(
            target=model.target,
            drafter=drafter,
            num_speculative_tokens=num_speculative_tokens,
            eos_ids=tuple(model.eos_token_ids),
            # prompt lookup with no or a 1-token match: a cheaper, shorter window (and the widths
            # a drafter of widely varying lengths asks for, suffix decoding's)
            windows=(1, 2, *(traits(drafter).verify_windows if drafter is not None else ())),
            mesh=self.plan,
            adaptive=None if self.adaptive is None else Controller(depth, self.adaptive),
            logprobs=logprobs, logprobs_mode=logprobs_mode,
        )
        plain = speculate.LoopSpec(
            target=model.target, drafter=None, num_speculative_tokens=0,
            eos_ids=tuple(model.eos_token_ids), mesh=self.plan,
            logprobs=logprobs, logprobs_mode=logprobs_mode,
        )
        return spec, plain

    @property
    def method(self) -> str:
        return "plain" if self.drafter is None else self.drafter.name

    @property
    def compiled_attention(self) -> dict[str, str]:
        """The attention the last run shape's programs hold, per program (from their HLO)."""
        return self.programs.attention

    def model_note(self) -> str | None:
        """A warning worth printing about the target's layout: "auto" fell back from the CPU
        kernels, so greedy output is no longer bit-identical across batch and window sizes."""
        note = getattr(self.model, "layout_note", "")
        if note.startswith("auto fell back"):
            return f"layout {base.layout(self.model.target, self.model.params)} ({note})"
        return None

    # ---- requests (prepare.Requests) ------------------------------------------------------
    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        return self.requests.encode(prompt)

    def check_fits(self, ids: list[int], max_new_tokens: int) -> None:
        """A one-line JaxspecError if this request cannot run."""
        self.requests.check_fits(ids, max_new_tokens)

    def capacity(self, prompt_bucket: int, max_new_tokens: int, backend: str | None = None) -> int:
        return self.requests.capacity(prompt_bucket, max_new_tokens, backend)

    # ---- adaptive speculation (decode.adaptive.host.AdaptiveHost) --------------------------------
    def calibrate(self, batch: int) -> dict[int, list[float]] | None:
        """The explicit calibration step: this batch size's step-cost curves, measured on this
        machine (announced by a progress line; cached afterwards) or given. None: not adaptive."""
        if self.policy is None:
            return None
        return self.policy.calibrate(batch, self.drafter_params)

    step_costs = calibrate  # {fill: [γ+1]} at this batch size

    def spec_for(self, batch: int, contexts: Sequence[int] | None = None) -> speculate.LoopSpec:
        """The program a batch of this size runs: the adaptive one, or the plain one where the
        host policy says speculation does not pay (`AdaptiveHost.runs_adaptive`; contexts: the
        rows' prompt lengths, so at batch 1 the request's own length decides); reads the
        curves `calibrate` set, never measures."""
        if self.policy is None or self.policy.runs_adaptive(batch, contexts):
            return self.spec
        return self.plain_spec

    def state_spec(self, state) -> speculate.LoopSpec:
        """The program a prefilled state continues in: the one its prefill ran (an adaptive
        engine's state without controller state came from the plain program)."""
        if self.policy is not None and state.adaptive is None:
            return self.plain_spec
        return self.spec

    def realized_gain(self, batch: int) -> float:
        return self.policy.realized_gain(batch)

    # ---- running --------------------------------------------------------------------------
    def penalties(self, settings, rows: int):
        """`penalties.Penalties` for `rows` rows all with `settings` = (presence, frequency,
        repetition, logit_bias dict) (None: off; validated, a one-line error naming the fix)."""
        if settings is None:
            return None
        return penalties_lib.make([settings] * rows, self.model.target.vocab_size)

    def _prefill_args(self, batch_ids, max_new_tokens, sp, seed, row_ids, batch_size):
        """(the prefill program's positional arguments, its capacity) for this batch."""
        packed = self.requests.pack(batch_ids, max_new_tokens, row_ids, batch_size)
        key = jax.random.key(seed)
        if self.plan is not None:  # rows over the data axis (each process its own rows)
            put, sp, key = self.plan.put_batch, self.plan.put_replicated(sp), self.plan.put_replicated(key)
        else:
            put = jnp.asarray
        b = packed.prompt.shape[0]
        contexts = [len(ids) for ids in batch_ids]
        args = (self.spec_for(b, contexts), self.model.params, self.drafter_params, put(packed.prompt),
                put(packed.lengths), put(packed.max_new), sp, key, put(packed.row_ids))
        return args, packed.capacity

    def with_adaptive(self, state, spec: speculate.LoopSpec | None = None,
                      costs_batch: int | None = None):
        """`state` with the adaptive controller's state, when its program adapts: `spec`'s
        (None: the program this batch runs, `spec_for`), started on the step-cost curves of
        `costs_batch` rows (None: the state's; calibrated first if they are not yet). The serving
        scheduler passes its own spec and batch 1 (each of its calls sets its width's costs)."""
        b = state.lengths.shape[0]
        adaptive = (spec if spec is not None else self.spec_for(b)).adaptive
        if adaptive is None:
            return state
        return dataclasses.replace(state, adaptive=adaptive.init(b, self.calibrate(costs_batch or b)))

    def call_costs(self, batch: int) -> tuple:
        """(costs f32[F, G+1], fills f32[F]) as host arrays: the controller's cost table for a
        `batch`-row call, from that batch size's calibrated curves (measured once, announced)."""
        if batch not in self._call_costs:
            fills, table = cost_table(self.step_costs(batch))
            self._call_costs[batch] = (np.asarray(table, np.float32),
                                       np.asarray(fills, np.float32))
        return self._call_costs[batch]

    def prefill(self, batch_ids, max_new_tokens, sp, seed, row_ids, batch_size, penalties=None,
                grammar=None):
        """The prefilled decode state of a batch of token-id prompts (rows padded to batch_size);
        penalties: (presence, frequency, repetition, logit_bias) for every row, None: off;
        grammar: the rows' constraints (`grammar_for`), None: every row free."""
        self.calibrate(max(batch_size, len(batch_ids)))
        args, capacity = self._prefill_args(batch_ids, max_new_tokens, sp, seed, row_ids, batch_size)
        pen = self.penalties(penalties, args[3].shape[0])
        return self.with_adaptive(speculate.prefill_jit(*args, capacity=capacity, penalties=pen,
                                                        grammar=grammar), args[0])

    def grammar_for(self, constraints, rows: int):
        """Per row a constrain.Constraint or None -> the batch's device Grammar (None: no row
        constrained); compiled tables cached by regex (constrain/host.py)."""
        if all(c is None for c in constraints):
            return None
        if self._grammar_compiler is None:
            self._grammar_compiler = constrain_host.GrammarCompiler(
                self.model.tokenizer, self.model.target.vocab_size, tuple(self.model.eos_token_ids))
        return self._grammar_compiler.batch(list(constraints), rows)

    def _decode_args(self, state, sp, max_steps: int):
        spec = self.state_spec(state)
        steps = jnp.int32(max_steps)
        if self.plan is not None:
            sp, steps = self.plan.put_replicated((sp, steps))
        return spec, self.model.params, self.drafter_params, state, sp, steps

    def decode(self, state, sp, max_steps: int):
        """Up to `max_steps` decode steps of `state` (the batch's program, jitted)."""
        return speculate.decode_jit(*self._decode_args(state, sp, max_steps))

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        *,
        max_new_tokens: int | None = None,
        sampling: Sampling | SamplingParams | None = None,
        seed: int | None = None,
        batch_size: int = 1,
        penalties: tuple | None = None,
        constraint=None,
    ) -> list[GenerationResult]:
        """Generate for every prompt, `batch_size` rows at a time (the last batch is padded).
        sampling: a `jaxspec.Sampling` (greedy when None); its max_tokens, seed and penalties
        apply where the arguments of the same meaning are not given (`resolve_sampling`).
        penalties: (presence, frequency, repetition, logit_bias {id: bias}) for every row
        (decode/logit_bias.py; None: off), applied inside the loop, speculation lossless.
        constraint: a constrain.Constraint for every prompt, or one per prompt (None: free);
        the output then follows it (docs/structured.md), lossless for every drafter."""
        sp, max_new_tokens, seed, penalties = resolve_sampling(sampling, max_new_tokens, seed,
                                                               penalties)
        if max_new_tokens < 1:
            raise JaxspecError(f"max_new_tokens={max_new_tokens} must be at least 1")
        if batch_size < 1:
            raise JaxspecError(f"batch_size={batch_size} must be at least 1")
        encoded = [self.encode(p) for p in prompts]
        for ids in encoded:
            self.check_fits(ids, max_new_tokens)
        if penalties is not None:
            penalties = tuple(penalties)
            self.penalties(penalties, 1)  # validated before anything compiles
            if penalties_lib.is_off(penalties):
                penalties = None
        constraints = _per_prompt(constraint, len(prompts))
        results: list[GenerationResult] = []
        for start in range(0, len(prompts), batch_size):
            chunk = list(range(start, min(start + batch_size, len(prompts))))
            grammar = self.grammar_for([constraints[i] for i in chunk], max(batch_size, len(chunk)))
            results += self._run_batch(
                [prompts[i] for i in chunk], [encoded[i] for i in chunk], chunk,
                max_new_tokens, sp, seed, batch_size, penalties, grammar,
            )
        return results

    def _ensure_compiled(self, batch_ids, max_new_tokens, sp, batch_size, penalties=None,
                         grammar=None) -> float:
        """Compile the programs for this shape ahead of time (programs.Programs), so timings
        exclude compilation. Returns the seconds spent; 0.0 when this shape was already warm."""
        b = max(batch_size, len(batch_ids))
        self.calibrate(b)  # the explicit, announced step before anything of this size runs
        plain = self.spec_for(b, [len(ids) for ids in batch_ids]) is self.plain_spec
        longest = max(len(ids) for ids in batch_ids)
        decode_key = (b, bucket(longest), bucket(max_new_tokens), sp.mode, plain,
                      penalties is not None, constrain_host.shape_key(grammar))
        key = (prompt_bucket(longest),) + decode_key  # the prefill's width, the cache's size
        if self.programs.warm(key):
            return 0.0
        capacity = self.capacity(bucket(longest), max_new_tokens)
        check_cache_fits(self.model.target, self.model.params, b, capacity)  # before any buffer of that size exists
        preparing = progress.start(f"decode programs ({self.method}, batch {b}; prefill and decode)")
        args, capacity = self._prefill_args(batch_ids, max_new_tokens, sp, 0, list(range(len(batch_ids))), b)
        decode_args = lambda state: self._decode_args(self.with_adaptive(state, args[0]), sp, 1)
        with cache_watch.watch(cache_watch.announcer(preparing, expected=2)) as answers:
            seconds = self.programs.compile(key, args, capacity, decode_args, self.plan is not None,
                                            penalties=self.penalties(penalties, b), grammar=grammar,
                                            decode_key=decode_key)
        preparing(answers.summary())
        return seconds

    def warmup(self, prompt, *, max_new_tokens=None, sampling=None, batch_size=1) -> float:
        """Compile the programs a request of this shape needs; returns the seconds it took."""
        sp, max_new_tokens, _, _ = resolve_sampling(sampling, max_new_tokens, None, None)
        return self._ensure_compiled([self.encode(prompt)], max_new_tokens, sp, batch_size)

    def _run_batch(self, prompts, batch_ids, row_ids, max_new_tokens, sp, seed, batch_size,
                   penalties=None, grammar=None):
        compile_s = self._ensure_compiled(batch_ids, max_new_tokens, sp, batch_size, penalties,
                                          grammar)
        contexts = [len(ids) for ids in batch_ids]  # what the host policy decides by
        why = None if self.policy is None else self.policy.decide(
            max(batch_size, len(batch_ids)), contexts)[1]
        t0 = time.perf_counter()
        state = self.prefill(batch_ids, max_new_tokens, sp, seed, row_ids, batch_size, penalties,
                             grammar)
        jax.block_until_ready(state.tokens)
        t1 = time.perf_counter()
        state = self.decode(state, sp, 1 << 30)
        jax.block_until_ready(state.tokens)
        t2 = time.perf_counter()
        state = fetch(state, self.plan)
        results = self.report.results(prompts, batch_ids, state, t1 - t0, t2 - t1, self.compiled_attention)
        if self.policy is not None:
            tokens = [r.num_generated_tokens - 1 for r in results]  # decode steps' tokens
            self.policy.record(state.adaptive, len(batch_ids), state.lengths.shape[0], tokens,
                               contexts)
            for r in results:  # why this batch ran the program it did (host.HOST_REASONS)
                r.metrics["adaptive_host_reason"] = why
        for r in results:
            r.metrics["compile_s"] = compile_s  # excluded from the timings above
        self._observe(batch_ids, results)
        return results

    def _observe(self, batch_ids, results) -> None:
        """A drafter that learns from finished requests (suffix decoding's store) gets this
        batch's prompts + outputs, between calls: never inside a running batch."""
        observe = None if self.drafter is None else traits(self.drafter).observe
        if observe is None:
            return
        sequences = [list(ids) + r.token_ids for ids, r in zip(batch_ids, results)]
        self.drafter_params = observe(self.drafter_params, sequences)
        if self.plan is not None:
            self.drafter_params = self.plan.place_drafter(self.drafter_params)

    def stream(
        self,
        prompt: str | Sequence[int],
        *,
        max_new_tokens: int | None = None,
        sampling: Sampling | SamplingParams | None = None,
        seed: int | None = None,
        steps_per_chunk: int = 4,
    ) -> Generator[str, None, GenerationResult]:
        """Yield text pieces as they are generated (the jitted loop runs a few steps per chunk).

        The generator's return value (`StopIteration.value`) is the prompt's GenerationResult,
        with its metrics; its decode rate includes the host round trip after every chunk.
        Penalties are a `generate` feature: a Sampling with penalties is refused here."""
        sp, max_new_tokens, seed, penalties = resolve_sampling(sampling, max_new_tokens, seed, None)
        if penalties is not None:
            raise JaxspecError("Engine.stream applies no penalties or logit_bias: use "
                               "Engine.generate, or the server (jaxspec.serving) to stream them")
        ids = self.encode(prompt)
        self.check_fits(ids, max_new_tokens)
        compile_s = self._ensure_compiled([ids], max_new_tokens, sp, 1)  # not in the timings
        t0 = time.perf_counter()
        state = self.prefill([ids], max_new_tokens, sp, seed, [0], 1)
        jax.block_until_ready(state.tokens)
        t1 = time.perf_counter()
        shown = ""
        while True:
            tokens, length, done = jax.device_get((state.tokens[0], state.lengths[0], state.done[0]))
            check_tokens(tokens[len(ids) : length])
            text = self.decode_text(tokens[len(ids) : length].tolist())
            if (done or not text.endswith("\ufffd")) and len(text) > len(shown):  # hold back split UTF-8
                yield text[len(shown) :]
                shown = text
            if done:
                decode_s = time.perf_counter() - t1
                result = self.report.results(
                    [prompt], [ids], fetch(state, self.plan), t1 - t0, decode_s, self.compiled_attention
                )[0]
                result.metrics["compile_s"] = compile_s
                self._observe([ids], [result])
                return result
            state = self.decode(state, sp, steps_per_chunk)

    def prompt_logprobs(self, prompt: str | Sequence[int]) -> list[dict]:
        """The prompt's own tokens scored by the target (engine/prompt_scores.py): for tokens
        1..n-1, {"logprob", "top": [(id, logprob)] * 20}, raw log_softmax (what `echo` returns)."""
        ids = self.encode(prompt)
        self.check_fits(ids, 1)
        return prompt_scores.prompt_logprobs(self.model.target, self.model.params, ids,
                                             capacity=self.max_context, call=self._call)

    # ---- results (results.Report): what the serving scheduler reuses ------------------------
    def row_metrics(self, state, row: int, num_generated: int) -> dict[str, Any]:
        """(fetched state, row, num_generated) -> the metrics dict."""
        return self.report.row_metrics(state, row, num_generated, self.compiled_attention)

    def decode_text(self, token_ids: list[int]) -> str:
        """Generated ids -> text (EOS dropped, special tokens skipped)."""
        return self.report.decode_text(token_ids)


def resolve_sampling(sampling, max_new_tokens, seed, penalties):
    """(device params, max_new_tokens, seed, penalties) of one engine call. A `Sampling` fills
    what the call's own arguments leave None (its max_tokens, seed, penalties and logit_bias);
    its stop strings and logprobs belong to the server and the engine's construction, refused
    here in one line. `SamplingParams` (the device arrays) is still taken as it is."""
    if isinstance(sampling, Sampling):
        if sampling.stop or sampling.stop_token_ids:
            raise JaxspecError("Sampling.stop / stop_token_ids are applied by the server "
                               "(jaxspec.serving): Engine.generate ends a row at EOS or max_tokens")
        if sampling.logprobs is not None:
            raise JaxspecError("Sampling.logprobs is a request field of the server: give the "
                               "engine Engine(..., logprobs=k) instead")
        if penalties is None and not penalties_lib.is_off(sampling.penalties):
            penalties = sampling.penalties
        max_new_tokens = sampling.max_tokens if max_new_tokens is None else max_new_tokens
        seed = (sampling.seed or 0) if seed is None else seed
        sampling = sampling.device_params()
    sp = sampling if sampling is not None else SamplingParams.make()
    return sp, 128 if max_new_tokens is None else max_new_tokens, seed or 0, penalties


def check_engine_args(model, drafter, drafter_params, num_speculative_tokens, max_context,
                      logprobs, logprobs_mode) -> None:
    """Refuse, in one line each and before anything compiles: γ out of range, taps or traits the
    target lacks, a bad logprobs setting, a context too small or beyond the model's."""
    if drafter is not None and not 1 <= num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
        raise JaxspecError(
            f"num_speculative_tokens={num_speculative_tokens} is out of range: "
            f"use 1..{MAX_SPECULATIVE_TOKENS}"
        )
    if drafter is not None:  # taps and traits this target lacks: refused before compiling
        check_target(drafter, model.target, drafter_params)
    check_logprobs(logprobs, logprobs_mode)
    if max_context is not None and max_context < 2 + num_speculative_tokens:
        raise JaxspecError(
            f"max_context={max_context} is too small: use at least {2 + num_speculative_tokens}"
        )
    limit = model.target.max_position_embeddings
    if max_context is not None and max_context > limit:
        raise JaxspecError(
            f"generation.max_context={max_context} exceeds the model's context of {limit} "
            f"tokens: use at most {limit}"
        )


def check_logprobs(k, mode: str) -> None:
    """A one-line JaxspecError naming the fix for a bad logprobs setting."""
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= 20):
        raise JaxspecError(f"logprobs={k!r} is invalid: use an integer in 0..20 (top alternatives), "
                           "or None for no logprobs")
    if mode not in logprobs_lib.MODES:
        raise JaxspecError(f"logprobs_mode={mode!r} is unknown: use one of "
                           f"{', '.join(logprobs_lib.MODES)}")
def _per_prompt(constraint, n: int) -> list:
    """A constraint for every prompt, or a list of one per prompt (None entries: free)."""
    if constraint is None or not isinstance(constraint, (list, tuple)):
        return [constraint] * n
    if len(constraint) != n:
        raise JaxspecError(f"{len(constraint)} constraints for {n} prompts: pass one per prompt, or one for all")
    return list(constraint)
