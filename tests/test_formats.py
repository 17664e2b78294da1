"""Published drafter layouts (jaxspec/formats): EAGLE-3 (original and speculators), Medusa
(FasterDecoding and vLLM), DeepSeek-V3-style MTP. Checkpoints are written here with torch and
safetensors from random weights for a tiny target; an independent PyTorch forward written from
each layout's definition must match jaxspec's draft logits; export -> import is identical; a
loaded head keeps greedy identity and the exact sampled distribution; malformed checkpoints get
their one-line message."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import import_torch
from tiny import tiny_model

from jaxspec import formats
from jaxspec.models.cache import init_cache
from jaxspec.drafters.base import DraftContext
from jaxspec.engine.runner import Engine
from jaxspec.errors import JaxspecError
from jaxspec.formats import eagle3 as eagle3_fmt
from jaxspec.formats import medusa as medusa_fmt
from jaxspec.models import base, llama
from jaxspec.decode.sampling import SamplingParams

VOCAB, LAYERS, HIDDEN = 64, 6, 64
DRAFT_HIDDEN = 32  # the EAGLE-3 head is narrower than the target (target_hidden_size = 64)
EPS = 1e-5


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=11, scale=0.3, vocab=VOCAB, layers=LAYERS, hidden=HIDDEN)


def draft_ids(n, vocab=VOCAB, seed=0):
    return np.sort(np.random.default_rng(seed).choice(vocab, n, replace=False))


# ---- writing checkpoints (torch tensors, safetensors files) -----------------------------------


def rand(torch, gen, *shape, scale=0.2, norm=False):
    x = torch.randn(*shape, generator=gen)
    return 1.0 + 0.2 * x if norm else scale * x


def eagle3_state(torch, layout, *, seed=0, hidden=DRAFT_HIDDEN, nd=40, nbf=False, embed=True):
    gen = torch.Generator().manual_seed(seed)
    pre = eagle3_fmt.PREFIX[layout]
    n, k, hd, f = 4, 2, hidden // 4, 2 * hidden
    sd = {
        "fc.weight": rand(torch, gen, hidden, 3 * HIDDEN, scale=0.1),
        "norm.weight": rand(torch, gen, hidden, norm=True),
        "lm_head.weight": rand(torch, gen, nd, hidden, scale=0.5),
        pre + "input_layernorm.weight": rand(torch, gen, hidden, norm=True),
        pre + "hidden_norm.weight": rand(torch, gen, hidden, norm=True),
        pre + "post_attention_layernorm.weight": rand(torch, gen, hidden, norm=True),
        pre + "self_attn.q_proj.weight": rand(torch, gen, n * hd, 2 * hidden, scale=0.3),
        pre + "self_attn.k_proj.weight": rand(torch, gen, k * hd, 2 * hidden, scale=0.3),
        pre + "self_attn.v_proj.weight": rand(torch, gen, k * hd, 2 * hidden),
        pre + "self_attn.o_proj.weight": rand(torch, gen, hidden, n * hd),
        pre + "mlp.gate_proj.weight": rand(torch, gen, f, hidden),
        pre + "mlp.up_proj.weight": rand(torch, gen, f, hidden),
        pre + "mlp.down_proj.weight": rand(torch, gen, hidden, f),
    }
    if embed:
        sd["embed_tokens.weight"] = rand(torch, gen, VOCAB, hidden, scale=1.0)
    if nbf:
        sd["input_norm.weight"] = rand(torch, gen, 3 * HIDDEN, norm=True)
    ids = torch.as_tensor(draft_ids(nd, seed=seed))
    sd["d2t"] = ids - torch.arange(nd)  # offsets, as the published files store them
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[ids] = True
    sd["t2d"] = t2d
    return sd


def eagle3_config(layout, *, hidden=DRAFT_HIDDEN, nd=40, ids=(1, 3, 4), nbr=False, nbf=False):
    layer = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 1,
        "rms_norm_eps": EPS,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "vocab_size": VOCAB,
        "hidden_act": "silu",
    }
    top = {"draft_vocab_size": nd, "target_hidden_size": HIDDEN, "norm_before_residual": nbr}
    if layout == "eagle3":
        cfg = layer | top
        if ids is not None:
            cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(ids)}
        return cfg
    cfg = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": {k: v for k, v in layer.items() if k != "architectures"},
        **top,
        "norm_before_fc": nbf,
        "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": "tiny"}},
    }
    if ids is not None:
        cfg["eagle_aux_hidden_state_layer_ids"] = list(ids)
    return cfg


def write_dir(path, config, sd, torch_file=None):
    torch = import_torch()
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if torch_file:
        torch.save(sd, path / torch_file)
    else:
        save_file({k: v.contiguous() for k, v in sd.items()}, str(path / "model.safetensors"))
    return path


EAGLE3_VARIANTS = {  # layout, norm_before_residual, norm_before_fc, own embedding
    "eagle3": ("eagle3", False, False, True),
    "eagle3-nbr": ("eagle3", True, False, True),
    "speculators-nbf": ("speculators", True, True, True),
}


def eagle3_dir(tmp_path, name, **kw):
    torch = import_torch()
    layout, nbr, nbf, embed = EAGLE3_VARIANTS[name]
    sd = eagle3_state(torch, layout, nbf=nbf, embed=embed)
    cfg = eagle3_config(layout, nbr=nbr, nbf=nbf) | kw
    return write_dir(tmp_path / name, cfg, sd), sd, (layout, nbr, nbf)


# ---- independent PyTorch forwards, from the layouts' definitions ------------------------------


def t_rms(torch, x, w, eps=EPS):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def t_attention(torch, x_q, x_kv_in, wq, wk, wv, wo, n, k, hd, theta=10000.0):
    """Causal self-attention of a [T, Din] sequence at positions 0..T-1, HF rotate_half rope."""
    t = x_q.shape[0]
    q = (x_q @ wq.T).view(t, n, hd).transpose(0, 1)
    kk = (x_kv_in @ wk.T).view(t, k, hd).transpose(0, 1)
    v = (x_kv_in @ wv.T).view(t, k, hd).transpose(0, 1)
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    ang = torch.arange(t, dtype=torch.float32)[:, None] * inv
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    rot = lambda a: torch.cat([-a[..., hd // 2 :], a[..., : hd // 2]], -1)
    q, kk = q * cos + rot(q) * sin, kk * cos + rot(kk) * sin
    kk, v = kk.repeat_interleave(n // k, 0), v.repeat_interleave(n // k, 0)
    s = q @ kk.transpose(1, 2) / hd**0.5
    s = s.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), float("-inf"))
    return (s.softmax(-1) @ v).transpose(0, 1).reshape(t, n * hd) @ wo.T


def t_mlp(torch, sd, pre, x):
    y = t_rms(torch, x, sd[pre + "post_attention_layernorm.weight"])
    gate = torch.nn.functional.silu(y @ sd[pre + "mlp.gate_proj.weight"].T)
    return x + (gate * (y @ sd[pre + "mlp.up_proj.weight"].T)) @ sd[pre + "mlp.down_proj.weight"].T


def torch_eagle3(torch, sd, layout, nbr, input_ids, g):
    """EAGLE-3 midlayer on input_ids [T] with fc-space features g [T, H] -> (h, draft logits)."""
    pre = eagle3_fmt.PREFIX[layout]
    h = sd["fc.weight"].shape[0]
    e = t_rms(torch, sd["embed_tokens.weight"][input_ids], sd[pre + "input_layernorm.weight"])
    hn = t_rms(torch, g, sd[pre + "hidden_norm.weight"])
    residual = hn if nbr else g
    x = torch.cat([e, hn], -1)
    w = lambda p: sd[pre + f"self_attn.{p}_proj.weight"]
    x = residual + t_attention(torch, x, x, w("q"), w("k"), w("v"), w("o"), 4, 2, h // 4)
    x = t_mlp(torch, sd, pre, x)
    return x, t_rms(torch, x, sd["norm.weight"]) @ sd["lm_head.weight"].T


def torch_fc(torch, sd, feats, nbf):  # feats [3, T, Dt] -> [T, H]
    x = torch.cat(list(feats), -1)
    if nbf:
        x = t_rms(torch, x, sd["input_norm.weight"])
    return x @ sd["fc.weight"].T


# The drafters' and the target's forwards are called jitted: run eagerly each of their ops compiles
# a program of its own (hundreds per test); jitted, a call is one program.
_forward = jax.jit(llama.forward, static_argnums=(3, 4))


def target_features(target, tokens, layers):  # int[T] -> f32[len(layers), T, D]
    ids = jnp.asarray(tokens, jnp.int32)[None]
    cache = init_cache(target.cfg.num_layers, 1, 64, target.cfg.num_kv_heads, target.cfg.head_dim)
    out = _forward(target.params, ids, cache, target.cfg, tuple(layers))
    return np.asarray(out.layer_hidden[:, 0])


TOKENS = [5, 17, 3, 42, 8, 8, 61, 2, 33, 9, 14]


@pytest.mark.parametrize("name", list(EAGLE3_VARIANTS))
def test_eagle3_logits_match_an_independent_torch_forward(tmp_path, target, name):
    torch = import_torch()
    path, sd, (layout, nbr, nbf) = eagle3_dir(tmp_path, name)
    assert formats.detect_format(path) == layout
    drafter, dparams = formats.load_drafter_checkpoint("eagle", path, target)
    assert drafter.hidden_layers == (1, 3, 4)
    feats = target_features(target, TOKENS, drafter.hidden_layers)
    ours = jax.jit(drafter.forward)(
        dparams, base.bind(target.target, target.params), jnp.asarray([TOKENS]), jnp.asarray(feats)[:, None]
    )
    with torch.no_grad():
        g = torch_fc(torch, sd, torch.as_tensor(feats), nbf)
        _, ref = torch_eagle3(torch, sd, layout, nbr, torch.as_tensor(TOKENS[1:]), g[:-1])
    # drafter position j (token x_j, feature f_{j-1}) is EAGLE-3's position j-1
    np.testing.assert_allclose(np.asarray(ours[0, 1:]), ref.numpy(), rtol=1e-5, atol=1e-5)


def test_eagle3_chained_drafts_match_torch(tmp_path, target):
    """propose(): step 1 on the target feature, step 2 on the head's own output (pre-norm)."""
    torch = import_torch()
    path, sd, (layout, nbr, nbf) = eagle3_dir(tmp_path, "eagle3-nbr")
    drafter, dparams = formats.load_drafter_checkpoint("eagle", path, target)
    p = len(TOKENS) - 1  # prompt; TOKENS[-1] is the token the target sampled after it
    feats = target_features(target, TOKENS, drafter.hidden_layers)
    cap = 32
    buf = jnp.zeros((1, cap), jnp.int32).at[0, : len(TOKENS)].set(jnp.asarray(TOKENS))
    state = jax.jit(drafter.init, static_argnums=5)(
        dparams, base.bind(target.target, target.params), buf[:, :p], jnp.asarray([p]), jnp.asarray(feats[:, None, :p]), cap
    )
    ctx = DraftContext(tokens=buf, lengths=jnp.asarray([p + 1]), active=jnp.ones((1,), bool))
    sp = SamplingParams.make(temperature=1.0)
    prop, _ = jax.jit(drafter.propose, static_argnums=4)(
        dparams, base.bind(target.target, target.params), state, ctx, 2, sp, jax.random.split(jax.random.key(1), 1)
    )
    d1 = int(prop.tokens[0, 0])
    d2t = dparams["d2t"]
    with torch.no_grad():
        g = torch_fc(torch, sd, torch.as_tensor(feats), nbf)[:-1]  # f_0 .. f_{L-2}
        ids = torch.as_tensor(TOKENS[1:])
        h, logits = torch_eagle3(torch, sd, layout, nbr, ids, g)
        q1 = logits[-1].softmax(-1)
        _, logits2 = torch_eagle3(
            torch, sd, layout, nbr, torch.cat([ids, torch.tensor([d1])]), torch.cat([g, h[-1:]])
        )
        q2 = logits2[-1].softmax(-1)
    np.testing.assert_allclose(np.asarray(prop.probs[0, 0, d2t]), q1.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(prop.probs[0, 1, d2t]), q2.numpy(), rtol=1e-5, atol=1e-6)
    assert float(prop.probs[0, 0].sum()) == pytest.approx(1.0, abs=1e-5)


