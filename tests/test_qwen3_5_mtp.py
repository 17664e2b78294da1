"""Qwen3.5's native MTP head (`mtp.*` tensors beside the target's) as the `mtp` drafter.

A tiny random `Qwen3_5ForCausalLM` is written with `save_pretrained`; transformers writes no MTP
head, so the test builds one from transformers' own Qwen3.5 modules (two RMS norms, fc, one
full-attention decoder layer, final norm), random, and saves it in the published names. Its
forward through jaxspec equals that torch computation of the published definition; the head,
read from the target's directory by `speculative.method=mtp` with no checkpoint, drafts chained
(γ = 3) at batch 4 with drafts both accepted and rejected, and greedy speculative == greedy
plain. A head that does not match (missing or misshapen tensors, two MTP layers) is refused in
one line; the head's params written back in the published names read back equal. Sampled
speculation with a random head on the law model of tests/test_qwen3_5.py has the target's exact
law, and a head that reports a flatter draft law than it samples from fails it.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import import_torch
from test_qwen3_5 import VOCAB, hf_model

from jaxspec.drafters.qwen3_5_mtp import Qwen35MtpDrafter
from jaxspec.errors import JaxspecError
from jaxspec.loading import load_model
from jaxspec.models import base, qwen3_5

NEW = 24
WEIGHT_SCALE = 0.3  # the target's matrices, times hf_model's


def torch_head(config, seed: int = 1):
    """The published head from transformers' Qwen3.5 modules, random (norms around neutral)."""
    torch = import_torch()
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    torch.manual_seed(seed)
    d = config.hidden_size
    full = config.layer_types.index("full_attention")
    head = torch.nn.ModuleDict({
        "pre_fc_norm_embedding": m.Qwen3_5RMSNorm(d, eps=config.rms_norm_eps),
        "pre_fc_norm_hidden": m.Qwen3_5RMSNorm(d, eps=config.rms_norm_eps),
        "fc": torch.nn.Linear(2 * d, d, bias=False),
        "layers": torch.nn.ModuleList([m.Qwen3_5DecoderLayer(config, full)]),
        "norm": m.Qwen3_5RMSNorm(d, eps=config.rms_norm_eps),
    })
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(0.3 * torch.randn_like(p))
    return head.eval()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from safetensors.numpy import load_file, save_file

    torch = import_torch()
    model = hf_model()
    with torch.no_grad():  # weaker mixing: greedy output settles on repeated tokens at times
        for name, p in model.named_parameters():
            if p.ndim == 2 and "embed" not in name:
                p.mul_(WEIGHT_SCALE)
    head = torch_head(model.config)
    path = tmp_path_factory.mktemp("qwen3_5_mtp")
    model.save_pretrained(path)
    tensors = load_file(path / "model.safetensors")
    tensors |= {"mtp." + k: v.numpy() for k, v in head.state_dict().items()}
    save_file(tensors, path / "model.safetensors")
    config = json.loads((path / "config.json").read_text()) | {"mtp_num_hidden_layers": 1}
    (path / "config.json").write_text(json.dumps(config))
    return model, head, path


@pytest.fixture(scope="module")
def loaded(checkpoint):
    return load_model(checkpoint[2])


def spec(*overrides):
    from jaxspec.config import load_config

    return load_config(None, ["speculative.method=mtp", "speculative.num_speculative_tokens=3",
                              *overrides]).speculative


@pytest.fixture(scope="module")
def head(loaded):
    from jaxspec.build import build_drafter

    return build_drafter(spec(), loaded)  # no checkpoint: the target's own directory


def torch_logits(model, head, ids) -> np.ndarray:
    """The published definition: position i of the head reads token i + 1 with the target's
    final hidden state of position i, and predicts token i + 2."""
    torch = import_torch()
    with torch.no_grad():
        x = torch.tensor(ids, dtype=torch.long)
        h = model.model(x).last_hidden_state
        e = model.model.embed_tokens(x)
        y = head["fc"](torch.cat([head["pre_fc_norm_embedding"](e[:, 1:]),
                                  head["pre_fc_norm_hidden"](h[:, :-1])], dim=-1))
        b, t = y.shape[:2]
        pos = torch.arange(t)[None].expand(b, t)
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        y = head["layers"][0](y, position_embeddings=model.model.rotary_emb(y, pos),
                              attention_mask=mask, position_ids=pos)
        return model.lm_head(head["norm"](y)).numpy()


