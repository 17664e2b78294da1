"""The drafter registry: `speculative.method` name -> how to build the drafter and its options.

A method is one module that declares its options section and calls `register_drafter`:

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class MyOptions(DrafterOptions):
        SECTION: ClassVar[str] = "speculative.my_method"   # YAML: speculative: {my_method: {...}}
        width: int = 2

        def _validate(self):                               # one-line errors naming the key
            if self.width < 1:
                self._fail("width", "use an integer >= 1")

    def build(options: MyOptions, ctx: BuildContext):      # -> (drafter, drafter params)
        return MyDrafter(ctx.target.target.vocab_size, options.width), ()

    register_drafter("my_method", build, options=MyOptions)

`speculative.method: my_method` then selects it (YAML or `speculative.method=my_method`), and
`speculative.my_method.width=3` sets its option. No jax here: `jaxspec.config` reads the registry.
The built-in methods register when `jaxspec.drafters` is imported.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

from jaxspec.errors import JaxspecError
from jaxspec.options import Section


class DrafterOptions(Section):
    """Base of a method's options section (`speculative.<method>`)."""

    def check(self, spec: Any) -> None:
        """Cross-checks against the rest of the speculative section (`spec.tree`, `spec.lookup`,
        `spec.num_speculative_tokens`) once it is built: raise a one-line JaxspecError."""

    def with_sections(self, sections: dict[str, Any]) -> DrafterOptions:
        """These options given every method section the config read (`{method: options}`): a
        method that composes another (suffix decoding's `then`) keeps that one's; else self."""
        return self


class BuildContext(NamedTuple):
    """What a factory may use besides its options (jaxspec.build.build_drafter fills it)."""

    # the loaded model (jaxspec.loading.LoadedModel or models.base.Model): `.target` the
    # target-protocol object (models/base.py), `.params`, `.layout`
    target: Any
    spec: Any  # jaxspec.config.SpeculativeConfig: num_speculative_tokens, tree, lookup
    # (method, path, target, checkpoint_format, eagle3_layer_ids) -> (drafter, dparams)
    load_checkpoint: Callable[..., tuple[Any, Any]]
    load_model: Callable[..., Any]  # (name, dtype=, layout=) -> LoadedModel


DrafterFactory = Callable[[Any, BuildContext], tuple[Any, Any]]


@dataclasses.dataclass(frozen=True)
class Method:
    name: str
    factory: DrafterFactory  # (options, BuildContext) -> (drafter, drafter_params)
    options: type[DrafterOptions] | None  # its section, speculative.<name>; None: no options
    # speculative.tree.kind values besides "chain" the factory builds (it reads ctx.spec.tree)
    tree_kinds: tuple[str, ...] = ()
    summary: str = ""  # one line: what drafts (the method tables of README and docs/drafters.md)
    # a trained method: its head class as "module:Class" (`python -m jaxspec.train` trains it; its
    # jaxspec checkpoints load through it), imported only when training or loading needs it
    train: str | None = None
    # the checkpoint layouts `speculative.<name>.checkpoint` reads (jaxspec.formats.FORMATS)
    formats: tuple[str, ...] = ()


DRAFTERS: dict[str, Method] = {}


def register_drafter(
    name: str,
    factory: DrafterFactory,
    *,
    options: type[DrafterOptions] | None = None,
    tree_kinds: tuple[str, ...] = (),
    summary: str = "",
    train: str | None = None,
    formats: tuple[str, ...] | None = None,
) -> None:
    """Make `speculative.method: name` build its drafter with `factory(options, ctx)`; `options`
    (a DrafterOptions dataclass with SECTION = "speculative.<name>") is its config subsection;
    `summary` one line on what drafts (scripts/docs.py puts it in the method tables).

    A trained drafter is this one call too: `train="pkg.module:Head"` names its head class (init,
    loss, runtime, drafter, arch: `jaxspec.train.methods` shows four), so `python -m jaxspec.train`
    trains it and its exported checkpoints load; `formats` lists the checkpoint layouts it reads
    (default: "jaxspec" for a trained method, none otherwise)."""
    if not name.isidentifier() or name == "none":
        raise ValueError(f"drafter method {name!r}: use an identifier other than 'none'")
    if train is not None and (train.count(":") != 1 or not all(train.split(":"))):
        raise ValueError(f"drafter method {name!r}: train={train!r}: use 'module:Class'")
    if formats is None:
        formats = ("jaxspec",) if train is not None else ()
    if options is not None:
        if not (isinstance(options, type) and issubclass(options, DrafterOptions)):
            raise ValueError(f"drafter method {name!r}: options must subclass DrafterOptions")
        if options.SECTION != f"speculative.{name}":
            raise ValueError(
                f"drafter method {name!r}: its options' SECTION is {options.SECTION!r}, "
                f"expected 'speculative.{name}'"
            )
    method = Method(name, factory, options, tuple(tree_kinds), summary, train, tuple(formats))
    if DRAFTERS.get(name, method) != method:
        raise ValueError(f"drafter method '{name}' is already registered")
    DRAFTERS[name] = method


def available_methods() -> list[str]:
    return ["none", *DRAFTERS]


def check_method(method: str) -> None:
    """Refuse a method with no registered factory (cheap: call before loading any model)."""
    if method != "none" and method not in DRAFTERS:
        raise JaxspecError(
            f"speculative.method={method!r} is not available in this version of jaxspec: "
            f"available methods are {', '.join(available_methods())}"
        )


def trained_methods() -> dict[str, str]:
    """method name -> "module:Class" of its trained head, for every trained method registered."""
    return {name: m.train for name, m in DRAFTERS.items() if m.train is not None}


def get(method: str) -> Method:
    check_method(method)
    return DRAFTERS[method]
