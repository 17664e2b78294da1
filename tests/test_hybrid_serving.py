"""A hybrid target (Qwen3.5: linear-attention layers beside full attention) on the paged serving
path (serving/paged_hybrid.py): the attention layers' k/v in the page pool, each row's
linear-state rings in its slot, a state snapshot per page for the prefix cache.

A tiny random `Qwen3_5ForCausalLM` (vocab 256, a byte tokenizer) written by transformers:
  * served over loopback with the `openai` client (paged, prefix cache on, n-gram speculation
    at γ 3 over 3 concurrent requests, so rows accept different lengths in one batch), its
    greedy text equals the CLI's (`python -m jaxspec.generate`, plain decoding);
  * structured output (a JSON schema) equals the engine's constrained greedy run and
    validates; logprobs equal a full forward's log-softmax over the served tokens;
  * the prefix cache: prompts sharing a head of several pages hit the cache (their rings start
    from the snapshot of the last shared page) and give the greedy tokens of a plain engine run,
    whole and in page-sized chunks, plain and under a perturbed-copy draft model at batch 2;
    restoring the snapshot of the page before (a broken restore) changes them.
"""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")

from loopback import NAME, listening, openai_client  # noqa: E402
from jaxspec.engine.runner import Engine  # noqa: E402
from jaxspec.errors import JaxspecError  # noqa: E402
from jaxspec.serving import Sampling, Server, paged_hybrid  # noqa: E402
from jaxspec.serving.http import make_app  # noqa: E402
from jaxspec.serving.scheduler import Scheduler  # noqa: E402

CONTEXT = 128
NEW = 12
PAGE = 8
PROMPTS = ["the cat sat on the mat", "abcabcabc abcabc", "hello there, hello"]
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                           "ok": {"type": "boolean"}},
          "required": ["city", "ok"]}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from conftest import save_byte_tokenizer
    from test_qwen3_5 import hf_model

    path = tmp_path_factory.mktemp("qwen3_5_bytes")
    hf = hf_model(vocab=256)
    hf.config.eos_token_id = hf.generation_config.eos_token_id = 0  # the tokenizer's (byte 0)
    hf.save_pretrained(path)
    save_byte_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def model(checkpoint):
    import dataclasses

    from jaxspec.loading import load_model

    loaded = load_model(checkpoint, layout="auto")
    return dataclasses.replace(loaded, name=NAME)


@pytest.fixture(scope="module")
def engine(model):
    from jaxspec.drafters.prompt_lookup import NgramDrafter

    return Engine(model, NgramDrafter(256, 1, 3), num_speculative_tokens=3, max_context=CONTEXT,
                  logprobs=3)


@pytest.fixture(scope="module")
def served(engine):
    server = Server(engine, slots=3, max_context=CONTEXT, steps_per_call=4, max_queue=8,
                    model_name=NAME, page_size=PAGE, structured=True)
    with listening(make_app(server)) as url:
        yield server, openai_client(url)
    server.close()


def cli_greedy(checkpoint, prompts, capsys) -> list[dict]:
    from jaxspec.generate import main

    args = ["--model", str(checkpoint), "--no-chat-template", "--max-new-tokens", str(NEW),
            "--temperature", "0", "--json", "--batch-size", "1"]  # not --quiet: process-wide
    for p in prompts:
        args += ["--prompt", p]
    capsys.readouterr()
    assert main(args) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]


def test_served_greedy_equals_the_cli(checkpoint, served, capsys):
    """3 concurrent requests (one batch, rows accepting different draft lengths) over a paged
    pool; the same text and token counts as the CLI's plain greedy runs."""
    from concurrent.futures import ThreadPoolExecutor

    server, client = served
    cli = cli_greedy(checkpoint, PROMPTS, capsys)
    ask = lambda p: client.completions.create(  # noqa: E731
        model=NAME, prompt=p, max_tokens=NEW, temperature=0)
    with ThreadPoolExecutor(3) as pool:
        out = list(pool.map(ask, PROMPTS))
    assert [o.choices[0].text for o in out] == [r["text"] for r in cli]
    assert [o.usage.completion_tokens for o in out] == [r["num_generated_tokens"] for r in cli]
    assert server.health()["prefix_cache"] == "on" and server.scheduler.kv_layout == "paged"