def test_eagle3_default_taps_follow_the_target_depth(tmp_path, target):
    torch = import_torch()
    sd = eagle3_state(torch, "eagle3")
    path = write_dir(tmp_path / "e", eagle3_config("eagle3", ids=None), sd)
    drafter, _ = formats.load_drafter_checkpoint("eagle", path, target)
    assert drafter.hidden_layers == (2, LAYERS // 2, LAYERS - 3)


# ---- Medusa ---------------------------------------------------------------------------------


def medusa_state(torch, layout, *, heads=3, layers=2, seed=0, nd=None, bias=True):
    gen = torch.Generator().manual_seed(seed)
    sd = {}
    rows = nd or VOCAB
    for i in range(heads):
        for j in range(layers):
            w, b = rand(torch, gen, HIDDEN, HIDDEN), rand(torch, gen, HIDDEN)
            if layout == "medusa_fd":
                sd[f"{i}.{j}.linear.weight"], sd[f"{i}.{j}.linear.bias"] = w, b
            else:
                sd[f"blocks.{i}.layers.{j}.weight"] = w
                if bias:
                    sd[f"blocks.{i}.layers.{j}.bias"] = b
        head = rand(torch, gen, rows, HIDDEN, scale=0.5)
        sd[f"{i}.{layers}.weight" if layout == "medusa_fd" else f"lm_heads.{i}.weight"] = head
    if nd:
        sd["token_map"] = torch.as_tensor(draft_ids(nd, seed=seed))
    return sd


def medusa_config(layout, *, heads=3, layers=2, nd=None, bias=True):
    if layout == "medusa_fd":
        return {
            "medusa_num_heads": heads,
            "medusa_num_layers": layers,
            "base_model_name_or_path": "tiny",
        }
    cfg = {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": HIDDEN,
        "vocab_size": VOCAB,
        "num_heads": heads,
        "num_hidden_layers": layers,
        "medusa_fc_bias": bias,
    }
    if nd:
        cfg["truncated_vocab_size"] = nd
    return cfg


MEDUSA_VARIANTS = {  # layout, torch file (None: safetensors), draft vocab, block bias
    "medusa_fd-pt": ("medusa_fd", "medusa_lm_head.pt", None, True),
    "medusa_fd-safetensors": ("medusa_fd", None, None, True),
    "medusa-token_map": ("medusa", None, 40, True),
    "medusa-nobias": ("medusa", None, None, False),
}


def medusa_dir(tmp_path, name):
    torch = import_torch()
    layout, file, nd, bias = MEDUSA_VARIANTS[name]
    sd = medusa_state(torch, layout, nd=nd, bias=bias)
    return write_dir(tmp_path / name, medusa_config(layout, nd=nd, bias=bias), sd, file), sd, layout


def torch_medusa(torch, sd, layout, h, heads=3, layers=2):  # h [D] -> [K, rows]
    out = []
    for i in range(heads):
        x = h
        for j in range(layers):
            if layout == "medusa_fd":
                w, b = sd[f"{i}.{j}.linear.weight"], sd[f"{i}.{j}.linear.bias"]
            else:
                w = sd[f"blocks.{i}.layers.{j}.weight"]
                b = sd.get(f"blocks.{i}.layers.{j}.bias", torch.zeros(HIDDEN))
            x = x + torch.nn.functional.silu(x @ w.T + b)
        out.append(
            x @ sd[f"{i}.{layers}.weight" if layout == "medusa_fd" else f"lm_heads.{i}.weight"].T
        )
    return torch.stack(out)


@pytest.mark.parametrize("name", list(MEDUSA_VARIANTS))
def test_medusa_logits_match_an_independent_torch_forward(tmp_path, target, name):
    torch = import_torch()
    from jaxspec.drafters.medusa_blocks import head_logits

    path, sd, layout = medusa_dir(tmp_path, name)
    assert formats.detect_format(path) == layout
    drafter, dparams = formats.load_drafter_checkpoint("medusa", path, target)
    assert drafter.num_heads == 3
    h = np.random.default_rng(0).normal(size=(HIDDEN,)).astype(np.float32)
    ours = np.asarray(jax.jit(head_logits, static_argnums=2)(dparams, jnp.asarray(h), 3))
    with torch.no_grad():
        ref = torch_medusa(torch, sd, layout, torch.as_tensor(h)).numpy()
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5)
    if "token_map" in sd:
        np.testing.assert_array_equal(np.asarray(dparams["d2t"]), sd["token_map"].numpy())