def assert_head_matches_transformers(drafter, dparams, loaded, model, thead, vocab: int):
    """The MTP head's logits for 2 x 16 random ids (ids >= 3, below `vocab`), on the loaded
    target's taps, equal the published definition's (`torch_logits` on transformers' modules)."""
    ids = np.random.default_rng(0).integers(3, vocab, size=(2, 16)).astype(np.int32)
    target, params = loaded.target, loaded.params
    out = target.forward(params, jnp.asarray(ids), target.init_cache(params, 2, 32),
                         taps=drafter.hidden_layers)
    ours = np.asarray(drafter.forward(dparams, base.bind(target, params), jnp.asarray(ids),
                                      out.taps))[:, 1:]
    ref = torch_logits(model, thead, ids)
    np.testing.assert_allclose(ours, ref, atol=2e-4 * np.abs(ref).max(), rtol=0)


def test_head_forward_equals_the_published_definition(checkpoint, loaded, head):
    model, thead, _ = checkpoint
    assert_head_matches_transformers(*head, loaded, model, thead, VOCAB)


def torch_chain(model, head, ids, drafts) -> np.ndarray:
    """The published chain over ids [B, P + 1] (a prompt, then the target's next token): step s
    reads draft s - 1 (token P at s = 0) with the head's own normed output of the step before
    (the target's hidden of position P - 1 at s = 0) -> the draft
    laws f32[B, S, V] of each step (temperature 1), the head's own drafts teacher-forced."""
    torch = import_torch()
    with torch.no_grad():
        x = torch.tensor(ids, dtype=torch.long)  # the prompt and the target's next token
        hid = model.model(x[:, :-1]).last_hidden_state
        toks, laws = x[:, 1:], []
        for s in range(drafts.shape[1]):
            y = head["fc"](torch.cat([head["pre_fc_norm_embedding"](model.model.embed_tokens(toks)),
                                      head["pre_fc_norm_hidden"](hid)], dim=-1))
            b, t = y.shape[:2]
            pos = torch.arange(t)[None].expand(b, t)
            mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
            y = head["norm"](head["layers"][0](
                y, position_embeddings=model.model.rotary_emb(y, pos), attention_mask=mask,
                position_ids=pos))
            laws.append(torch.softmax(model.lm_head(y[:, -1]), dim=-1).numpy())
            toks = torch.cat([toks, torch.tensor(drafts[:, s : s + 1], dtype=torch.long)], 1)
            hid = torch.cat([hid, y[:, -1:]], dim=1)
        return np.stack(laws, axis=1)


def test_chained_drafts_follow_the_published_chain(checkpoint, loaded, head):
    """init + propose (γ = 3, the head's cache, its output fed back): each step's draft law
    equals the torch chain's."""
    from jaxspec.decode.drafter import DraftContext
    from jaxspec.decode.sampling import SamplingParams

    model, thead, _ = checkpoint
    drafter, dparams = head
    target, params = loaded.target, loaded.params
    ids = np.random.default_rng(2).integers(3, VOCAB, size=(2, 13)).astype(np.int32)
    b, p = ids.shape[0], ids.shape[1] - 1  # a prompt of p tokens, then the target's token p
    out = target.forward(params, jnp.asarray(ids[:, :p]), target.init_cache(params, b, 32),
                         taps=drafter.hidden_layers)
    tparams = base.bind(target, params)
    lengths = jnp.full((b,), p, jnp.int32)
    state = drafter.init(dparams, tparams, jnp.asarray(ids[:, :p]), lengths, out.taps, 32)
    tokens = jnp.zeros((b, 32), jnp.int32).at[:, : p + 1].set(jnp.asarray(ids))
    ctx = DraftContext(tokens, lengths + 1, jnp.ones((b,), bool))
    proposal, _ = drafter.propose(dparams, tparams, state, ctx, 3,
                                  SamplingParams.make(temperature=1.0),
                                  jax.random.split(jax.random.key(0), b))
    ref = torch_chain(model, thead, ids, np.asarray(proposal.tokens))
    np.testing.assert_allclose(np.asarray(proposal.probs), ref, atol=1e-4, rtol=0)


def echoing(dparams, scale: float = 0.2):
    """The head leaning on the target's hidden state it reads (fc passes it through, its norms
    neutral, attention and MLP outputs scaled by `scale`): its draft for x_{j+1} is mostly the target's own
    prediction of x_j, accepted where the target repeats a token, rejected elsewhere."""
    d = dparams["fc"].shape[0]
    fc = dparams["fc"].at[:, d:].add(20.0 * jnp.eye(d))
    layer = dparams["layer"] | {"wo": scale * dparams["layer"]["wo"],
                                "w_down": scale * dparams["layer"]["w_down"]}
    neutral = jnp.zeros(d)  # (1 + w) norms with w = 0: the hidden's direction kept
    return dparams | {"fc": fc, "layer": layer, "pre_fc_norm_hidden": neutral, "norm": neutral}