def test_structured_output_and_logprobs_on_the_served_hybrid(engine, served):
    from jaxspec.constrain import Constraint
    from tiny import sequence_logits

    _, client = served
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    r = client.completions.create(model=NAME, prompt="abc", max_tokens=64, temperature=0,
                                  extra_body={"response_format": fmt})
    text = r.choices[0].text
    jsonschema.validate(json.loads(text), SCHEMA)
    ids = engine.model.tokenizer.encode("abc")
    solo = engine.generate([ids], max_new_tokens=64, constraint=Constraint(json_schema=SCHEMA))
    assert text == solo[0].text

    prompt = PROMPTS[0]
    ids = engine.model.tokenizer.encode(prompt)
    ref = engine.generate([ids], max_new_tokens=NEW)[0]
    out = client.completions.create(model=NAME, prompt=prompt, max_tokens=NEW, temperature=0,
                                    logprobs=3)
    got = out.choices[0].logprobs.token_logprobs
    seq = list(ids) + list(ref.token_ids)
    x = sequence_logits(engine.model.target, engine.model.params, seq)
    full = x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - x.max(-1, keepdims=True)
    want = [full[len(ids) - 1 + i, t] for i, t in enumerate(ref.token_ids)]
    assert np.allclose(got, want, atol=2e-4)


# ---------------------------------------------------------------------- prefix cache snapshots


def shared_head_prompts():
    """Four prompts sharing a 27-token head (3 full pages of 8), different tails."""
    rng = np.random.default_rng(1)
    head = [int(t) for t in rng.integers(3, 256, size=27)]
    return [head + [int(t) for t in rng.integers(3, 256, size=n)] for n in (3, 9, 5, 12)]


@pytest.fixture(scope="module")
def plain(model):
    out = Engine(model).generate(shared_head_prompts(), max_new_tokens=NEW, batch_size=4)
    return [r.token_ids for r in out]


def serve_rows(model, drafter=None, dparams=None, chunk=None):
    from test_serving import run

    engine = Engine(model, drafter, dparams, num_speculative_tokens=3 if drafter else 0,
                    max_context=CONTEXT)
    sched = Scheduler(engine, slots=2, max_context=CONTEXT, steps_per_call=4, page_size=PAGE,
                      prefill_chunk=chunk)
    done = run(sched, [(i, p, Sampling(max_tokens=NEW))
                       for i, p in enumerate(shared_head_prompts())])
    return sched, done


def perturbed_draft(model):
    from jaxspec.drafters.draft_model import ModelDrafter
    from test_qwen3_5 import _perturbed

    return ModelDrafter(model=model.target, target_vocab=256), _perturbed(model.params)


@pytest.mark.parametrize("variant", ["plain", "chunked", "draft_model"])
def test_a_prefix_hit_gives_the_tokens_of_a_miss(model, plain, variant):
    """The first request misses and names its pages; the next three hit its 3 shared pages
    (24 tokens each) and start their linear state from the last one's snapshot. chunked: the
    prompts also go in chunks of two pages (each chunk resumes from the previous snapshot),
    the first request's too: the second arrives (round 1) when only its first chunk's 2 pages
    are written, so it shares those 16 tokens (resuming from page 1's snapshot) and computes
    the third shared page itself; the last two share all 3."""
    drafter, dparams = perturbed_draft(model) if variant == "draft_model" else (None, None)
    sched, done = serve_rows(model, drafter, dparams, 2 * PAGE if variant == "chunked" else None)
    assert sched.prefix_cache == "on" and sched.kv_layout == "paged"
    assert [c.token_ids for c in done] == plain
    second = 2 * PAGE if variant == "chunked" else 3 * PAGE
    assert [c.metrics["prefix_cached_tokens"] for c in done] == [0, second] + [3 * PAGE] * 2
    if variant == "draft_model":  # drafts both accepted and rejected
        acc = [c.metrics["num_accepted_tokens"] for c in done]
        drafted = sum(c.metrics["num_draft_tokens"] for c in done)
        assert 0 < sum(acc) < drafted


