"""The config's sections: one frozen keyword-only dataclass each, checked on construction."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Literal

import yaml

from jaxspec.errors import JaxspecError
from jaxspec.limits import MAX_SPECULATIVE_TOKENS, sampling_problem
from jaxspec.options import Section, as_dict
from jaxspec.decode.adaptive.settings import AdaptiveConfig  # noqa: F401 (jax-free; re-exported)

MAX_NGRAM = 16  # same bound as jaxspec.drafters.prompt_lookup
MAX_TREE_NODES = 63  # window of 1 + nodes <= the CPU attention kernel's 64 queries


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelLoadConfig(Section):
    SECTION: ClassVar[str] = "model"
    # short name, HF safetensors dir, .gguf file, or Hub id org/name[@revision][/FILE.gguf]
    name: str = "smollm2-135m"
    # auto: bfloat16 on TPU/GPU, float32 on CPU
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # auto: "packed" (CPU panel kernel) for float32 on one CPU device, "stacked" on TPU, else
    # "fused" on GPU (per-layer weights, q/k/v and gate/up fused: models/fused_layout.py);
    # "unrolled" = per-layer arrays; "stacked" = [L, ...], lax.scan
    layout: Literal["auto", "unrolled", "packed", "stacked", "fused"] = "auto"

    def _validate(self):
        if not self.name.strip():
            self._fail("name", "give a short name (smollm2-135m), an HF dir, a .gguf file or a "
                       "Hub id (org/name)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingConfig(Section):
    SECTION: ClassVar[str] = "sampling"
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    min_p: float = 0.0  # 0.0 = off
    seed: int = 0  # PRNG seed of the sampling (rows draw independent streams)

    def _validate(self):
        problem = sampling_problem(self.temperature, self.top_k, self.top_p, self.min_p)
        if problem is not None:
            self._fail(*problem)
        if not 0 <= self.seed < 2**32:
            self._fail("seed", "use an integer in 0..2**32-1")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerationConfig(Section):
    SECTION: ClassVar[str] = "generation"
    max_new_tokens: int = 128  # tokens generated per prompt at most (EOS ends a row earlier)
    batch_size: int = 1  # rows per jitted batch; the last batch is padded
    chat_template: bool = True  # wrap each prompt as a user turn of the model's chat template
    system_prompt: str | None = None  # the chat template's system turn; null: its default
    # KV cache slots per row, fixed for the engine: one decode program per batch size, whatever the
    # prompt length (0: sized per request from the prompt and max_new_tokens buckets)
    max_context: int = 0
    # record the emitted tokens' logprobs with this many top alternatives (0..20; null: none,
    # no logprob code compiled); a server answers logprobs requests up to it (null there: 20,
    # recorded always and sent where a request asks, so no request compiles a program)
    logprobs: int | None = None
    # raw: log_softmax of the model's logits; processed: of the law sampled from (penalties,
    # logit_bias, temperature, filters)
    logprobs_mode: Literal["raw", "processed"] = "raw"

    def _validate(self):
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            self._fail("logprobs", "use null (off) or an integer in 0..20")
        if self.max_new_tokens < 1:
            self._fail("max_new_tokens", "use an integer >= 1")
        if self.max_context < 0:
            self._fail("max_context", "use 0 (per request) or the cache slots per row, e.g. 2048")
        if self.batch_size < 1:
            self._fail("batch_size", "use an integer >= 1")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LookupConfig(Section):
    """Prompt lookup first (jaxspec/drafters/prompt_lookup_first.py), for any drafting method but ngram: where
    the last n committed tokens (min_ngram <= n <= max_ngram) occur earlier in the context, verify
    what followed them instead of the method's draft."""

    SECTION: ClassVar[str] = "speculative.lookup"
    min_ngram: int = 0  # 0: off
    max_ngram: int = 3  # longest suffix looked up

    def _validate(self):
        if not 1 <= self.max_ngram <= MAX_NGRAM:
            self._fail("max_ngram", f"use 1..{MAX_NGRAM}")
        if self.min_ngram and not 1 <= self.min_ngram <= self.max_ngram:
            self._fail("min_ngram", f"use 0 (off) or 1..max_ngram ({self.max_ngram})")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TreeConfig(Section):
    """Draft trees (see jaxspec/decode/tree.py): the target verifies several candidates per depth."""

    SECTION: ClassVar[str] = "speculative.tree"
    kind: Literal["chain", "static", "dynamic"] = "chain"  # chain: no tree; which kinds: per method
    # static, medusa: Medusa-style paths of ranks, e.g. [[0], [1], [0, 0]] (YAML list or string)
    choices: str | list | None = None
    branches: int = 3  # static, ngram: distinct continuations of the context's matches
    depth: int = 4  # static ngram: nodes per branch; dynamic: levels
    top_k: int = 4  # dynamic: nodes expanded per level, children per expanded node
    budget: int = 16  # dynamic: nodes kept (best path scores)
    # dynamic: how a node's children are drawn (jaxspec.decode.tree.grow): its top-k tokens, i.i.d.
    # samples, or samples without replacement (best acceptance at temperature > 0)
    children: Literal["top_k", "sampled", "without_replacement"] = "top_k"

    def _validate(self):
        if isinstance(self.choices, str):
            try:
                parsed = yaml.safe_load(self.choices)
            except yaml.YAMLError:
                parsed = self.choices
            object.__setattr__(self, "choices", parsed)
        if self.choices is not None:
            from jaxspec.decode.tree import check_choices  # jax: only when a tree is configured

            try:
                paths = check_choices(self.choices)
            except JaxspecError as e:
                raise JaxspecError(f"{self.SECTION}.choices: {e}") from None
            if len(paths) > MAX_TREE_NODES:
                self._fail("choices", f"use at most {MAX_TREE_NODES} nodes")
            object.__setattr__(self, "choices", [list(p) for p in paths])
        for key in ("branches", "depth", "top_k", "budget"):
            if getattr(self, key) < 1:
                self._fail(key, "use an integer >= 1")
        if self.branches * self.depth > MAX_TREE_NODES:
            self._fail("branches", f"branches x depth must be <= {MAX_TREE_NODES}")
        if self.kind == "dynamic":
            most = self.top_k + (self.depth - 1) * self.top_k**2
            if not self.budget <= min(most, MAX_TREE_NODES):
                self._fail("budget", f"use 1..{min(most, MAX_TREE_NODES)} (top_k + (depth-1)*top_k^2 "
                           f"candidates, at most {MAX_TREE_NODES})")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpeculativeConfig(Section):
    SECTION: ClassVar[str] = "speculative"
    method: str = "none"  # "none" (plain decoding) or a registered drafter method
    num_speculative_tokens: int = 4  # γ: draft tokens verified per target forward
    # the method's options (an instance of the options class it registered; YAML: the
    # speculative.<method> subsection); None: its defaults
    options: object = None
    lookup: LookupConfig = dataclasses.field(default_factory=LookupConfig)
    tree: TreeConfig = dataclasses.field(default_factory=TreeConfig)
    adaptive: AdaptiveConfig = dataclasses.field(default_factory=AdaptiveConfig)

    @classmethod
    def subsections(cls) -> dict[str, type[Section]]:
        """lookup, tree, adaptive, then one per registered method that has options."""
        out = super().subsections()
        for name, method in _registry().DRAFTERS.items():
            if method.options is None:
                continue
            if name in out or name in ("method", "num_speculative_tokens", "options"):
                raise ValueError(f"drafter method '{name}' collides with the key speculative.{name}")
            out[name] = method.options
        return out

    @classmethod
    def leaf_keys(cls) -> list[str]:
        return ["method", "num_speculative_tokens"]  # options: the method's subsection

    @classmethod
    def from_sections(cls, fields: dict[str, Any], methods: dict[str, Any]) -> SpeculativeConfig:
        """`methods`: the method subsections read (each validated); the chosen one's are kept."""
        method = fields.get("method", "none")
        options = methods.get(method) if isinstance(method, str) else None
        if options is not None:  # a method composing another keeps that one's section
            options = options.with_sections(methods)
        return cls(**fields, options=options)

    def _validate(self):
        if self.method != "none":
            _registry().check_method(self.method)
            if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
                self._fail("num_speculative_tokens", f"use 1..{MAX_SPECULATIVE_TOKENS}")
        self._check_options()
        kind = self.tree.kind
        if self.adaptive.enabled and self.method == "none":
            raise JaxspecError(
                "speculative.adaptive.enabled needs a drafter: set speculative.method (e.g. ngram) "
                "or speculative.adaptive.enabled=false"
            )
        if self.lookup.min_ngram and self.method == "none":
            raise JaxspecError(
                "speculative.lookup adds prompt lookup to a drafter and method 'none' has none: "
                "set speculative.lookup.min_ngram=0 or choose a method"
            )
        if kind != "chain":
            kinds = () if self.method == "none" else _registry().get(self.method).tree_kinds
            if kind not in kinds:
                able = sorted(n for n, m in _registry().DRAFTERS.items() if kind in m.tree_kinds)
                raise JaxspecError(
                    f"speculative.tree.kind={kind} is supported by method {' or '.join(able)}, "
                    f"not '{self.method}': set speculative.tree.kind=chain or change "
                    "speculative.method"
                )
            if self.lookup.min_ngram:
                raise JaxspecError(
                    f"speculative.tree.kind={kind} does not combine with speculative.lookup: set "
                    "speculative.lookup.min_ngram=0 or speculative.tree.kind=chain"
                )
        if self.options is not None:
            self.options.check(self)

    def _check_options(self) -> None:
        want = None if self.method == "none" else _registry().get(self.method).options
        if self.options is None:
            if want is not None:
                object.__setattr__(self, "options", want())  # frozen: the method's defaults
        elif want is None or not isinstance(self.options, want):
            wanted = "none" if want is None else want.__name__
            raise JaxspecError(
                f"speculative.options={type(self.options).__name__}(...) does not fit method "
                f"'{self.method}' (its options: {wanted}): pass that method's options class"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig(Section):
    """Device mesh: `data` splits the batch, `model` the heads / mlp / vocabulary (tensor parallel).
    data * model <= the device count (checked when the engine is built); 1 x 1 = one device."""

    SECTION: ClassVar[str] = "mesh"
    data: int = 1  # devices the batch is split over
    model: int = 1  # devices heads, MLP and vocabulary are split over (divides the head count)
    shard_drafter: bool = False  # true: a draft model or EAGLE-style head follows the target's rules (default replicated)

    def _validate(self):
        for key in ("data", "model"):
            if getattr(self, key) < 1:
                self._fail(key, "use an integer >= 1")

    @property
    def size(self) -> int:
        return self.data * self.model


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedConfig(Section):
    """Multi-host: `jax.distributed.initialize` with these (unset ones from JAX_COORDINATOR_ADDRESS,
    JAX_NUM_PROCESSES, JAX_PROCESS_ID, or JAX's cluster detection: SLURM, Open MPI, TPU pods)."""

    SECTION: ClassVar[str] = "distributed"
    coordinator_address: str | None = None  # host:port of process 0
    num_processes: int | None = None  # processes in the run (all run the same command)
    process_id: int | None = None  # this process's rank, 0..num_processes-1

    def _validate(self):
        if self.num_processes is not None and self.num_processes < 1:
            self._fail("num_processes", "use an integer >= 1")
        if self.process_id is not None:
            if self.process_id < 0:
                self._fail("process_id", "use an integer >= 0 (0 = the coordinator)")
            if self.num_processes is not None and self.process_id >= self.num_processes:
                raise JaxspecError(
                    f"distributed.process_id={self.process_id} is invalid: "
                    f"use 0..{self.num_processes - 1} (num_processes={self.num_processes})"
                )
        addr = self.coordinator_address
        if addr is not None and not (addr.rpartition(":")[0] and addr.rpartition(":")[2].isdigit()):
            self._fail("coordinator_address", "use host:port, e.g. 10.0.0.1:1234")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServingConfig(Section):
    """Continuous batching (jaxspec/serving, `python -m jaxspec.serve`)."""

    SECTION: ClassVar[str] = "serving"
    slots: int = 4  # rows the decode program runs over (requests in flight)
    max_context: int = 1024  # KV slots a request may use (prompt + max_tokens + γ + 1)
    steps_per_call: int = 8  # decode steps per device call (admission happens between calls)
    max_queue: int = 64  # queued requests beyond which a submit is refused (HTTP 429)
    kv_pages: int = 0  # pages in the KV pool (0: slots * max_context / page_size)
    page_size: int = 16  # KV slots per page
    prefill_chunk: int = 0  # prompts longer than this go in chunks, one per device call (0: whole)
    prefix_cache: bool = True  # share KV pages of common prompt prefixes (paged, no target taps)
    # prefill the requests admitted in one round several rows a call (and prompt chunks likewise)
    batch_prefill: bool = False
    # prompt tokens prefilled per round at most (batched admission; longer prompts go in chunks
    # across rounds); 0: no budget
    max_batched_tokens: int = 0
    # scheduling policy (jaxspec/serving/policy.py): fcfs, priority (Request.priority), prefix
    # (longest cached prompt prefix first)
    policy: str = "fcfs"
    precompile: bool = True  # python -m jaxspec.serve, once listening, loads or compiles every program it calls (decode shapes, every prompt bucket) before /ready
    # structured output (response_format, tools, guided_*): every serving program carries a
    # grammar table (16 MB) and the mask, run only in steps with a constrained row
    # (docs/structured.md); off: such requests get a one-line 400
    structured: bool = True
    max_body_bytes: int = 1048576  # a larger request body gets HTTP 413
    max_prompt_tokens: int = 0  # a longer prompt gets HTTP 400 (0: what max_context allows)
    max_tokens_limit: int = 0  # a request's max_tokens above this gets HTTP 400 (0: no ceiling)
    request_timeout_s: float = 600.0  # a request still running after this ends, "length" (0: none)
    drain_s: float = 30.0  # on SIGTERM/SIGINT, running requests get this long, then "abort"

    def _validate(self):
        for name in ("slots", "max_context", "steps_per_call", "max_queue", "page_size"):
            if getattr(self, name) < 1:
                self._fail(name, "use an integer >= 1")
        if self.kv_pages < 0:
            self._fail("kv_pages", "use 0 (sized from slots and max_context) or a page count")
        if self.prefill_chunk < 0:
            self._fail("prefill_chunk", "use 0 (whole prompts) or a chunk of tokens >= 1")
        if self.max_batched_tokens < 0:
            self._fail("max_batched_tokens", "use 0 (no budget) or a token count >= 1")
        for name in ("max_body_bytes",):
            if getattr(self, name) < 1:
                self._fail(name, "use an integer >= 1")
        for name in ("max_prompt_tokens", "max_tokens_limit"):
            if getattr(self, name) < 0:
                self._fail(name, "use 0 (no ceiling) or a token count >= 1")
        for name in ("request_timeout_s", "drain_s"):
            if getattr(self, name) < 0:
                self._fail(name, "use 0 or a number of seconds > 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class StructuredConfig(Section):
    """Structured output for `python -m jaxspec.generate` (docs/structured.md): at most one of a
    JSON Schema, any JSON object, a regex, or a list of choices; every prompt's output follows it."""

    SECTION: ClassVar[str] = "structured"
    json_schema: str | dict | None = None  # a JSON Schema (a YAML mapping, or JSON text)
    json_object: bool = False  # any JSON object
    regex: str | None = None  # the output matches this regex in full
    choice: str | list | None = None  # the output is one of these strings (a YAML list)

    def _validate(self):
        if isinstance(self.choice, str):  # an override's list arrives as text
            try:
                object.__setattr__(self, "choice", yaml.safe_load(self.choice))
            except yaml.YAMLError:
                self._fail("choice", "use a YAML list of strings, e.g. [yes, no]")
        given = [k for k in ("json_schema", "regex", "choice") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) > 1:
            self._fail(given[1], f"set only one of json_schema, json_object, regex, choice (also set: {given[0]})")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            self._fail("choice", "use a non-empty list of strings")

    def constraint(self):
        """The constrain.Constraint (None: unconstrained); a one-line JaxspecError naming an
        unsupported schema keyword."""
        from jaxspec.constrain.host import make_constraint  # imported when a config asks for one

        return make_constraint(json_schema=self.json_schema, json_object=self.json_object,
                               regex=self.regex, choice=self.choice)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    model: ModelLoadConfig = dataclasses.field(default_factory=ModelLoadConfig)
    sampling: SamplingConfig = dataclasses.field(default_factory=SamplingConfig)
    generation: GenerationConfig = dataclasses.field(default_factory=GenerationConfig)
    speculative: SpeculativeConfig = dataclasses.field(default_factory=SpeculativeConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
    serving: ServingConfig = dataclasses.field(default_factory=ServingConfig)
    structured: StructuredConfig = dataclasses.field(default_factory=StructuredConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """The config in the YAML layout (the method's options under speculative.<method>)."""
        out = as_dict(self)
        spec = out["speculative"]
        options = spec.pop("options")
        if options is not None:
            spec[self.speculative.method] = options
        return out


SECTIONS: dict[str, type[Section]] = {
    f.name: f.default_factory for f in dataclasses.fields(Config)  # type: ignore[misc]
}

def _registry():
    """The drafter registry (jaxspec.drafters imports jax: read only when a method is named)."""
    from jaxspec.drafters import registry  # jax: only when a method is named

    return registry
