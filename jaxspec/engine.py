"""Host side of generation: tokenise, bucket, batch, run the jitted programs, time, report.

    engine = Engine(model)                          # plain decoding
    engine = Engine(model, drafter, num_speculative_tokens=4)
    results = engine.generate(["Hi!"], max_new_tokens=64)
    for piece in engine.stream("Tell me a story"): print(piece, end="")
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
import time
import types
from collections.abc import Generator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import adaptive as adaptive_mod
from jaxspec import calibration, hlo, progress, sharding, speculate, xla_cache
from jaxspec.drafters.base import check_target, traits
from jaxspec.errors import JaxspecError
from jaxspec.limits import MAX_SPECULATIVE_TOKENS, check_cache_fits
from jaxspec.loading.tokenizer import encode_prompt
from jaxspec.models import attention, base
from jaxspec.sampling import SamplingParams, check_tokens

MIN_PROMPT_BUCKET = 16
REPROBE_BATCHES = 8  # adaptive: a switched-off engine re-measures acceptance every 8th batch


@dataclasses.dataclass
class GenerationResult:
    prompt: str
    text: str
    token_ids: list[int]  # generated tokens only
    num_prompt_tokens: int
    num_generated_tokens: int
    time_to_first_token_s: float
    decode_tokens_per_s: float
    metrics: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def bucket(n: int, minimum: int = MIN_PROMPT_BUCKET) -> int:
    """Round up to a power of two (at least `minimum`): few shapes, so few compilations."""
    size = minimum
    while size < n:
        size *= 2
    return size


class Engine:
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
        adaptive: adaptive_mod.Options | None = None,
    ):
        xla_cache.enable()  # on by default, as in the CLI (JAXSPEC_XLA_CACHE=0: off)
        if drafter is None:
            num_speculative_tokens = 0
        elif not 1 <= num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise JaxspecError(
                f"num_speculative_tokens={num_speculative_tokens} is out of range: "
                f"use 1..{MAX_SPECULATIVE_TOKENS}"
            )
        if drafter is not None:  # taps and traits this target lacks: refused before compiling
            check_target(drafter, model.target, drafter_params)
        self.plan = None
        if mesh is not None:
            self.plan = mesh if isinstance(mesh, sharding.MeshPlan) else sharding.MeshPlan(mesh)
            model = dataclasses.replace(
                model, params=self.plan.place_target(model.params, model.target)
            )
            t = traits(drafter) if drafter is not None else None
            own_layer, own_model = (None, None) if t is None else (t.model_cfg, t.model)
            drafter_params = self.plan.place_drafter(drafter_params, own_layer, own_model)
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
        self.max_context = max_context  # fixed cache slots per row (None: per request)
        self.model = model
        self.drafter = drafter
        self.drafter_params = drafter_params
        self.chat_template = chat_template
        self.system_prompt = system_prompt
        self._warm_shapes: set[tuple[int, int, int, str, bool]] = set()
        self.compiled_attention: dict[str, str] = {}  # the last run shape's, per program
        self._attention_by_shape: dict[tuple, dict[str, str]] = {}
        self.adaptive = adaptive if drafter is not None else None
        # adaptive: a chain's length, or the depth a tree is cut to (its levels)
        depth = (traits(drafter).tree_depth if drafter is not None else None) or num_speculative_tokens
        self.spec = speculate.LoopSpec(
            target=model.target,
            drafter=drafter,
            num_speculative_tokens=num_speculative_tokens,
            eos_ids=tuple(model.eos_token_ids),
            # prompt lookup with no or a 1-token match: a cheaper, shorter window (and the widths
            # a drafter of widely varying lengths asks for, suffix decoding's)
            windows=(1, 2, *(traits(drafter).verify_windows if drafter is not None else ())),
            mesh=self.plan,
            adaptive=None if self.adaptive is None else self.adaptive.controller(depth),
        )
        # adaptive switch-off: a batch size where verification cannot pay runs this program
        self._plain_spec = speculate.LoopSpec(
            target=model.target, drafter=None, num_speculative_tokens=0, eos_ids=tuple(model.eos_token_ids),
            mesh=self.plan,
        )
        self._costs: dict[int, dict[int, list[float]]] = {}
        # per-position acceptance (accepted / reached), halved into the previous value after
        # each adaptive batch (None: none yet; starts from switch_off_acceptance)
        self.observed_acceptance: list[float] | None = None
        self._off_batches = 0  # batches run switched off (every REPROBE_BATCHES-th re-measures)
        # batch size -> (window_hist, decode tokens per row) of the last adaptive batch of that
        # size; "any": of the last adaptive batch of any size (priced with this size's costs)
        self.last_runs: dict[int | str, tuple[list[int], list[int], float]] = {}

    @property
    def method(self) -> str:
        return "plain" if self.drafter is None else self.drafter.name

    def model_note(self) -> str | None:
        """A warning worth printing about the target's layout: "auto" fell back from the CPU
        kernels, so greedy output is no longer bit-identical across batch and window sizes."""
        note = getattr(self.model, "layout_note", "")
        if note.startswith("auto fell back"):
            return f"layout {base.layout(self.model.target, self.model.params)} ({note})"
        return None

    # ---- prompts -------------------------------------------------------------------------
    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if not isinstance(prompt, str):
            try:
                return [operator.index(t) for t in prompt]
            except TypeError:
                raise JaxspecError(
                    "a token-id prompt must be a sequence of integers: pass text as a str"
                ) from None
        tok = self.model.tokenizer
        if tok is None:
            raise JaxspecError(
                f"model {getattr(self.model, 'name', '')!r} has no tokenizer, so it cannot take text "
                f"prompts: add the tokenizer files to its directory or pass token ids"
            )
        if self.chat_template and getattr(tok, "chat_template", None):
            messages = [{"role": "user", "content": prompt}]
            if self.system_prompt:
                messages.insert(0, {"role": "system", "content": self.system_prompt})
            return encode_prompt(tok, prompt, messages)
        return encode_prompt(tok, prompt)

    def _capacity(self, prompt_bucket: int, max_new_tokens: int) -> int:
        return self.capacity(prompt_bucket, max_new_tokens)

    def capacity(self, prompt_bucket: int, max_new_tokens: int, backend: str | None = None) -> int:
        """KV-cache slots of a batch with prompts padded to `prompt_bucket`: max_context, else the
        prompt bucket + bucket(max_new_tokens) + the window's nodes + 1; on TPU/GPU (`backend`,
        default JAX's) rounded up to what the attention kernels take (attention.kernel_capacity)."""
        if self.max_context is not None:  # one capacity: decode compiles once per batch size
            need = max(self.max_context, prompt_bucket)
        else:
            need = prompt_bucket + bucket(max_new_tokens) + self.spec.num_nodes + 1
        return attention.kernel_capacity(need, backend)

    def _check_fits(self, ids: list[int], max_new_tokens: int) -> None:
        limit, whose = self.model.target.max_position_embeddings, "model's"
        draft_limit = None if self.drafter is None else traits(self.drafter).max_context
        if draft_limit is not None and draft_limit < limit:
            limit, whose = draft_limit, "draft model's"
        if not ids:
            raise JaxspecError("empty prompt: give at least one token")
        vocab = self.model.target.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:  # the embedding lookup would clamp it silently
            raise JaxspecError(
                f"prompt token id {bad} is out of range: this model's vocabulary has {vocab} "
                f"tokens (ids 0..{vocab - 1})"
            )
        need = len(ids) + max_new_tokens + self.spec.depth
        if self.max_context is not None and need + 1 > self.max_context:
            raise JaxspecError(
                f"prompt of {len(ids)} tokens + max_new_tokens={max_new_tokens} (+ γ + 1 = {need + 1}"
                f" slots) exceeds generation.max_context={self.max_context}: raise max_context, "
                f"shorten the prompt or lower max_new_tokens"
            )
        if need > limit:
            raise JaxspecError(
                f"prompt of {len(ids)} tokens + max_new_tokens={max_new_tokens} exceeds the "
                f"{whose} context of {limit} tokens: shorten the prompt or lower max_new_tokens"
            )

    # ---- adaptive speculation -------------------------------------------------------------
    def step_costs(self, batch: int) -> dict[int, list[float]]:
        """{fill: step cost with c = 0..γ draft nodes} at this batch size, rows holding `fill`
        committed tokens, in steps of the plain program; once per engine and batch size.
        Measured (no step_costs given, draft_cost "auto"): the adaptive loop's own step with c
        nodes, timed whole (`calibration.loop_costs`). Else the verify of 1 + c entries
        (measured per fill, or given) + the drafter's work with c nodes (measured per fill with
        draft_cost "auto", else draft_cost per node); with c = 0 a drafter with commit_plain
        runs the plain program's step itself (speculate.decode's plain loop): measured verify
        cost[0] is 1 there; others run one entry through the window path ("w1"). A given curve
        (one list) holds for every context (fill 0); a dict gives one per fill. A cached
        calibration whose plain step this machine no longer matches (`calibration.drifted`) is
        measured again."""
        if batch not in self._costs:
            opts = self.adaptive
            if opts.step_costs is None and opts.draft_cost == "auto":
                model, dparams = self.model, self.drafter_params
                again = opts.recalibrate or calibration.loop_drifted(model, self.spec, dparams, batch)
                costs = calibration.loop_costs(model, self.spec, dparams, batch, recalibrate=again)
            else:
                costs = self._summed_costs(batch)
            self._costs[batch] = {  # more nodes: never cheaper
                f: list(itertools.accumulate(curve, max)) for f, curve in sorted(costs.items())
            }
        return self._costs[batch]

    def _summed_costs(self, batch: int) -> dict[int, list[float]]:
        """step_costs from a verify curve (measured or given) + the drafter's work."""
        opts, g = self.adaptive, self.spec.adaptive.gamma
        src = opts.step_costs
        if src is None and self.spec.num_nodes != g:  # a verify curve by width: chains only
            raise JaxspecError(
                "adaptive trees are priced by the loop's own steps: set "
                "speculative.adaptive.draft_cost=auto or give step_costs (one per depth 0..D)"
            )
        # a calibration this machine has drifted away from is measured again (both curves)
        again = opts.recalibrate or (src is None and calibration.drifted(self.model, batch))
        if src is None:
            verify = calibration.step_costs(self.model, batch, g, recalibrate=again)
        else:
            verify = src(batch) if callable(src) else src
            verify = {int(f): list(c) for f, c in verify.items()} if isinstance(
                verify, dict) else {0: list(verify)}
        for curve in verify.values():
            if len(curve) != g + 1 or min(curve) <= 0:
                raise JaxspecError(
                    f"adaptive step_costs {curve!r} must be {g + 1} positive numbers (window "
                    f"1..{g + 1} entries): give one per window width"
                )
        if src is None and traits(self.drafter).commit_plain:  # c* = 0: decode's plain
            verify = {f: [1.0, *c[1:]] for f, c in verify.items()}  # loop, plain's own step
        if opts.draft_cost == "auto":
            draft = calibration.draft_costs(
                self.model, self.drafter, self.drafter_params, batch, g, recalibrate=again
            )
            if set(draft) != set(verify):  # given verify costs: the drafter's at each fill
                fills, rows = adaptive_mod.cost_table(draft)
                draft = {f: [float(np.interp(f, fills, col)) for col in zip(*rows)]
                         for f in verify}
        else:
            draft = {f: [k * float(opts.draft_cost) for k in range(g + 1)] for f in verify}
        return {f: [v + d for v, d in zip(curve, draft[f])] for f, curve in verify.items()}

    def spec_for(self, batch: int) -> speculate.LoopSpec:
        """The program a batch of this size runs: the plain one where the cost model says
        verification does not pay (load-aware switch-off), else the adaptive one.

        Up to adaptive.PER_REQUEST_MAX_BATCH rows (batch 1: the row is the request) only this
        size's cost curve decides, at `switch_off_acceptance`: whether speculation can pay on this
        machine at all. Acceptance belongs to the request, and the adaptive program's own
        plain-step branch costs about one plain step, so each request finds its own way in
        the loop (from the prior, re-probing); nothing an earlier request did carries over.
        Larger batches step in lockstep over rows of different requests, so the history of
        earlier batches decides too: the cost curve at the acceptance they measured
        (`observed_acceptance`; before any: `prior`, where the loop's estimates start -- a
        size whose curve gives no gain there would start the adaptive program on its plain
        loop, paying the drafter's bookkeeping and probes for nothing known), and the last
        adaptive batch of this size must have beaten plain by the cost model (`realized_gain`).
        Every REPROBE_BATCHES-th batch that would run plain runs adaptive instead, so the
        estimate can recover (the count restarts after it). The choice depends on earlier
        batches only: lossless."""
        if self.adaptive is None:
            return self.spec
        curves = self.step_costs(batch).values()  # per context: the loop reads the one it is at
        if batch <= adaptive_mod.PER_REQUEST_MAX_BATCH:
            acc = self.adaptive.switch_off_acceptance
            pays = max(adaptive_mod.best_gain(c, acc) for c in curves) > 1.0
        else:
            acc = self.observed_acceptance or self.adaptive.prior
            pays = max(adaptive_mod.best_gain(c, acc) for c in curves) > 1.0
            pays = pays and self.realized_gain(batch) > 1.0
        if pays:
            return self.spec
        return self.spec if (self._off_batches + 1) % REPROBE_BATCHES == 0 else self._plain_spec

    def realized_gain(self, batch: int) -> float:
        """The speedup over plain, by this size's cost model, of the steps the last adaptive batch
        of this size ran, each priced in the loop at its context (`AdaptiveState.spent`); before
        one of this size: the last of any size, its window histogram priced with this size's
        curve at the smallest fill; before any at all: 2.0, i.e. try."""
        if batch in self.last_runs:
            _, tokens, spent = self.last_runs[batch]
            return max(tokens, default=0) / spent if spent > 0 else 1.0
        run = self.last_runs.get("any")
        if run is None:
            return 2.0
        curve = next(iter(self.step_costs(batch).values()))
        return adaptive_mod.realized_gain(curve, run[0], run[1])

    # ---- running -------------------------------------------------------------------------
    def _prefill_args(self, batch_ids, max_new_tokens, sp, seed, row_ids, batch_size):
        """(the prefill program's positional arguments, its capacity) for this batch."""
        b = max(batch_size, len(batch_ids))
        p = bucket(max(len(ids) for ids in batch_ids))
        prompt = np.zeros((b, p), np.int32)
        lengths = np.ones((b,), np.int32)
        for i, ids in enumerate(batch_ids):
            prompt[i, : len(ids)] = ids
            lengths[i] = len(ids)
        max_new = np.full((b,), max_new_tokens, np.int32)
        max_new[len(batch_ids) :] = 1  # padding rows finish at once
        rows = np.zeros((b,), np.int32)
        rows[: len(row_ids)] = row_ids
        key = jax.random.key(seed)
        if self.plan is not None:  # rows over the data axis (each process its own rows)
            put, sp, key = self.plan.put_batch, self.plan.put_replicated(sp), self.plan.put_replicated(key)
        else:
            put = jnp.asarray
        args = (self.spec_for(b), self.model.params, self.drafter_params, put(prompt),
                put(lengths), put(max_new), sp, key, put(rows))
        return args, self._capacity(p, max_new_tokens)

    def _with_adaptive(self, state):
        """The adaptive controller's state, when this batch's program adapts."""
        adaptive = self.spec_for(state.lengths.shape[0]).adaptive
        if adaptive is None:
            return state
        b = state.lengths.shape[0]
        return dataclasses.replace(state, adaptive=adaptive.init(b, self.step_costs(b)))

    def _prefill(self, batch_ids, max_new_tokens, sp, seed, row_ids, batch_size):
        args, capacity = self._prefill_args(batch_ids, max_new_tokens, sp, seed, row_ids, batch_size)
        return self._with_adaptive(speculate.prefill_jit(*args, capacity=capacity))

    def _decode_args(self, state, sp, max_steps: int):
        spec = self.spec_for(state.lengths.shape[0])
        steps = jnp.int32(max_steps)
        if self.plan is not None:
            sp, steps = self.plan.put_replicated((sp, steps))
        return spec, self.model.params, self.drafter_params, state, sp, steps

    def _decode(self, state, sp, max_steps: int):
        return speculate.decode_jit(*self._decode_args(state, sp, max_steps))

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        *,
        max_new_tokens: int = 128,
        sampling: SamplingParams | None = None,
        seed: int = 0,
        batch_size: int = 1,
    ) -> list[GenerationResult]:
        """Generate for every prompt, `batch_size` rows at a time (the last batch is padded)."""
        if max_new_tokens < 1:
            raise JaxspecError(f"max_new_tokens={max_new_tokens} must be at least 1")
        if batch_size < 1:
            raise JaxspecError(f"batch_size={batch_size} must be at least 1")
        sp = sampling if sampling is not None else SamplingParams.make()
        encoded = [self.encode(p) for p in prompts]
        for ids in encoded:
            self._check_fits(ids, max_new_tokens)
        results: list[GenerationResult] = []
        for start in range(0, len(prompts), batch_size):
            chunk = list(range(start, min(start + batch_size, len(prompts))))
            results += self._run_batch(
                [prompts[i] for i in chunk], [encoded[i] for i in chunk], chunk,
                max_new_tokens, sp, seed, batch_size,
            )
        return results

    def _ensure_compiled(self, batch_ids, max_new_tokens, sp, batch_size) -> float:
        """Compile the programs for this shape ahead of time (lowered on the batch's arguments,
        the decode program on the prefill's abstract output: nothing runs), so timings exclude
        compilation. Returns the seconds spent; 0.0 when this shape was already warm."""
        b = max(batch_size, len(batch_ids))
        plain = self.spec_for(b) is self._plain_spec
        key = (b, bucket(max(len(ids) for ids in batch_ids)), bucket(max_new_tokens), sp.mode, plain)
        if key in self._warm_shapes:
            self.compiled_attention = self._attention_by_shape[key]
            return 0.0
        t0 = time.perf_counter()
        capacity = self._capacity(bucket(max(len(ids) for ids in batch_ids)), max_new_tokens)
        check_cache_fits(self.model.target, self.model.params, b, capacity)  # before any buffer of that size exists
        compiling = progress.compiling(b, self.method)
        args, capacity = self._prefill_args(batch_ids, max_new_tokens, sp, 0, list(range(len(batch_ids))), b)
        lowered = speculate.prefill_jit.lower(*args, capacity=capacity)
        prefill_attention = hlo.compiled_attention(lowered.as_text())
        shardings = lowered.compile().output_shardings
        state = jax.tree.map(  # on one device the real call's arrays are uncommitted: no sharding
            lambda s, where: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=where if self.plan else None),
            lowered.out_info, shardings,
        )
        decode = speculate.decode_jit.lower(*self._decode_args(self._with_adaptive(state), sp, 1))
        decode.compile()
        # what the programs hold (their custom calls), not what a setting asked for
        self.compiled_attention = {"prefill": prefill_attention,
                                   "decode": hlo.compiled_attention(decode.as_text())}
        self._attention_by_shape[key] = self.compiled_attention
        self._warm_shapes.add(key)
        compiling()
        return time.perf_counter() - t0

    def warmup(self, prompt, *, max_new_tokens=128, sampling=None, batch_size=1) -> float:
        """Compile the programs a request of this shape needs; returns the seconds it took."""
        sp = sampling if sampling is not None else SamplingParams.make()
        return self._ensure_compiled([self.encode(prompt)], max_new_tokens, sp, batch_size)

    def _run_batch(self, prompts, batch_ids, row_ids, max_new_tokens, sp, seed, batch_size):
        compile_s = self._ensure_compiled(batch_ids, max_new_tokens, sp, batch_size)
        t0 = time.perf_counter()
        state = self._prefill(batch_ids, max_new_tokens, sp, seed, row_ids, batch_size)
        jax.block_until_ready(state.tokens)
        t1 = time.perf_counter()
        state = self._decode(state, sp, 1 << 30)
        jax.block_until_ready(state.tokens)
        t2 = time.perf_counter()
        state = self._fetch(state)
        results = self._results(prompts, batch_ids, state, t1 - t0, t2 - t1)
        if self.adaptive is not None:
            if state.adaptive is None:
                self._off_batches += 1
            else:  # per position: accepted / reached over the batch's real rows and steps
                self._off_batches = 0  # a re-probe starts the count again (else every batch
                # after it would re-probe)
                n = len(batch_ids)
                reached = np.asarray(state.adaptive.reached[:n]).sum(axis=0)
                hits = np.asarray(state.adaptive.hits[:n]).sum(axis=0)
                prev = self.observed_acceptance or [self.adaptive.switch_off_acceptance] * len(hits)
                self.observed_acceptance = [  # averaged with earlier batches: one prompt
                    0.5 * (p + h / r) if r else p for h, r, p in zip(hits, reached, prev)
                ]  # without a single match must not switch speculation off for the next
                tokens = [r.num_generated_tokens - 1 for r in results]  # decode steps' tokens
                hist = np.asarray(state.adaptive.window_hist).tolist()
                run = (hist, tokens, float(state.adaptive.spent))
                self.last_runs[state.lengths.shape[0]] = self.last_runs["any"] = run
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

    def _fetch(self, state):
        """The fields results read, as numpy (gathered from every process when sharded)."""
        names = ("tokens", "lengths", "row_steps", "num_draft", "num_accepted", "accepted_per_position")
        fields = {n: getattr(state, n) for n in names}
        if getattr(state, "adaptive", None) is not None:  # the adaptive controller's statistics
            fields["adaptive"] = state.adaptive
        fetched = jax.device_get(fields) if self.plan is None else sharding.fetch(fields)
        return types.SimpleNamespace(**({"adaptive": None} | fetched))

    def _results(self, prompts, batch_ids, state, ttft, decode_s) -> list[GenerationResult]:
        out = []
        for i, (prompt, ids) in enumerate(zip(prompts, batch_ids)):
            gen = state.tokens[i, len(ids) : state.lengths[i]].tolist()
            check_tokens(gen)
            text = self._decode_text(gen)
            n = len(gen)
            out.append(
                GenerationResult(
                    prompt=prompt if isinstance(prompt, str) else "",
                    text=text,
                    token_ids=gen,
                    num_prompt_tokens=len(ids),
                    num_generated_tokens=n,
                    time_to_first_token_s=ttft,
                    decode_tokens_per_s=(n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0,
                    metrics=self._metrics(state, i, n),
                )
            )
        return out

    def _decode_text(self, token_ids: list[int]) -> str:
        if self.model.tokenizer is None:  # raw token-id use (tests, research code)
            return ""
        kept = [t for t in token_ids if t not in self.model.eos_token_ids]
        return self.model.tokenizer.decode(kept, skip_special_tokens=True)

    def _metrics(self, state, row: int, num_generated: int) -> dict[str, Any]:
        g = self.spec.num_speculative_tokens
        depth = self.spec.depth
        steps = int(state.row_steps[row]) - 1  # decode forwards (prefill excluded)
        drafted = int(state.num_draft[row])
        accepted = int(state.num_accepted[row])
        per_pos = state.accepted_per_position[row, :depth].tolist() if depth else []
        per_pos += [0] * (depth - len(per_pos))  # a switched-off batch ran the plain program
        out = {} if self.adaptive is None else self._adaptive_metrics(state, row, steps)
        return out | {
            "method": self.method,
            "layout": base.layout(self.model.target, self.model.params),
            "layout_note": getattr(self.model, "layout_note", ""),
            # read from the compiled programs (jaxspec.hlo.compiled_attention): xla / pallas_tpu /
            # pallas_gpu / cpu kernels; decode (and verify) and prefill
            "attention": self.compiled_attention.get("decode", ""),
            "attention_prefill": self.compiled_attention.get("prefill", ""),
            "num_speculative_tokens": g,
            "tree_nodes": self.spec.num_nodes,  # window entries verified after the root
            "nodes_per_step": drafted / steps if steps else 0.0,
            "num_steps": steps,
            "num_draft_tokens": drafted,
            "num_accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_accepted_length": (num_generated - 1) / steps if steps else 1.0,
            "accepted_per_position": [c / steps if steps else 0.0 for c in per_pos],
        }

    def _adaptive_metrics(self, state, row: int, steps: int) -> dict[str, Any]:
        g = self.spec.adaptive.gamma  # a chain's length, a tree's depth
        if state.adaptive is None:  # switched off: every step plain
            hist, plain = [steps] + [0] * g, steps
        else:
            hist, plain = state.adaptive.length_hist[row], state.adaptive.plain_steps[row]
        handoff = -1 if state.adaptive is None else int(state.adaptive.handoff_at)
        return {"adaptive_switched_off": state.adaptive is None,
                "adaptive_handoff_step": handoff} | adaptive_mod.summarize(hist, plain, steps)

    def stream(
        self,
        prompt: str | Sequence[int],
        *,
        max_new_tokens: int = 128,
        sampling: SamplingParams | None = None,
        seed: int = 0,
        steps_per_chunk: int = 4,
    ) -> Generator[str, None, GenerationResult]:
        """Yield text pieces as they are generated (the jitted loop runs a few steps per chunk).

        The generator's return value (`StopIteration.value`) is the prompt's GenerationResult,
        with its metrics; its decode rate includes the host round trip after every chunk."""
        sp = sampling if sampling is not None else SamplingParams.make()
        ids = self.encode(prompt)
        self._check_fits(ids, max_new_tokens)
        compile_s = self._ensure_compiled([ids], max_new_tokens, sp, 1)  # not in the timings
        t0 = time.perf_counter()
        state = self._prefill([ids], max_new_tokens, sp, seed, [0], 1)
        jax.block_until_ready(state.tokens)
        t1 = time.perf_counter()
        shown = ""
        while True:
            tokens, length, done = jax.device_get((state.tokens[0], state.lengths[0], state.done[0]))
            check_tokens(tokens[len(ids) : length])
            text = self._decode_text(tokens[len(ids) : length].tolist())
            if (done or not text.endswith("\ufffd")) and len(text) > len(shown):  # hold back split UTF-8
                yield text[len(shown) :]
                shown = text
            if done:
                decode_s = time.perf_counter() - t1
                result = self._results([prompt], [ids], self._fetch(state), t1 - t0, decode_s)[0]
                result.metrics["compile_s"] = compile_s
                self._observe([ids], [result])
                return result
            state = self._decode(state, sp, steps_per_chunk)

    # the units the serving scheduler (jaxspec/serving) reuses, by their public names
    check_fits = _check_fits  # (ids, max_new_tokens): a one-line JaxspecError if it cannot run
    row_metrics = _metrics  # (fetched state, row, num_generated) -> the metrics dict
    decode_text = _decode_text  # generated ids -> text (EOS dropped, special tokens skipped)
