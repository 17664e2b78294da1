"""Run configuration: frozen keyword-only dataclasses; YAML files and dotted overrides fill them.

    cfg = load_config("configs/smollm2-135m-ngram.yaml", ["sampling.temperature=0.7"])
    cfg = Config(speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=4))

Every field is type-checked and range-checked on construction, so a Config built in Python is as
valid as one read from YAML. Every mistake is a one-line `JaxspecError` naming `section.key`.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml

from jaxspec.errors import JaxspecError
from jaxspec.limits import MAX_SPECULATIVE_TOKENS, sampling_problem

MAX_NGRAM = 16  # same bound as jaxspec.drafters.ngram
METHODS = ("none", "ngram", "draft_model", "layer_skip", "eagle", "eagle3", "medusa", "mtp")
Method = Literal["none", "ngram", "draft_model", "layer_skip", "eagle", "eagle3", "medusa", "mtp"]
# speculative.checkpoint_format (jaxspec.formats): auto = detected from meta.json / config.json
CheckpointFormat = Literal["auto", "jaxspec", "eagle3", "speculators", "medusa", "medusa_fd", "mtp"]


class _Section:
    """Shared checks. Subclasses set SECTION (the YAML key) and may add `_validate`."""

    SECTION: ClassVar[str] = ""

    def __post_init__(self):
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = _coerce(f"{self.SECTION}.{f.name}", getattr(self, f.name), hints[f.name])
            object.__setattr__(self, f.name, value)  # frozen: normalise int -> float in place
        self._validate()

    def _validate(self) -> None:
        pass

    def _fail(self, key: str, why: str) -> None:
        raise JaxspecError(f"{self.SECTION}.{key}={getattr(self, key)!r} is invalid: {why}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelLoadConfig(_Section):
    SECTION: ClassVar[str] = "model"
    name: str = "smollm2-135m"  # short name, HF safetensors dir, or .gguf file
    # auto: bfloat16 on TPU/GPU, float32 on CPU
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # auto: "packed" (CPU panel kernel) for float32 on one CPU device, "stacked" on TPU/GPU,
    # else "unrolled"; "stacked" = [L, ...] arrays for lax.scan
    layout: Literal["auto", "unrolled", "packed", "stacked"] = "auto"

    def _validate(self):
        if not self.name.strip():
            self._fail("name", "give a short name (smollm2-135m), an HF dir or a .gguf file")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingConfig(_Section):
    SECTION: ClassVar[str] = "sampling"
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    min_p: float = 0.0  # 0.0 = off
    seed: int = 0

    def _validate(self):
        problem = sampling_problem(self.temperature, self.top_k, self.top_p, self.min_p)
        if problem is not None:
            self._fail(*problem)
        if not 0 <= self.seed < 2**32:
            self._fail("seed", "use an integer in 0..2**32-1")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerationConfig(_Section):
    SECTION: ClassVar[str] = "generation"
    max_new_tokens: int = 128
    batch_size: int = 1  # rows per jitted batch; the last batch is padded
    chat_template: bool = True  # wrap each prompt as a user turn of the model's chat template
    system_prompt: str | None = None
    # KV cache slots per row, fixed for the engine: one decode program per batch size, whatever the
    # prompt length (0: sized per request from the prompt and max_new_tokens buckets)
    max_context: int = 0

    def _validate(self):
        if self.max_new_tokens < 1:
            self._fail("max_new_tokens", "use an integer >= 1")
        if self.max_context < 0:
            self._fail("max_context", "use 0 (per request) or the cache slots per row, e.g. 2048")
        if self.batch_size < 1:
            self._fail("batch_size", "use an integer >= 1")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpeculativeConfig(_Section):
    SECTION: ClassVar[str] = "speculative"
    method: Method = "none"
    num_speculative_tokens: int = 4  # γ: draft tokens verified per target forward
    min_ngram: int = 1  # ngram: shortest suffix to look up
    max_ngram: int = 3  # ngram: longest suffix to look up
    draft_model: str | None = None  # draft_model: short name, HF dir or .gguf of the drafter
    layer_skip_layers: int = 8  # layer_skip: how many target layers the self-draft keeps
    checkpoint: str | None = None  # eagle/eagle3/medusa/mtp: drafter checkpoint dir
    checkpoint_format: CheckpointFormat = "auto"  # its layout (jaxspec.formats); auto: detected
    # EAGLE-3 checkpoints naming their tapped layers: id i is the input of layer i (input: vLLM)
    # or its output (output: SGLang / SpecForge). Without ids both tap layers 2, L//2, L-3.
    eagle3_layer_ids: Literal["input", "output"] = "input"
    # eagle: dynamic draft length -- stop drafting once the drafter's confidence that its draft is
    # accepted (product of its probabilities of the tokens drafted so far, times the next one's
    # top probability) falls below this; 0: always γ drafts.
    draft_confidence: float = 0.0
    # any drafting method but ngram: where the last n committed tokens (lookup_min_ngram <= n <=
    # max_ngram) occur earlier in the context, verify what followed them (prompt lookup) instead
    # of the method's draft; 0: off.
    lookup_min_ngram: int = 0

    def _validate(self):
        if self.method != "none" and not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            self._fail("num_speculative_tokens", f"use 1..{MAX_SPECULATIVE_TOKENS}")
        if not 1 <= self.min_ngram <= self.max_ngram <= MAX_NGRAM:
            raise JaxspecError(
                f"speculative.min_ngram={self.min_ngram}, max_ngram={self.max_ngram} are invalid: "
                f"need 1 <= min_ngram <= max_ngram <= {MAX_NGRAM}"
            )
        if self.layer_skip_layers < 1:
            self._fail("layer_skip_layers", "use an integer >= 1")
        if not 0.0 <= self.draft_confidence < 1.0:
            self._fail("draft_confidence", "use a number in [0, 1); 0 drafts γ tokens always")
        if self.lookup_min_ngram:
            if not 1 <= self.lookup_min_ngram <= self.max_ngram:
                self._fail("lookup_min_ngram", f"use 0 (off) or 1..max_ngram ({self.max_ngram})")
            if self.method in ("none", "ngram"):
                raise JaxspecError(
                    f"speculative.lookup_min_ngram adds prompt lookup to a drafter; method "
                    f"'{self.method}' has none: remove it, or use method ngram with min_ngram"
                )
        if self.draft_confidence > 0 and self.method != "eagle":
            raise JaxspecError(
                f"speculative.draft_confidence is supported by method 'eagle' only, not "
                f"'{self.method}': remove it or set it to 0"
            )


MAX_TREE_NODES = 63  # window of 1 + nodes <= the CPU attention kernel's 64 queries
TREE_METHODS = {"static": ("medusa", "ngram"), "dynamic": ("eagle", "draft_model")}


@dataclasses.dataclass(frozen=True, kw_only=True)
class TreeConfig(_Section):
    """Draft trees (see jaxspec/tree.py): the target verifies several candidates per depth."""

    SECTION: ClassVar[str] = "tree"
    kind: Literal["chain", "static", "dynamic"] = "chain"
    # static, medusa: Medusa-style paths of ranks, e.g. [[0], [1], [0, 0]] (YAML list or string)
    choices: str | list | None = None
    branches: int = 3  # static, ngram: distinct continuations of the context's matches
    depth: int = 4  # static ngram: nodes per branch; dynamic: levels
    top_k: int = 4  # dynamic: nodes expanded per level, children per expanded node
    budget: int = 16  # dynamic: nodes kept (best path scores)
    children: Literal["top_k", "sampled", "without_replacement"] = "top_k"  # dynamic: jaxspec.tree

    def _validate(self):
        if isinstance(self.choices, str):
            try:
                parsed = yaml.safe_load(self.choices)
            except yaml.YAMLError:
                parsed = self.choices
            object.__setattr__(self, "choices", parsed)
        if self.choices is not None:
            from jaxspec.tree import check_choices  # jax: only when a tree is configured

            try:
                paths = check_choices(self.choices)
            except JaxspecError as e:
                raise JaxspecError(f"tree.choices: {e}") from None
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
class MeshConfig(_Section):
    """Device mesh: `data` splits the batch, `model` the heads / mlp / vocabulary (tensor parallel).
    data * model <= the device count (checked when the engine is built); 1 x 1 = one device."""

    SECTION: ClassVar[str] = "mesh"
    data: int = 1
    model: int = 1
    shard_drafter: bool = False  # true: a draft model follows the target's rules (default replicated)

    def _validate(self):
        for key in ("data", "model"):
            if getattr(self, key) < 1:
                self._fail(key, "use an integer >= 1")

    @property
    def size(self) -> int:
        return self.data * self.model


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedConfig(_Section):
    """Multi-host: `jax.distributed.initialize` with these (unset ones from JAX_COORDINATOR_ADDRESS,
    JAX_NUM_PROCESSES, JAX_PROCESS_ID, or JAX's cluster detection: SLURM, Open MPI, TPU pods)."""

    SECTION: ClassVar[str] = "distributed"
    coordinator_address: str | None = None  # host:port of process 0
    num_processes: int | None = None
    process_id: int | None = None

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
class AdaptiveConfig(_Section):
    """Adaptive speculation (jaxspec/adaptive.py): per-row draft length from live acceptance and
    the measured step-cost curve (jaxspec/calibration.py); plain steps where speculation loses."""

    SECTION: ClassVar[str] = "adaptive"
    enabled: bool = False
    decay: float = 0.9  # weight of the past in each row's running acceptance estimate
    prior: float = 0.6  # acceptance estimate a row starts from
    probe_every: int = 16  # a row running plain re-probes every this many steps (0: never)
    probe_length: int = 1  # draft nodes a probe verifies
    draft_cost: float = 0.0  # one draft step, in plain target steps (added per node)
    switch_off_acceptance: float = 0.8  # batch runs plain if even this acceptance cannot pay
    recalibrate: bool = False  # measure the step-cost curve again (CLI: --recalibrate)

    def _validate(self):
        if not 0.0 <= self.decay < 1.0:
            self._fail("decay", "use a number in [0, 1)")
        if not 0.0 <= self.prior <= 1.0:
            self._fail("prior", "use a number in [0, 1]")
        if self.probe_every < 0:
            self._fail("probe_every", "use an integer >= 0 (0: never re-probe)")
        if self.probe_length < 1:
            self._fail("probe_length", "use an integer >= 1")
        if not (math.isfinite(self.draft_cost) and self.draft_cost >= 0):
            self._fail("draft_cost", "use a finite number >= 0")
        if not 0.0 <= self.switch_off_acceptance <= 1.0:
            self._fail("switch_off_acceptance", "use a number in [0, 1]")

    def options(self):
        from jaxspec.adaptive import Options  # jax: only when adaptive is configured

        fields = ("decay", "prior", "probe_every", "probe_length", "draft_cost",
                  "switch_off_acceptance", "recalibrate")
        return Options(**{f: getattr(self, f) for f in fields})


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    model: ModelLoadConfig = dataclasses.field(default_factory=ModelLoadConfig)
    sampling: SamplingConfig = dataclasses.field(default_factory=SamplingConfig)
    generation: GenerationConfig = dataclasses.field(default_factory=GenerationConfig)
    speculative: SpeculativeConfig = dataclasses.field(default_factory=SpeculativeConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
    tree: TreeConfig = dataclasses.field(default_factory=TreeConfig)
    adaptive: AdaptiveConfig = dataclasses.field(default_factory=AdaptiveConfig)

    def __post_init__(self):
        kind, method = self.tree.kind, self.speculative.method
        if self.adaptive.enabled and method == "none":
            raise JaxspecError(
                "adaptive.enabled needs a drafter: set speculative.method (e.g. ngram) or "
                "adaptive.enabled=false"
            )
        if self.adaptive.enabled and kind != "chain":
            raise JaxspecError(
                f"adaptive speculation picks chain lengths, not tree.kind={kind}: use "
                "tree.kind=chain or adaptive.enabled=false"
            )
        if kind == "chain":
            return
        if method not in TREE_METHODS[kind]:
            raise JaxspecError(
                f"tree.kind={kind} is supported by method {' or '.join(TREE_METHODS[kind])}, not "
                f"'{method}': set tree.kind=chain or change speculative.method"
            )
        if self.speculative.lookup_min_ngram or self.speculative.draft_confidence:
            raise JaxspecError(
                f"tree.kind={kind} does not combine with speculative.lookup_min_ngram or "
                "draft_confidence: set them to 0 or use tree.kind=chain"
            )
        if kind == "static" and method == "medusa" and self.tree.choices is None:
            raise JaxspecError("tree.kind=static with medusa needs tree.choices, e.g. [[0], [1], [0, 0]]")

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


SECTIONS: dict[str, type[_Section]] = {
    f.name: f.default_factory for f in dataclasses.fields(Config)  # type: ignore[misc]
}


def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Read a YAML file (None: all defaults), apply `section.key=value` overrides, validate.

    Override values are parsed as YAML scalars (`0.7`, `true`, `null`); a field typed `str` keeps
    the raw text when the parsed value is not a string (`model.name=2024`).
    """
    values: dict[str, dict[str, tuple[Any, str | None]]] = {s: {} for s in SECTIONS}
    if path is not None:
        for section, body in _read_yaml(Path(path)).items():
            for key, value in body.items():
                values[section][key] = (value, None)
    for item in overrides:
        section, key, raw = _split_override(item)
        values[section][key] = (_parse_scalar(raw), raw)
    sections = {}
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        kwargs = {}
        for key, (value, raw) in values[section].items():
            if raw is not None and not _matches(value, hints[key]) and _accepts_str(hints[key]):
                value = raw
            kwargs[key] = value
        sections[section] = cls(**kwargs)
    return Config(**sections)


def _read_yaml(path: Path) -> dict[str, dict[str, Any]]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise JaxspecError(f"config file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise JaxspecError(f"cannot read config file {path}: {_one_line(e)}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise JaxspecError(f"config file {path} is not valid YAML: {_one_line(e)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise JaxspecError(
            f"config file {path} must be a mapping of sections ({_names(SECTIONS)}), "
            f"not a {type(data).__name__}"
        )
    out = {}
    for section, body in data.items():
        _check_section(section, where=f"config file {path}")
        if body is None:
            body = {}
        if not isinstance(body, dict):
            raise JaxspecError(
                f"config file {path}: section '{section}' must be a mapping of keys, "
                f"not a {type(body).__name__}"
            )
        for key in body:
            _check_key(section, key, where=f"config file {path}")
        out[section] = body
    return out


def _split_override(item: str) -> tuple[str, str, str]:
    name, sep, raw = item.partition("=")
    section, dot, key = name.strip().partition(".")
    if not sep or not dot or not key:
        raise JaxspecError(
            f"override {item!r} is not of the form section.key=value "
            f"(e.g. sampling.temperature=0.7)"
        )
    _check_section(section, where=f"override {item!r}")
    _check_key(section, key, where=f"override {item!r}")
    return section, key, raw.strip()


def _check_section(section: Any, where: str) -> None:
    if section not in SECTIONS:
        raise JaxspecError(
            f"{where}: unknown section '{section}': valid sections are {_names(SECTIONS)}"
        )


def _check_key(section: str, key: Any, where: str) -> None:
    keys = [f.name for f in dataclasses.fields(SECTIONS[section])]
    if key not in keys:
        raise JaxspecError(f"{where}: unknown key '{section}.{key}': valid keys are {_names(keys)}")


def _parse_scalar(raw: str) -> Any:
    try:
        value = yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError:
        return raw
    return value if value is None or isinstance(value, (str, int, float, bool)) else raw


# ---- type checks ---------------------------------------------------------------------------
def _coerce(name: str, value: Any, hint: Any) -> Any:
    """Return `value` converted to `hint` (int -> float, numeric strings -> float) or raise."""
    options = _options(hint)
    for t in options:
        if t is float and isinstance(value, str):
            try:
                value = float(value)  # PyYAML reads 1e-3 as a string
            except ValueError:
                continue
        if _matches(value, t):
            return float(value) if t is float else value
    if isinstance(value, str) and any(typing.get_origin(o) is Literal for o in options):
        raise JaxspecError(f"{name}={value!r} is invalid: use {_describe(options)}")
    raise JaxspecError(f"{name}={value!r} has the wrong type: expected {_describe(options)}")


def _options(hint: Any) -> list[Any]:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return [o for a in typing.get_args(hint) for o in _options(a)]
    return [hint]


def _matches(value: Any, hint: Any) -> bool:
    if any(o is not hint for o in _options(hint)):
        return any(_matches(value, o) for o in _options(hint))
    if hint is type(None):
        return value is None
    if typing.get_origin(hint) is Literal:
        return isinstance(value, str) and value in typing.get_args(hint)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _accepts_str(hint: Any) -> bool:
    return str in _options(hint)


def _describe(options: list[Any]) -> str:
    words = {str: "a string", int: "an integer", float: "a number", bool: "true or false"}
    out = []
    for o in options:
        if o is type(None):
            out.append("null")
        elif typing.get_origin(o) is Literal:
            out.append(f"one of {_names(typing.get_args(o))}")
        else:
            out.append(words.get(o, getattr(o, "__name__", str(o))))
    return " or ".join(out)


def _names(items) -> str:
    return ", ".join(str(i) for i in items)


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())