# ---- MTP ------------------------------------------------------------------------------------


def mtp_state(torch, seed=0, head=True, layers=LAYERS, vocab=VOCAB):
    gen = torch.Generator().manual_seed(seed)
    pre = f"model.layers.{layers}."
    n, k, hd, f = 4, 2, HIDDEN // 4, 2 * HIDDEN
    sd = {
        pre + "enorm.weight": rand(torch, gen, HIDDEN, norm=True),
        pre + "hnorm.weight": rand(torch, gen, HIDDEN, norm=True),
        pre + "eh_proj.weight": rand(torch, gen, HIDDEN, 2 * HIDDEN, scale=0.15),
        pre + "shared_head.norm.weight": rand(torch, gen, HIDDEN, norm=True),
        pre + "input_layernorm.weight": rand(torch, gen, HIDDEN, norm=True),
        pre + "self_attn.q_proj.weight": rand(torch, gen, n * hd, HIDDEN, scale=0.3),
        pre + "self_attn.k_proj.weight": rand(torch, gen, k * hd, HIDDEN, scale=0.3),
        pre + "self_attn.v_proj.weight": rand(torch, gen, k * hd, HIDDEN),
        pre + "self_attn.o_proj.weight": rand(torch, gen, HIDDEN, n * hd),
        pre + "post_attention_layernorm.weight": rand(torch, gen, HIDDEN, norm=True),
        pre + "mlp.gate_proj.weight": rand(torch, gen, f, HIDDEN),
        pre + "mlp.up_proj.weight": rand(torch, gen, f, HIDDEN),
        pre + "mlp.down_proj.weight": rand(torch, gen, HIDDEN, f),
    }
    if head:
        sd[pre + "shared_head.head.weight"] = rand(torch, gen, vocab, HIDDEN, scale=0.5)
    return sd