@pytest.mark.patches_traced_code
def test_restoring_the_wrong_snapshot_is_seen(model, plain, monkeypatch):
    """Broken: a hit starts from the snapshot of the page before the last shared one."""
    monkeypatch.setattr(paged_hybrid, "snapshot_page", lambda lengths, size: lengths // size - 2)
    sched, done = serve_rows(model)
    assert sched.stats.prefix_cached_tokens == 3 * 3 * PAGE
    same = [c.token_ids == p for c, p in zip(done, plain)]
    assert same[0] and not any(same[1:])  # the miss is right, every hit wrong


def test_a_chunk_that_ends_mid_page_is_refused(model):
    engine = Engine(model, max_context=CONTEXT)
    with pytest.raises(JaxspecError, match="multiple of serving.page_size=8"):
        Scheduler(engine, slots=2, max_context=CONTEXT, page_size=PAGE, prefill_chunk=12)


# ------------------------------------------------- drafters reading target features, prefix hits


def feature_drafter(name: str, model):
    """A random head of each family that reads the target's hidden states (taps of linear and
    full-attention layers alike) and its params."""
    import jax

    from jaxspec.train import methods
    from tiny import dflash_like

    ids = np.arange(0, 256, 2, dtype=np.int32)
    if name == "dflash":
        return dflash_like(model)
    if name == "mtp":  # Qwen3.5's own head layout, random weights
        from jaxspec.drafters.qwen3_5_mtp import Qwen35MtpDrafter
        from jaxspec.models import qwen3_5

        cfg = model.target.cfg
        rnd = qwen3_5.init_params(cfg, jax.random.key(3), scale=0.3)
        d = cfg.hidden_size
        dparams = {"pre_fc_norm_embedding": rnd["final_norm"], "pre_fc_norm_hidden": rnd["final_norm"],
                   "fc": 0.2 * jax.random.normal(jax.random.key(4), (d, 2 * d)),
                   "norm": rnd["final_norm"], "layer": rnd["layers"][cfg.layer_types.index(
                       "full_attention")]}
        return Qwen35MtpDrafter(cfg=cfg, target_vocab=cfg.vocab_size,
                                hidden_layers=(cfg.num_layers,)), dparams
    m = methods.Eagle3(hidden_layers=(1, 2, 3)) if name == "eagle3" else \
        methods.Eagle(hidden_layers=(1, 2, 2), input_scale=1.0)
    params, frozen = m.init(model, ids, jax.random.key(7))
    return m.drafter(model.target), m.runtime(params, frozen)


def sampled_rows(model, drafter, dparams):
    """One scheduler: prompt A (a miss), then A again and B sharing A's 3 head pages (hits),
    sampled at temperature 1 with fixed seeds (A's two runs share theirs)."""
    from test_serving import run

    engine = Engine(model, drafter, dparams, num_speculative_tokens=3, max_context=CONTEXT)
    sched = Scheduler(engine, slots=2, max_context=CONTEXT, steps_per_call=4, page_size=PAGE)
    a, b = shared_head_prompts()[:2]
    ask = lambda seed: Sampling(max_tokens=NEW, temperature=1.0, seed=seed)  # noqa: E731
    done = run(sched, [(0, a, ask(7)), (1, a, ask(7)), (1, b, ask(8))])
    assert sched.prefix_cache == "on"
    assert [c.metrics["prefix_cached_tokens"] for c in done] == [0, 3 * PAGE, 3 * PAGE]
    return [c.token_ids for c in done]


@pytest.mark.parametrize("name", ["eagle", "eagle3", "dflash", "mtp"])
def test_feature_drafters_share_prefixes_and_draft_as_on_a_miss(model, name):
    """Prefix caching on for drafters that read the target's hidden states: a hit's features
    come from the pages. A sampled row with a fixed seed depends on every draft (its tokens and
    q enter the acceptance test), so the hit equals the miss token for token only if the hit's
    drafter starts from the features the miss computed."""
    miss, hit, other = sampled_rows(model, *feature_drafter(name, model))
    assert hit == miss and other != miss


@pytest.mark.patches_traced_code
def test_features_missing_from_a_hit_are_seen(model, monkeypatch):
    """Broken: a hit's drafter (DFlash, which attends over the context's features) reads zeros
    for the shared positions' features."""
    from jaxspec.serving import paged_features

    read = paged_features.read

    def tail_only(pool, table, width):  # the shared pages' features dropped
        return read(pool, table, width).at[:, :, : 3 * PAGE].set(0.0)

    monkeypatch.setattr(paged_features, "read", tail_only)
    miss, hit, _ = sampled_rows(model, *feature_drafter("dflash", model))
    assert hit != miss
