"""A new drafting method is one module + `register_drafter`: this file is that module. It defines a
toy drafter and its options section, registers both, and selects it from YAML, from a CLI
override and through the engine -- with no edit to jaxspec.config, jaxspec.train.load or
jaxspec.engine.runner."""

from __future__ import annotations

import dataclasses
import json
from typing import ClassVar

import jax.numpy as jnp
import pytest
from conftest import make_tiny_checkpoint, save_byte_tokenizer
from tiny import tiny_model

from jaxspec import generate
from jaxspec.build import build_drafter
from jaxspec.config import load_config
from jaxspec.drafters import BuildContext, DrafterOptions, Proposal, register_drafter
from jaxspec.engine.runner import Engine
from jaxspec.errors import JaxspecError


# ---- the new method ------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class EchoDrafter:
    """Proposes γ copies of (last committed token + shift) mod V, one-hot (deterministic)."""

    vocab_size: int
    shift: int = 0
    name: str = "echo"
    hidden_layers: tuple[int, ...] = ()
    variable_length: bool = False

    def init(self, dparams, tparams, prompt_tokens, prompt_lengths, prompt_hidden, capacity):
        return ()

    def propose(self, dparams, tparams, state, ctx, num_tokens, sampling, keys):
        last = jnp.take_along_axis(ctx.tokens, (ctx.lengths - 1)[:, None], axis=1)  # [B, 1]
        tokens = jnp.broadcast_to((last + self.shift) % self.vocab_size,
                                  (last.shape[0], num_tokens)).astype(jnp.int32)
        probs = jnp.asarray(tokens[..., None] == jnp.arange(self.vocab_size), jnp.float32)
        num = jnp.full((last.shape[0],), num_tokens, jnp.int32)
        return Proposal(tokens, probs, num), state

    def commit(self, dparams, tparams, state, ctx):
        return state


@dataclasses.dataclass(frozen=True, kw_only=True)
class EchoOptions(DrafterOptions):
    SECTION: ClassVar[str] = "speculative.echo"
    shift: int = 0

    def _validate(self):
        if not 0 <= self.shift < 1000:
            self._fail("shift", "use 0..999")


def build_echo(options: EchoOptions, ctx: BuildContext):
    return EchoDrafter(ctx.target.cfg.vocab_size, options.shift), ()


register_drafter("echo", build_echo, options=EchoOptions)


# ---- selecting it ----------------------------------------------------------------------------
YAML = """
speculative:
  method: echo
  num_speculative_tokens: 3
  echo:
    shift: 2
"""


def test_selected_from_yaml_and_overrides(tmp_path):
    path = tmp_path / "echo.yaml"
    path.write_text(YAML)
    spec = load_config(path).speculative
    assert spec.method == "echo" and spec.options == EchoOptions(shift=2)
    spec = load_config(path, ["speculative.echo.shift=5"]).speculative
    assert spec.options.shift == 5
    spec = load_config(None, ["speculative.method=echo"]).speculative
    assert spec.options == EchoOptions()  # its defaults
    assert load_config(path).to_dict()["speculative"]["echo"] == {"shift": 2}


@pytest.mark.parametrize("overrides, fragments", [
    (["speculative.echo.shift=-1"], ["speculative.echo.shift=-1 is invalid", "0..999"]),
    (["speculative.echo.shift=x"], ["speculative.echo.shift='x'", "an integer"]),
    (["speculative.echo.width=1"], ["unknown key 'speculative.echo.width'", "valid keys are shift"]),
    (["speculative.echo.shift.x=1"], ["speculative.echo.shift.x"]),
    (["speculative.echo=1"], ["'speculative.echo' is a section", "shift"]),
    (["speculative.method=echo", "speculative.tree.kind=static"], ["speculative.tree.kind=static",
                                                                   "not 'echo'"]),
])
def test_bad_options_are_one_line_errors(overrides, fragments):
    with pytest.raises(JaxspecError) as e:
        load_config(None, overrides)
    msg = str(e.value)
    assert "\n" not in msg and all(f in msg for f in fragments), msg


def test_greedy_equals_plain_through_the_engine(tmp_path):
    target = tiny_model(layers=2, scale=0.05)  # greedy output repeats tokens: echoes get accepted
    path = tmp_path / "echo.yaml"
    path.write_text(YAML)
    for overrides in ([], ["speculative.echo.shift=0"]):  # a shift 0 echo is accepted sometimes
        spec = load_config(path, overrides).speculative
        drafter, dparams = build_drafter(spec, target)
        assert isinstance(drafter, EchoDrafter) and drafter.shift == spec.options.shift
        prompts = [[1, 2, 3, 4], [5, 5, 5], [9, 8, 7, 6, 5, 4]]
        plain = Engine(target).generate(prompts, max_new_tokens=12, batch_size=3)
        echo = Engine(target, drafter, dparams, num_speculative_tokens=3).generate(
            prompts, max_new_tokens=12, batch_size=3
        )
        assert [r.token_ids for r in echo] == [r.token_ids for r in plain]
        assert {r.metrics["method"] for r in echo} == {"echo"}
        if spec.options.shift == 0:
            assert sum(r.metrics["num_accepted_tokens"] for r in echo) > 0


def test_selected_from_the_cli(tmp_path, capsys, monkeypatch):
    model = make_tiny_checkpoint(tmp_path / "tiny", "llama", seed=1, num_hidden_layers=2,
                                 max_position_embeddings=128)
    save_byte_tokenizer(model)
    monkeypatch.setattr(generate, "enable_compilation_cache", lambda: None)
    argv = [f"model.name={model}", "generation.max_new_tokens=4", "speculative.method=echo",
            "speculative.echo.shift=1", "speculative.num_speculative_tokens=2", "--prompt", "ab ab",
            "--json"]
    assert generate.main(argv) == 0
    assert json.loads(capsys.readouterr().out)["metrics"]["method"] == "echo"
    assert generate.main([*argv[:-3], "speculative.echo.shift=1000", "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: speculative.echo.shift=1000 is invalid") and "\n" not in err


# ---- a trained drafter: the same one registration ------------------------------------------
@dataclasses.dataclass(frozen=True)
class EchoHead:
    """The trained head of `echo_trained` (what `python -m jaxspec.train` would build)."""

    shift: int = 0


register_drafter("echo_trained", build_echo, options=None, train="test_registry:EchoHead",
                 formats=("jaxspec", "eagle3"))


def test_a_trained_drafter_is_one_registration():
    """Training and loading find a head through its drafter's registration, and the checkpoint
    check reads the layouts listed there: the built-in trained methods and one defined here."""
    from jaxspec.formats import method_formats
    from jaxspec.train import block, methods
    from jaxspec.train.registry import METHODS, from_arch

    built_in = {"eagle": methods.Eagle, "eagle3": methods.Eagle3, "medusa": methods.Medusa,
                "draft_model": methods.Draft, "block": block.Block}
    assert all(METHODS[name] is cls for name, cls in built_in.items())
    assert {"dflash", "echo_trained"} <= set(METHODS) and "ngram" not in METHODS
    assert from_arch("echo_trained", {"shift": 3, "other": 1}) == EchoHead(shift=3)
    assert method_formats("medusa") == ("jaxspec", "medusa", "medusa_fd")
    assert method_formats("echo_trained") == ("jaxspec", "eagle3")
    assert method_formats("mtp") == ("mtp",) and method_formats("echo") == ("jaxspec",)
    with pytest.raises(ValueError, match="module:Class"):
        register_drafter("echo_bad", build_echo, train="test_registry.EchoHead")