def mtp_config():
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": 2 * HIDDEN,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": LAYERS,
        "rms_norm_eps": 1e-5,
        "vocab_size": VOCAB,
        "max_position_embeddings": 512,
        "num_nextn_predict_layers": 1,
    }


def torch_mtp(torch, sd, embed, lm_head, input_ids, g):
    """MTP module on input_ids [T] with previous hidden states g [T, D] -> (h, logits)."""
    pre = f"model.layers.{LAYERS}."
    e = t_rms(torch, embed[input_ids], sd[pre + "enorm.weight"])
    x = torch.cat([e, t_rms(torch, g, sd[pre + "hnorm.weight"])], -1) @ sd[pre + "eh_proj.weight"].T
    y = t_rms(torch, x, sd[pre + "input_layernorm.weight"])
    w = lambda p: sd[pre + f"self_attn.{p}_proj.weight"]
    x = x + t_attention(torch, y, y, w("q"), w("k"), w("v"), w("o"), 4, 2, HIDDEN // 4)
    x = t_mlp(torch, sd, pre, x)
    head = sd.get(pre + "shared_head.head.weight", lm_head)
    return x, t_rms(torch, x, sd[pre + "shared_head.norm.weight"]) @ head.T


@pytest.mark.parametrize("own_head", [True, False])
def test_mtp_chain_matches_torch(tmp_path, target, own_head):
    torch = import_torch()
    sd = mtp_state(torch, head=own_head)
    path = write_dir(tmp_path / "mtp", mtp_config(), sd)
    assert formats.detect_format(path) == "mtp"
    drafter, dparams = formats.load_drafter_checkpoint("mtp", path, target)
    p = len(TOKENS) - 1
    feats = target_features(target, TOKENS, drafter.hidden_layers)  # final-normed hidden
    cap = 32
    buf = jnp.zeros((1, cap), jnp.int32).at[0, : len(TOKENS)].set(jnp.asarray(TOKENS))
    state = jax.jit(drafter.init, static_argnums=5)(
        dparams, base.bind(target.target, target.params), buf[:, :p], jnp.asarray([p]), jnp.asarray(feats[:, None, :p]), cap
    )
    ctx = DraftContext(tokens=buf, lengths=jnp.asarray([p + 1]), active=jnp.ones((1,), bool))
    sp = SamplingParams.make(temperature=1.0)
    prop, _ = jax.jit(drafter.propose, static_argnums=4)(
        dparams, base.bind(target.target, target.params), state, ctx, 3, sp, jax.random.split(jax.random.key(2), 1)
    )
    embed = torch.as_tensor(np.asarray(target.params["embed"]))
    lm_head = torch.as_tensor(np.asarray(target.params["lm_head"]))
    with torch.no_grad():
        ids = torch.as_tensor(TOKENS[1:])
        g = torch.as_tensor(feats[0, :-1])
        for step in range(3):
            h, logits = torch_mtp(torch, sd, embed, lm_head, ids, g)
            np.testing.assert_allclose(
                np.asarray(prop.probs[0, step]),
                logits[-1].softmax(-1).numpy(),
                rtol=1e-5,
                atol=1e-6,
            )
            ids = torch.cat([ids, torch.tensor([int(prop.tokens[0, step])])])
            g = torch.cat([g, h[-1:]])


# ---- lossless with loaded heads ---------------------------------------------------------------


def loaded(tmp_path, target, kind):
    torch = import_torch()
    if kind == "eagle3":
        return formats.load_drafter_checkpoint("eagle", eagle3_dir(tmp_path, "eagle3")[0], target)
    if kind == "speculators":
        return formats.load_drafter_checkpoint(
            "eagle", eagle3_dir(tmp_path, "speculators-nbf")[0], target
        )
    if kind == "medusa":
        return formats.load_drafter_checkpoint(
            "medusa", medusa_dir(tmp_path, "medusa-token_map")[0], target
        )
    path = write_dir(tmp_path / "mtp", mtp_config(), mtp_state(torch))
    return formats.load_drafter_checkpoint("mtp", path, target)


@pytest.mark.parametrize("kind", ["eagle3", "speculators", "medusa", "mtp", "mtp+lookup"])
def test_loaded_heads_are_greedy_identical(tmp_path, target, kind):
    drafter, dparams = loaded(tmp_path, target, kind.split("+")[0])
    if kind.endswith("+lookup"):  # lookup first: MTP's advance() runs when every row copies
        from jaxspec.drafters import NgramDrafter
        from jaxspec.drafters.prompt_lookup_first import LookupFirst

        drafter = LookupFirst(drafter, NgramDrafter(VOCAB, 1, 2))
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], [30, 31, 32, 33, 34, 35, 36], [4, 5, 4, 5, 4, 5, 4]]
    plain = Engine(target).generate(prompts, max_new_tokens=12, batch_size=3)
    spec = Engine(target, drafter, dparams, num_speculative_tokens=3).generate(
        prompts, max_new_tokens=12, batch_size=3
    )
    for a, b in zip(plain, spec):
        assert a.token_ids == b.token_ids
    assert sum(r.metrics["num_draft_tokens"] for r in spec) > 0  # the loaded head drafted


