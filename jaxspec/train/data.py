"""Distillation data: run the target over prompts and record what drafters learn from.

Two sources, both written as shards `shard_00000.npz ...` under `out_dir` (resumable: a finished
shard is skipped; a shard is written to a temp name and renamed, so a kill never leaves half a one):

  gen  self-distillation: the target's own greedy responses to prompts (GSM8K train questions and
       the hand-written set in `prompts.COMPOSED`). Prompt positions are recorded too.
  tf   teacher-forced text: chat-templated GSM8K question + reference answer, one forward each.

Per shard (N rows, T positions, right-padded; row n valid below `lengths[n]`):
  tokens      int32[N, T]
  lengths     int32[N]
  hidden      f16[len(layers), N, T, D]   target hidden states (HF indexing) AFTER token t
  topk_ids    int32[N, T, K]              target's next-token distribution at t (predicts t+1),
  topk_probs  f16[N, T, K]                temperature 1, top-K of it
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.errors import JaxspecError
from jaxspec.engine.runner import Engine
from jaxspec.jsonl import read_jsonl
from jaxspec.loading import load_model
from jaxspec.train import prompts as prompt_sets


def recorded_layers(dc, cfg) -> tuple[int, ...]:
    """The hidden states a data run records: as configured, else low/mid/high + final of `cfg`
    (the target, or anything with num_layers)."""
    if dc.layers is not None:
        return tuple(dc.layers)
    n = cfg.num_layers
    return (2, n // 2, n - 3, n)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    out_dir: str = "out/distill/smollm2-135m"
    model: str = "smollm2-135m"
    gsm8k_path: str = "../shared/data/gsm8k_train.jsonl"
    # recorded target hidden states: low / mid / high for EAGLE-3, final-normed for Medusa;
    # None: (2, L//2, L-3, L) of the model recorded
    layers: tuple[int, ...] | None = None
    top_k: int = 8
    gen_composed: int = 64  # hand-written prompts answered by the target
    gen_templated: int = 0  # task templates over GSM8K train text and topics (prompts.templated)
    templated_offset: int = 0  # first GSM8K train row the templates use
    gen_gsm8k: int = 64  # GSM8K questions answered by the target
    gen_passages: int = 0  # stage 1: the target writes news reports / encyclopedia entries
    tasks_from: str = ""  # stage 2: a stage-1 out_dir whose passages the task prompts are built on
    gen_tasks: int = 0  # stage 2: task prompts over those passages (prompts.passage_tasks)
    tasks_draw: int = 0  # 0: the fixed-stride sequence; k > 0: random pairings with seed k
    prompts_file: str = ""  # a JSONL of {"prompt": ...} rows (scripts/corpus_prompts.py writes one)
    gen_file: int = 0  # the first gen_file of its prompts answered by the target
    gen_batch: int = 32
    gen_steps: int = 96  # new tokens per generated response
    tf_gsm8k: int = 256  # GSM8K question + reference answer, teacher-forced
    tf_batch: int = 16
    max_len: int = 256


def _bucket(n: int, step: int = 32) -> int:
    return -(-n // step) * step


def _topk(logits, k):  # f32[..., V] -> (int32[..., K], f16[..., K])
    probs = jax.nn.softmax(logits, axis=-1)
    vals, ids = jax.lax.top_k(probs, k)
    return ids.astype(jnp.int32), vals.astype(jnp.float16)


def _layers_f16(layer_hidden):
    return layer_hidden.astype(jnp.float16)


def _teacher_forced(params, tokens, target, layers, k):
    """tokens int32[B, T] -> hidden f16[nl, B, T, D], topk ids/probs [B, T, K]."""
    b, t = tokens.shape
    cache = target.init_cache(params, b, t)
    out = target.forward(params, tokens, cache, taps=layers)
    ids, probs = _topk(target.logits(params, out.hidden), k)
    return _layers_f16(out.taps), ids, probs


def _generate(params, prompt, lengths, target, layers, k, steps):
    """Greedy: prompt int32[B, P] (right-padded, lengths[B]) -> prompt records and `steps` new
    tokens with their records. Step s runs token g_s and produces g_{s+1}."""
    b, p = prompt.shape
    cache = target.init_cache(params, b, p + steps)
    out = target.forward(params, prompt, cache, taps=layers)
    logits = target.logits(params, out.hidden)  # [B, P, V]
    p_ids, p_probs = _topk(logits, k)
    last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
    first = jnp.argmax(last, axis=-1).astype(jnp.int32)

    def step(carry, _):
        cache, tok = carry
        o = target.forward(params, tok[:, None], cache, taps=layers)
        lg = target.logits(params, o.hidden[:, 0])
        ids, probs = _topk(lg, k)
        nxt = jnp.argmax(lg, axis=-1).astype(jnp.int32)
        rec = (tok, _layers_f16(o.taps[:, :, 0]), ids, probs)
        return (o.cache.with_lengths(o.cache.lengths + 1), nxt), rec

    carry = (out.cache.with_lengths(lengths), first)
    _, (toks, hid, ids, probs) = jax.lax.scan(step, carry, None, length=steps)
    gen = (toks.T, jnp.moveaxis(hid, 0, 2), jnp.swapaxes(ids, 0, 1), jnp.swapaxes(probs, 0, 1))
    return (_layers_f16(out.taps), p_ids, p_probs), gen


_teacher_forced_jit = jax.jit(_teacher_forced, static_argnames=("target", "layers", "k"))
_generate_jit = jax.jit(_generate, static_argnames=("target", "layers", "k", "steps"))


def _jobs(dc: DataConfig, encode, tokenizer, eos: int) -> list[tuple[str, list]]:
    rows, _ = prompt_sets.split_gsm8k(prompt_sets.read_gsm8k(dc.gsm8k_path))
    gen_prompts = [encode(p) for p in prompt_sets.COMPOSED[: dc.gen_composed]]
    gen_prompts += [encode(r["question"]) for r in rows[: dc.gen_gsm8k]]
    texts = [r["question"] for r in rows[dc.templated_offset :]]
    gen_prompts += [encode(p) for p in prompt_sets.templated(texts, dc.gen_templated)]
    gen_prompts += [encode(p) for _, p in prompt_sets.passage_prompts()[: dc.gen_passages]]
    if dc.gen_tasks:
        passages = read_passages(dc.tasks_from, tokenizer)
        gen_prompts += [encode(p) for p in prompt_sets.passage_tasks(passages, dc.gen_tasks, dc.tasks_draw)]
    if dc.gen_file:
        gen_prompts += [encode(p) for p in read_prompts_file(dc.prompts_file)[: dc.gen_file]]
    gen_prompts = sorted({tuple(p): None for p in gen_prompts}, key=len)  # unique; less padding
    gen_prompts = [list(p) for p in gen_prompts]
    tf_rows = rows[dc.gen_gsm8k : dc.gen_gsm8k + dc.tf_gsm8k]
    tf_seqs = []
    for r in tf_rows:
        ids = encode(r["question"])
        ids += tokenizer.encode(prompt_sets.clean_answer(r["answer"]), add_special_tokens=False)
        tf_seqs.append((ids + [eos])[: dc.max_len])
    tf_seqs = sorted(tf_seqs, key=len)
    jobs = [("gen", gen_prompts[i : i + dc.gen_batch]) for i in range(0, len(gen_prompts), dc.gen_batch)]
    jobs += [("tf", tf_seqs[i : i + dc.tf_batch]) for i in range(0, len(tf_seqs), dc.tf_batch)]
    return jobs


def read_prompts_file(path: str) -> list[str]:
    """The "prompt" field of every row of a JSONL prompts file, in order."""
    hint = ": write it with `python scripts/corpus_prompts.py`"
    rows = read_jsonl(path or "(prompts_file unset)", "prompts_file", hint)
    bad = [n for n, row in rows if not isinstance(row, dict) or not isinstance(row.get("prompt"), str)]
    if bad:
        raise JaxspecError(f"prompts_file {path} line {bad[0]}: each row needs a string field \"prompt\"")
    return [row["prompt"] for _, row in rows]


def read_passages(stage1_dir: str, tokenizer) -> list[tuple[str, str]]:
    """(subject, response text) of every stage-1 row (`gen_passages`), in prompt order."""
    subject_of = {p: s for s, p in prompt_sets.passage_prompts()}
    files = sorted(Path(stage1_dir).glob("shard_[0-9]*[0-9].npz"))
    if not files:
        raise FileNotFoundError(f"no stage-1 shards in {stage1_dir}: build configs/train/data-passages.yaml first")
    found = {}
    for f in files:
        shard = np.load(f)
        for row, n in zip(shard["tokens"], shard["lengths"]):
            text = tokenizer.decode(row[:n].tolist(), skip_special_tokens=False)
            user = text.split("<|im_start|>user\n", 1)[-1].split("<|im_end|>", 1)[0]
            reply = text.split("<|im_start|>assistant\n", 1)[-1].split("<|im_end|>", 1)[0].strip()
            if user in subject_of and len(reply) > 200:
                found[user] = (subject_of[user], reply)
    return [found[p] for _, p in prompt_sets.passage_prompts() if p in found]


def _pad(seqs: list[list[int]], width: int) -> tuple[np.ndarray, np.ndarray]:
    out = np.zeros((len(seqs), width), np.int32)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = s
    return out, np.array([len(s) for s in seqs], np.int32)


def teacher_forced_records(model, seqs, dc):
    """Records of token-id sequences `seqs` run through the target (one shard's dict)."""
    tokens, lengths = _pad(seqs, _bucket(max(len(s) for s in seqs)))
    hid, ids, probs = jax.device_get(
        _teacher_forced_jit(
            model.params, jnp.asarray(tokens), model.target, recorded_layers(dc, model.target),
            dc.top_k,
        )
    )
    return dict(tokens=tokens, lengths=lengths, hidden=hid, topk_ids=ids, topk_probs=probs)


def generate_records(model, seqs, dc, eos_ids):
    """Greedy responses to token-id prompts `seqs`, with their records (one shard's dict)."""
    prompt, plen = _pad(seqs, _bucket(max(len(s) for s in seqs)))
    s = dc.gen_steps
    (p_hid, p_ids, p_probs), (g_tok, g_hid, g_ids, g_probs) = jax.device_get(
        _generate_jit(
            model.params, jnp.asarray(prompt), jnp.asarray(plen), model.target,
            recorded_layers(dc, model.target), dc.top_k, s,
        )
    )
    n, t = prompt.shape[0], prompt.shape[1] + s
    nl, d = p_hid.shape[0], p_hid.shape[-1]
    tokens = np.zeros((n, t), np.int32)
    hidden = np.zeros((nl, n, t, d), np.float16)
    ids = np.zeros((n, t, dc.top_k), np.int32)
    probs = np.zeros((n, t, dc.top_k), np.float16)
    lengths = np.zeros((n,), np.int32)
    for i, m in enumerate(plen):
        tokens[i, :m], tokens[i, m : m + s] = prompt[i, :m], g_tok[i]
        hidden[:, i, :m], hidden[:, i, m : m + s] = p_hid[:, i, :m], g_hid[:, i]
        ids[i, :m], ids[i, m : m + s] = p_ids[i, :m], g_ids[i]
        probs[i, :m], probs[i, m : m + s] = p_probs[i, :m], g_probs[i]
        is_eos = np.isin(g_tok[i], eos_ids)
        lengths[i] = m + (int(np.argmax(is_eos)) + 1 if is_eos.any() else s)
    return dict(tokens=tokens, lengths=lengths, hidden=hidden, topk_ids=ids, topk_probs=probs)


def build(dc: DataConfig, model=None) -> Path:
    """Write every missing shard; returns the output dir. Prints a progress bar with an ETA."""
    from tqdm import tqdm

    if model is None:
        model = load_model(dc.model, layout="auto")  # no gradients here: the fast layout
    out = Path(dc.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"config": dataclasses.asdict(dc), "layers": list(recorded_layers(dc, model.target))}
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    encode = Engine(model).encode
    jobs = _jobs(dc, encode, model.tokenizer, model.eos_token_ids[0])
    todo = [(i, j) for i, j in enumerate(jobs) if not (out / f"shard_{i:05d}.npz").exists()]
    bar = tqdm(total=len(jobs), initial=len(jobs) - len(todo), desc="distill data", unit="shard")
    ntok = 0
    t0 = time.time()
    for i, (kind, seqs) in todo:
        if kind == "gen":
            rec = generate_records(model, seqs, dc, np.asarray(model.eos_token_ids))
        else:
            rec = teacher_forced_records(model, seqs, dc)
        tmp = out / f"shard_{i:05d}.tmp.npz"
        np.savez(tmp, kind=np.array(kind), **rec)
        os.replace(tmp, out / f"shard_{i:05d}.npz")
        ntok += int(rec["lengths"].sum())
        bar.set_postfix(kind=kind, tokens=ntok, tok_s=f"{ntok / (time.time() - t0):.0f}")
        bar.update(1)
    bar.close()
    return out


def tail_window(shard: dict, window: int) -> dict:
    """Each row's last `window` valid positions, left-aligned (rows of long prompts keep their
    response, which is what a drafter is run on, instead of the prompt's head)."""
    n, t = shard["tokens"].shape
    if t <= window:
        return shard
    lengths = shard["lengths"]
    start = np.maximum(lengths - window, 0)  # [N]
    cols = start[:, None] + np.arange(window)[None]  # [N, W]
    rows = np.arange(n)[:, None]
    return {
        "tokens": shard["tokens"][rows, cols],
        "lengths": np.minimum(lengths, window),
        "hidden": shard["hidden"][:, rows, cols],
        "topk_ids": shard["topk_ids"][rows, cols],
        "topk_probs": shard["topk_probs"][rows, cols],
    }


def _unique_rows(shard: dict, seen: set) -> dict:
    """`shard` without rows whose tokens are in `seen` (which it extends)."""
    keep = []
    for i, (row, n) in enumerate(zip(shard["tokens"], shard["lengths"])):
        key = row[:n].tobytes()
        if key not in seen:
            seen.add(key)
            keep.append(i)
    if len(keep) == len(shard["lengths"]):
        return shard
    return {k: np.take(v, keep, axis=1 if k == "hidden" else 0) for k, v in shard.items()}


def load_shards(data_dir: str | Path, window: int | None = None) -> dict[str, np.ndarray]:
    """All shards (of one dir, or of several given as "dir_a,dir_b") flattened to rows of one
    common width (right-padded), repeated rows dropped; with `window`, each row cut to its last
    `window` positions."""
    dirs = [Path(d.strip()) for d in str(data_dir).split(",") if d.strip()]
    files = sorted(f for d in dirs for f in d.glob("shard_[0-9]*[0-9].npz"))
    if not files:
        raise FileNotFoundError(f"no shards in {data_dir}: run python -m jaxspec.train --config configs/train/data.yaml")
    keys = ("tokens", "lengths", "hidden", "topk_ids", "topk_probs")
    shards = [{k: v for k, v in np.load(f).items() if k in keys} for f in files]
    seen: set[bytes] = set()  # greedy generation: the same prompt gives the same row
    shards = [_unique_rows(s, seen) for s in shards]
    if window:
        shards = [tail_window(s, window) for s in shards]
    t = max(s["tokens"].shape[1] for s in shards)

    def pad(x, axis):
        w = [(0, 0)] * x.ndim
        w[axis] = (0, t - x.shape[axis])
        return np.pad(x, w)

    return {
        "tokens": np.concatenate([pad(s["tokens"], 1) for s in shards]),
        "lengths": np.concatenate([s["lengths"] for s in shards]),
        "hidden": np.concatenate([pad(s["hidden"], 2) for s in shards], axis=1),
        "topk_ids": np.concatenate([pad(s["topk_ids"], 1) for s in shards]),
        "topk_probs": np.concatenate([pad(s["topk_probs"], 1) for s in shards]),
    }