def test_greedy_mtp_speculation_is_token_identical(loaded, head):
    from jaxspec.engine.runner import Engine

    model = base.Model(target=loaded.target, params=loaded.params, eos_token_ids=(-1,))
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(3, VOCAB, size=n)] for n in (9, 14, 4, 11)]
    plain = [r.token_ids for r in Engine(model).generate(prompts, max_new_tokens=NEW,
                                                          batch_size=4)]
    drafter, dparams = head[0], echoing(head[1])
    out = Engine(model, drafter, dparams, num_speculative_tokens=3).generate(
        prompts, max_new_tokens=NEW, batch_size=4)
    assert [r.token_ids for r in out] == plain
    accepted = sum(r.metrics["num_accepted_tokens"] for r in out)
    drafted = sum(r.metrics["num_draft_tokens"] for r in out)
    assert 0 < accepted < drafted  # drafts both accepted and rejected


def _variant(src, dst, edit_tensors=None, **config_changes):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(src / "model.safetensors")
    if edit_tensors:
        tensors = edit_tensors(tensors)
    save_file(tensors, dst / "model.safetensors")
    config = json.loads((src / "config.json").read_text()) | config_changes
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("edit,changes,words", [
    (lambda t: {k: v for k, v in t.items() if k != "mtp.fc.weight"}, {},
     "missing tensors .*mtp.fc.weight|missing tensors .*fc.weight"),
    (lambda t: t | {"mtp.norm.weight": np.zeros(3, np.float32)}, {},
     r"mtp.norm.weight has shape \[3\]"),
    (None, {"mtp_num_hidden_layers": 2}, "mtp_num_hidden_layers=2 is not supported"),
])
def test_a_head_that_does_not_match_is_refused_in_one_line(checkpoint, loaded, tmp_path, edit,
                                                            changes, words):
    from jaxspec.formats import load_drafter_checkpoint

    path = _variant(checkpoint[2], tmp_path, edit, **changes)
    with pytest.raises(JaxspecError, match=words) as err:
        load_drafter_checkpoint("mtp", path, loaded)
    assert "\n" not in str(err.value)


def test_the_head_writes_back_in_the_published_names(checkpoint, loaded, head, tmp_path):
    from safetensors.numpy import load_file, save_file

    from jaxspec.formats import load_drafter_checkpoint, qwen3_5_mtp

    _, dparams = head
    tensors = qwen3_5_mtp.to_tensors(loaded.target.cfg, dparams)
    stored = {k: v for k, v in load_file(checkpoint[2] / "model.safetensors").items()
              if k.startswith("mtp.")}
    assert sorted(tensors) == sorted(stored)
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((checkpoint[2] / "config.json").read_text())
    _, again = load_drafter_checkpoint("mtp", tmp_path, loaded)
    jax.tree.map(np.testing.assert_array_equal, again, dparams)


# ------------------------------------------------------------------ the exact sampled law


@dataclasses.dataclass(frozen=True)
class MisreportedDraftLaw(Qwen35MtpDrafter):
    """Broken: samples from its draft law but reports a flatter one to the acceptance rule."""

    def _sample(self, dparams, tparams, h, sp, keys):
        token, probs = super()._sample(dparams, tparams, h, sp, keys)
        return token, 0.5 * probs + 0.5 / probs.shape[-1]


@pytest.mark.parametrize("broken", [False, True])
def test_sampled_mtp_speculation_has_the_target_law(broken):
    """The law model of tests/test_qwen3_5.py (vocabulary 8) with a random MTP head, γ = 3."""
    from distribution import FAIL_P, PASS_P, pvalue
    from test_qwen3_5 import LAW_PROMPT, LAW_V, law_model

    from jaxspec.decode.sampling import SamplingParams
    from jaxspec.formats import qwen3_5_mtp

    cfg, params = law_model.__wrapped__()
    want = qwen3_5_mtp.shapes(cfg)
    keys = iter(jax.random.split(jax.random.key(4), len(want)))
    raw = {k: (0.1 if len(s) == 1 else 0.3) * jax.random.normal(next(keys), s)
           for k, s in want.items()}
    dparams = {ours: raw[hf] for hf, ours in qwen3_5_mtp.TOP.items()}
    dparams["layer"] = {ours: raw[qwen3_5_mtp.LAYER + hf]
                        for hf, ours in qwen3_5_mtp.layer_names(cfg).items()}
    cls = MisreportedDraftLaw if broken else Qwen35MtpDrafter
    drafter = cls(cfg=cfg, target_vocab=LAW_V, hidden_layers=(cfg.num_layers,))
    model = base.Model(target=qwen3_5.Qwen35Target(cfg), params=params, eos_token_ids=(-1,))
    p, results = pvalue(model, drafter, dparams, SamplingParams.make(temperature=0.6),
                        LAW_PROMPT, rows=2000, gamma=3)
    if broken:
        assert p < FAIL_P
        return
    accepted = sum(r.metrics["num_accepted_tokens"] for r in results)
    drafted = sum(r.metrics["num_draft_tokens"] for r in results)
    assert 0.05 * drafted < accepted < 0.9 * drafted  # about 12 %: the rule is exercised
    assert p > PASS_P