@pytest.mark.parametrize("kind", ["eagle3", "medusa", "mtp"])
def test_loaded_heads_keep_the_target_distribution(tmp_path, kind):
    """The exact-law test of tests/test_trained_drafters.py with a head read from a file."""
    from distribution import chi_square_pvalue, exact_law
    from test_trained_drafters import NUM_TOKENS, PROMPT, V, sample

    small = tiny_model(seed=5, scale=0.6, vocab=V, layers=LAYERS, eos=(-1,))
    torch = import_torch()
    if kind == "eagle3":
        gen = torch.Generator().manual_seed(3)
        sd = eagle3_state(torch, "eagle3", nd=5)
        ids = torch.as_tensor([0, 2, 3, 5, 6])  # draft vocabulary: 5 of the 8 target tokens
        sd["d2t"], sd["t2d"] = ids - torch.arange(5), torch.zeros(V, dtype=torch.bool)
        sd["t2d"][ids] = True
        sd["embed_tokens.weight"] = rand(torch, gen, V, DRAFT_HIDDEN, scale=1.0)
        path = write_dir(tmp_path / "e", eagle3_config("eagle3", nd=5) | {"vocab_size": V}, sd)
        drafter, dparams = formats.load_drafter_checkpoint("eagle", path, small)
    elif kind == "medusa":  # vLLM layout, token_map: 5 of the 8 target tokens
        sd = medusa_state(torch, "medusa", nd=5, heads=2)
        sd["token_map"] = torch.as_tensor([0, 2, 3, 5, 6])
        for i in range(2):
            sd[f"lm_heads.{i}.weight"] = 3 * sd[f"lm_heads.{i}.weight"]
        cfg = medusa_config("medusa", nd=5, heads=2) | {"vocab_size": V}
        path = write_dir(tmp_path / "md", cfg, sd)
        drafter, dparams = formats.load_drafter_checkpoint("medusa", path, small)
    else:
        sd = mtp_state(torch, head=False)
        path = write_dir(tmp_path / "m", mtp_config() | {"vocab_size": V}, sd)
        drafter, dparams = formats.load_drafter_checkpoint("mtp", path, small)
    sp = SamplingParams.make(temperature=1.0)
    # 8000 rows: what a file can get wrong here (the draft-vocabulary map, a head's weights) moves
    # q grossly; the subtle rule bugs are test_trained_drafters' and test_distributions' (16000)
    counts, results = sample(small, drafter, dparams, sp, rows=8000)
    rate = np.mean([r.metrics["acceptance_rate"] for r in results])
    assert 0.02 < rate < 0.95, rate  # both happen, thousands of times over 8000 rows
    assert chi_square_pvalue(counts, exact_law(small, PROMPT, sp, NUM_TOKENS)) > 1e-3


# ---- export -> import round trips -------------------------------------------------------------


@pytest.mark.parametrize(
    "src,dst",
    [
        ("eagle3", "eagle3"),
        ("eagle3", "speculators"),
        ("speculators-nbf", "speculators"),
        ("eagle3-nbr", "speculators"),
    ],
)
def test_eagle3_round_trip_is_identical(tmp_path, target, src, dst):
    path, _, (layout, _, _) = eagle3_dir(tmp_path, src)
    head = formats.read_head(path, layout)
    again_dir = eagle3_fmt.write(head, tmp_path / "out", dst)
    assert formats.detect_format(again_dir) == dst
    again = formats.read_head(again_dir, dst)
    assert dataclasses_eq(head, again) != "differs"
    for k in ("d2t", "t2d"):  # file-level: offsets and mask as the layout stores them
        assert k in formats.tensors.read_tensors(again_dir)
    d1, p1 = eagle3_fmt.to_drafter(head, target.cfg)
    d2, p2 = eagle3_fmt.to_drafter(again, target.cfg)
    assert d1 == d2
    feats = target_features(target, TOKENS, d1.hidden_layers)
    args = (target.params, jnp.asarray([TOKENS]), jnp.asarray(feats)[:, None])
    np.testing.assert_array_equal(
        np.asarray(jax.jit(d1.forward)(p1, *args)), np.asarray(jax.jit(d2.forward)(p2, *args))
    )


def dataclasses_eq(a, b):
    """b if a and b hold the same config and bit-identical params, else a marker that fails."""
    fa, fb = (
        jax.tree_util.tree_flatten_with_path(a.params),
        jax.tree_util.tree_flatten_with_path(b.params),
    )
    same = [(pa, np.asarray(x).dtype, np.asarray(x).tobytes()) for pa, x in fa[0]] == [
        (pb, np.asarray(y).dtype, np.asarray(y).tobytes()) for pb, y in fb[0]
    ]
    cfg_same = all(
        getattr(a, f) == getattr(b, f)
        for f in a.__dataclass_fields__
        if f not in ("params", "extra")
    )
    return b if same and cfg_same else "differs"


@pytest.mark.parametrize(
    "src,dst",
    [
        ("medusa_fd-pt", "medusa_fd"),
        ("medusa_fd-pt", "medusa"),
        ("medusa-token_map", "medusa"),
        ("medusa-nobias", "medusa"),
    ],
)
def test_medusa_round_trip_is_identical(tmp_path, target, src, dst):
    path, _, layout = medusa_dir(tmp_path, src)
    head = formats.read_head(path, layout)
    again_dir = medusa_fmt.write(head, tmp_path / "out", dst)
    assert formats.detect_format(again_dir) == dst
    assert dataclasses_eq(head, formats.read_head(again_dir, dst)) != "differs"


def test_medusa_draft_vocab_cannot_be_written_to_fasterdecoding(tmp_path):
    path, _, layout = medusa_dir(tmp_path, "medusa-token_map")
    with pytest.raises(JaxspecError, match="FasterDecoding's layout cannot express"):
        medusa_fmt.write(formats.read_head(path, layout), tmp_path / "out", "medusa_fd")


# ---- malformed checkpoints --------------------------------------------------------------------


def _one_line(e):
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_eagle3_missing_and_extra_tensors_are_named(tmp_path, target):
    torch = import_torch()
    sd = eagle3_state(torch, "eagle3")
    del sd["midlayer.hidden_norm.weight"]
    path = write_dir(tmp_path / "a", eagle3_config("eagle3"), sd)
    with pytest.raises(JaxspecError, match="missing tensors midlayer.hidden_norm.weight") as e:
        formats.load_drafter_checkpoint("eagle", path, target)
    _one_line(e)
    sd = eagle3_state(torch, "eagle3") | {"midlayer.extra.weight": torch.zeros(3)}
    path = write_dir(tmp_path / "b", eagle3_config("eagle3"), sd)
    with pytest.raises(JaxspecError, match="unexpected tensors midlayer.extra.weight"):
        formats.load_drafter_checkpoint("eagle", path, target)


@pytest.mark.parametrize(
    "case,match",
    [
        ("hidden", "target's hidden size is 64"),
        ("vocab", "vocabulary of 65 tokens"),
        ("deep", r"tapped target layer 7 \(input convention\) is beyond the target's 6 layers"),
        ("d2t_range", r"d2t \(target id = i \+ d2t\[i\]\): the draft vocabulary maps to target id \d+, outside"),
        ("d2t_dup", "a draft vocabulary must list each target token once"),
        ("t2d", "t2d does not mark exactly"),
        (
            "shape",
            r"tensor midlayer.self_attn.q_proj.weight has shape \[16, 32\], expected \[32, 64\]",
        ),
        ("dtype", "tensor d2t has dtype float32, expected a int tensor"),
        ("no_embed", "add the head's embed_tokens.weight"),
    ],
)
def test_eagle3_malformed_checkpoints_get_their_message(tmp_path, target, case, match):
    torch = import_torch()
    sd = eagle3_state(torch, "eagle3")
    cfg = eagle3_config("eagle3")
    if case == "hidden":
        cfg["target_hidden_size"] = 48
        sd["fc.weight"] = torch.zeros(DRAFT_HIDDEN, 3 * 48)
    elif case == "vocab":
        cfg["vocab_size"] = VOCAB + 1
        sd["embed_tokens.weight"] = torch.zeros(VOCAB + 1, DRAFT_HIDDEN)
        sd["t2d"] = torch.cat([sd["t2d"], torch.zeros(1, dtype=torch.bool)])
    elif case == "deep":
        cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 3, 7]
    elif case == "d2t_range":
        sd["d2t"][-1] = 100
    elif case == "d2t_dup":
        sd["d2t"][1] = sd["d2t"][0] + 0 - 1  # draft id 1 -> the target id of draft id 0
    elif case == "t2d":
        sd["t2d"][:] = False
    elif case == "shape":
        sd["midlayer.self_attn.q_proj.weight"] = torch.zeros(16, 32)
    elif case == "dtype":
        sd["d2t"] = sd["d2t"].float()
    elif case == "no_embed":
        del sd["embed_tokens.weight"]
    path = write_dir(tmp_path / case, cfg, sd)
    with pytest.raises(JaxspecError, match=match) as e:
        formats.load_drafter_checkpoint("eagle", path, target)
    _one_line(e)


@pytest.mark.parametrize(
    "case,match",
    [
        ("missing_head", "missing tensors lm_heads.2.weight"),
        ("token_map_dup", "a draft vocabulary must list each target token once"),
        ("hidden", "hidden size 64, the target 48"),
        ("no_token_map", "there is no token_map"),
    ],
)
def test_medusa_malformed_checkpoints_get_their_message(tmp_path, target, case, match):
    torch = import_torch()
    sd = medusa_state(torch, "medusa", nd=40)
    cfg = medusa_config("medusa", nd=40)
    tgt = target
    if case == "missing_head":
        del sd["lm_heads.2.weight"]
    elif case == "token_map_dup":
        sd["token_map"][3] = sd["token_map"][4]
    elif case == "hidden":
        tgt = tiny_model(seed=1, vocab=VOCAB, layers=2, hidden=48)
    elif case == "no_token_map":
        del sd["token_map"]
    path = write_dir(tmp_path / case, cfg, sd)
    with pytest.raises(JaxspecError, match=match) as e:
        formats.load_drafter_checkpoint("medusa", path, tgt)
    _one_line(e)


def test_format_and_method_mismatch_and_unknown_layout(tmp_path, target):
    path, _, _ = medusa_dir(tmp_path, "medusa-token_map")
    with pytest.raises(JaxspecError, match="method 'eagle' does not read"):
        formats.load_drafter_checkpoint("eagle", path, target)
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(JaxspecError, match="is not a drafter layout jaxspec knows"):
        formats.detect_format(tmp_path / "odd")


def test_pickled_code_is_refused(tmp_path, target):
    """A FasterDecoding .pt holding anything but tensors is refused, never unpickled freely."""
    torch = import_torch()
    path = tmp_path / "evil"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(medusa_config("medusa_fd")))
    torch.save({"0.0.linear.weight": torch.zeros(2), "note": Exotic()}, path / "medusa_lm_head.pt")
    with pytest.raises(JaxspecError, match="weights_only=True"):
        formats.load_drafter_checkpoint("medusa", path, target)


class Exotic:  # not on torch's weights_only allow-list
    pass


# ---- train (method eagle3, medusa) -> export -> import ----------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny target, and jaxspec checkpoints of methods eagle3 and medusa trained briefly on its
    own greedy continuations (the pipeline of python -m jaxspec.train)."""
    from jaxspec.train.data import DataConfig, generate_records
    from jaxspec.train.train import TrainConfig, train

    tgt = tiny_model(seed=1, scale=0.5, eos=(-1,))
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(1, 64, size=int(n)))) for n in rng.integers(4, 12, 16)]
    records = generate_records(
        tgt, prompts, DataConfig(layers=(1, 2, 3, 4), top_k=4, gen_steps=20), np.asarray([-1])
    )
    out, hist = {}, {}
    args = {"eagle3": {"hidden_layers": (1, 2, 3), "ttt_steps": 2}, "medusa": {"num_heads": 2}}
    for method in ("eagle3", "medusa"):
        root = tmp_path_factory.mktemp(method)
        tc = TrainConfig(
            method=method,
            ckpt_dir=str(root / "ckpt"),
            steps=16,
            batch_size=4,
            seq_len=32,
            lr=3e-3 if method == "eagle3" else 3e-2,
            warmup=2,
            save_every=0,
            eval_every=0,
            draft_vocab=48,
            method_args=args[method],
            export_dir=str(root / "export"),
        )
        res = train(
            tc, target=tgt, data=records, eval_prompts=[], log=lambda *a: None, progress=False
        )
        out[method], hist[method] = root / "export", [h["loss"] for h in res.history]
    return tgt, out, hist


def test_eagle3_training_loss_falls(trained):
    _, _, hist = trained
    losses = hist["eagle3"]
    assert np.mean(losses[-3:]) < 0.8 * np.mean(losses[:3]), losses


@pytest.mark.parametrize("fmt", ["eagle3", "speculators"])
def test_trained_eagle3_exports_exactly(tmp_path, trained, fmt):
    from jaxspec.export import export
    from jaxspec.train.load import load_trained_drafter

    tgt, ckpts, _ = trained
    export(ckpts["eagle3"], fmt, tmp_path / fmt, target=tgt)
    ours, p_ours = load_trained_drafter("eagle3", ckpts["eagle3"], tgt)
    pub, p_pub = formats.load_drafter_checkpoint("eagle", tmp_path / fmt, tgt)
    assert (pub.hidden_layers, pub.norm_before_residual) == (
        ours.hidden_layers,
        ours.norm_before_residual,
    )
    feats = target_features(tgt, TOKENS, ours.hidden_layers)
    args = (base.bind(tgt.target, tgt.params), jnp.asarray([TOKENS]), jnp.asarray(feats)[:, None])
    np.testing.assert_array_equal(
        np.asarray(jax.jit(ours.forward)(p_ours, *args)),
        np.asarray(jax.jit(pub.forward)(p_pub, *args)),
    )
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    a = Engine(tgt, ours, p_ours, num_speculative_tokens=3).generate(
        prompts, max_new_tokens=16, batch_size=2
    )
    b = Engine(tgt, pub, p_pub, num_speculative_tokens=3).generate(
        prompts, max_new_tokens=16, batch_size=2
    )
    plain = Engine(tgt).generate(prompts, max_new_tokens=16, batch_size=2)
    for x, y, z in zip(a, b, plain):
        assert x.token_ids == y.token_ids == z.token_ids
        assert x.metrics["num_accepted_tokens"] == y.metrics["num_accepted_tokens"]
    export(ckpts["eagle3"], fmt, tmp_path / "embed", target=tgt, include_embed=True)
    written = formats.tensors.read_tensors(tmp_path / "embed")
    np.testing.assert_array_equal(written["embed_tokens.weight"], np.asarray(tgt.params["embed"]))


def test_trained_medusa_exports_exactly_to_vllm(tmp_path, trained):
    from jaxspec.drafters import medusa as jaxspec_medusa
    from jaxspec.drafters.medusa_blocks import head_logits
    from jaxspec.export import export
    from jaxspec.train.load import load_trained_drafter

    tgt, ckpts, _ = trained
    export(ckpts["medusa"], "medusa", tmp_path / "m", target=tgt)
    _, p_ours = load_trained_drafter("medusa", ckpts["medusa"], tgt)
    _, p_pub = formats.load_drafter_checkpoint("medusa", tmp_path / "m", tgt)
    np.testing.assert_array_equal(np.asarray(p_pub["d2t"]), np.asarray(p_ours["d2t"]))
    h = jnp.asarray(np.random.default_rng(1).normal(size=(3, tgt.cfg.hidden_size)), jnp.float32)
    np.testing.assert_allclose(
        np.asarray(jax.jit(head_logits, static_argnums=2)(p_pub, h, 2)),
        np.asarray(jax.jit(jaxspec_medusa.head_logits)(p_ours, h)),
        rtol=1e-6,
        atol=1e-6,
    )
    with pytest.raises(JaxspecError, match="FasterDecoding's layout cannot express"):
        export(ckpts["medusa"], "medusa_fd", tmp_path / "fd", target=tgt)


def test_export_cli_errors_are_one_line_exit_2(tmp_path, trained, capsys):
    from jaxspec.export import main

    _, ckpts, _ = trained
    cases = [
        (
            [
                "--checkpoint",
                str(tmp_path / "nope"),
                "--format",
                "eagle3",
                "--out",
                str(tmp_path / "o"),
            ],
            "does not exist",
        ),
        (
            [
                "--checkpoint",
                str(ckpts["medusa"]),
                "--format",
                "eagle3",
                "--out",
                str(tmp_path / "o"),
            ],
            "cannot be written as eagle3: use --format medusa or medusa_fd",
        ),
        (
            [
                "--checkpoint",
                str(ckpts["eagle3"]),
                "--format",
                "gguf",
                "--out",
                str(tmp_path / "o"),
            ],
            "invalid choice",
        ),
    ]
    for argv, match in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and match in err and "\n" not in err, err


def test_jaxspec_eagle_checkpoint_export_is_refused(tmp_path, capsys):
    """The shipped jaxspec EAGLE head is not the EAGLE-3 architecture: no inexact export."""
    from jaxspec.export import main

    argv = [
        "--checkpoint",
        "checkpoints/smollm2-135m-eagle",
        "--format",
        "eagle3",
        "--out",
        str(tmp_path / "o"),
    ]
    assert main(argv) == 2
    assert "cannot express exactly: train method eagle3" in capsys.readouterr().err


def test_speculative_config_reads_published_checkpoints(tmp_path, target):
    from jaxspec.build import build_drafter
    from jaxspec.drafters.eagle3 import Eagle3Drafter
    from jaxspec.drafters.mtp import MtpDrafter

    torch = import_torch()
    e_path = eagle3_dir(tmp_path, "speculators-nbf")[0]
    m_path = write_dir(tmp_path / "mtp", mtp_config(), mtp_state(torch))
    drafter, _ = build_drafter(spec_of("eagle", checkpoint=e_path), target)
    assert isinstance(drafter, Eagle3Drafter)
    drafter, _ = build_drafter(
        spec_of("eagle3", checkpoint=e_path, checkpoint_format="speculators"), target
    )
    assert isinstance(drafter, Eagle3Drafter)
    drafter, _ = build_drafter(
        spec_of("mtp", ["speculative.lookup.min_ngram=2"], checkpoint=m_path), target
    )
    assert isinstance(drafter.inner, MtpDrafter)  # prompt lookup first, MTP elsewhere
    with pytest.raises(
        JaxspecError, match="in the eagle3 layout, which method 'medusa' does not read"
    ):
        build_drafter(spec_of("medusa", checkpoint=e_path, checkpoint_format="eagle3"), target)
    with pytest.raises(JaxspecError, match="draft_confidence works with jaxspec's own EAGLE"):
        build_drafter(spec_of("eagle", checkpoint=e_path, draft_confidence=0.5), target)
    with pytest.raises(JaxspecError, match="speculative.eagle.checkpoint_format"):
        spec_of("eagle", checkpoint=e_path, checkpoint_format="gguf")


def spec_of(method, more=(), **options):
    """The speculative section as a user writes it: speculative.<method>.<key>=value."""
    from jaxspec.config import load_config

    overrides = [f"speculative.method={method}", "speculative.num_speculative_tokens=2", *more]
    overrides += [f"speculative.{method}.{k}={v}" for k, v in options.items()]
    return load_config(None, overrides).speculative


def test_published_conversion_cli(tmp_path, target, capsys):
    """python -m jaxspec.export between published layouts needs no target."""
    from jaxspec.export import main

    path, _, _ = eagle3_dir(tmp_path, "speculators-nbf")
    assert (
        main(["--checkpoint", str(path), "--format", "speculators", "--out", str(tmp_path / "o")])
        == 0
    )
    assert json.loads(capsys.readouterr().out)["from"] == "speculators"
    argv = ["--checkpoint", str(path), "--format", "eagle3", "--out", str(tmp_path / "o2")]
    assert main(argv) == 2  # norm_before_fc has no place in the original layout
    assert "export with --format speculators" in capsys.readouterr().err
    argv = ["--checkpoint", str(path), "--format", "speculators", "--out", str(tmp_path / "o")]
    assert main(argv) == 2  # not empty
    assert "already holds a jaxspec checkpoint: pass --force" in capsys.readouterr().err


# docs/drafters.md's command, run here through the CLI's `main` on the session's SmolLM2 (the
# docs test leaves it to this test: tests/test_docs.py RUN_ELSEWHERE)
MEDUSA_EXPORT_COMMAND = ("python -m jaxspec.export --checkpoint checkpoints/smollm2-135m-medusa "
                         "--format medusa --out")


def test_shipped_medusa_exports_exactly(tmp_path, smollm2, monkeypatch, capsys):
    """The shipped SmolLM2 Medusa heads written in vLLM's layout by the docs' command line and
    read back: same params."""
    import shlex

    import jaxspec.loading
    from jaxspec.export import main
    from jaxspec.train.load import load_trained_drafter

    monkeypatch.setattr(jaxspec.loading, "load_model", lambda *a, **k: smollm2)
    assert main(shlex.split(MEDUSA_EXPORT_COMMAND)[3:] + [str(tmp_path / "m")]) == 0
    assert json.loads(capsys.readouterr().out)["format"] == "medusa"
    _, ours = load_trained_drafter("medusa", "checkpoints/smollm2-135m-medusa", smollm2)
    pub, theirs = formats.load_drafter_checkpoint("medusa", tmp_path / "m", smollm2)
    assert pub.num_heads == ours["w"].shape[0]
    np.testing.assert_array_equal(np.asarray(theirs["w"][:, 0]), np.asarray(ours["w"]))
    np.testing.assert_array_equal(np.asarray(theirs["b"][:, 0]), np.asarray(ours["b"]))
    np.testing.assert_array_equal(np.asarray(theirs["heads"][0]), np.asarray(ours["head"]))
    np.testing.assert_array_equal(np.asarray(theirs["d2t"]), np.asarray(ours["d2t"]))
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["truncated_vocab_size"] == len(ours["d2t"]) and config["original_lm_head"]


def test_mtp_stored_with_the_target(tmp_path):
    """An HF target directory that also holds its MTP module (`model.layers.{L}.*`,
    num_nextn_predict_layers): the target loads without it, the drafter reads it from there."""
    from conftest import make_tiny_checkpoint
    from safetensors.torch import save_file

    from jaxspec.build import build_drafter
    from jaxspec.loading import load_model

    torch = import_torch()
    path = make_tiny_checkpoint(tmp_path / "with_mtp", "llama", seed=7, tie_word_embeddings=False)
    config = json.loads((path / "config.json").read_text())
    layers, vocab = config["num_hidden_layers"], config["vocab_size"]
    (path / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 1}))
    save_file(
        mtp_state(torch, head=False, layers=layers, vocab=vocab), str(path / "mtp.safetensors")
    )
    tgt = load_model(str(path), layout="unrolled")
    drafter, dparams = build_drafter(spec_of("mtp", checkpoint=path), tgt)
    assert drafter.hidden_layers == (layers,)
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    plain = Engine(tgt).generate(prompts, max_new_tokens=10, batch_size=2)
    spec_out = Engine(tgt, drafter, dparams, num_speculative_tokens=2).generate(
        prompts, max_new_tokens=10, batch_size=2
    )
    for a, b in zip(plain, spec_out):
        assert a.token_ids == b.token_ids
    (path / "config.json").write_text(json.dumps(config))  # without the flag: refused, named
    with pytest.raises(JaxspecError, match=f"num_hidden_layers={layers}, but the tensors hold layers 0..{layers}"):
        load_model(str(path), layout="unrolled")


def test_eagle3_tap_ids_as_layer_outputs(tmp_path, target):
    """speculative.eagle.eagle3_layer_ids: output reads explicit ids as SGLang / SpecForge do (id i =
    the output of layer i, hidden_states[i + 1]); the default tap set is the same either way."""
    from jaxspec.build import build_drafter

    torch = import_torch()
    sd = eagle3_state(torch, "eagle3")
    explicit = write_dir(tmp_path / "x", eagle3_config("eagle3", ids=(0, 2, 3)), sd)
    default = write_dir(tmp_path / "d", eagle3_config("eagle3", ids=None), sd)
    spec = lambda path, conv: spec_of("eagle", checkpoint=path, eagle3_layer_ids=conv)
    assert build_drafter(spec(explicit, "input"), target)[0].hidden_layers == (0, 2, 3)
    assert build_drafter(spec(explicit, "output"), target)[0].hidden_layers == (1, 3, 4)
    for conv in ("input", "output"):
        assert build_drafter(spec(default, conv), target)[0].hidden_layers == (2, 3, 3)
    deep = write_dir(tmp_path / "deep", eagle3_config("eagle3", ids=(1, 3, 5)), sd)
    build_drafter(spec(deep, "input"), target)  # 5 < 6 layers: fine as an input id
    with pytest.raises(JaxspecError, match=r"tapped target layer 5 \(output convention\)"):
        build_drafter(spec(deep, "output"), target)
    with pytest.raises(JaxspecError, match="speculative.eagle.eagle3_layer_ids"):
        spec(deep, "middle")
