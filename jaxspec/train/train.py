"""Train a drafter on distillation records: optax AdamW (warm-up + cosine, clipping), a jitted
train step, orbax checkpoints every `save_every` steps with exact resume (params, optimizer state,
step; the data order is a pure function of (seed, step)), a progress bar with loss and top-1
agreement with the target, periodic evaluation with the real speculative decoder on held-out
GSM8K prompts (mean accepted length), and an exported drafter checkpoint at the end.

Same code on CPU and accelerators; with more than one device the batch is sharded over a 1-D
"data" mesh (params replicated), i.e. data parallel.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxspec.errors import JaxspecError, short
from jaxspec.options import coerce
from jaxspec.engine.runner import Engine
from jaxspec.loading import load_model
from jaxspec.models.llama import LlamaTarget
from jaxspec.output_dir import check_output_dir
from jaxspec.train import checkpoint as ckpt
from jaxspec.train import methods as methods_lib
from jaxspec.train import prompts as prompt_sets
from jaxspec.train.data import load_shards


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    method: str  # eagle | medusa | draft_model
    model: str = "smollm2-135m"
    data_dir: str = "out/distill/smollm2-135m"
    ckpt_dir: str = "out/train/run"  # orbax training state (resume)
    export_dir: str | None = None  # shipped drafter checkpoint
    gsm8k_path: str = "../shared/data/gsm8k_train.jsonl"  # held-out slice for evaluation
    steps: int = 100
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 1e-3
    warmup: int = 10
    end_lr_frac: float = 0.1
    weight_decay: float = 0.01
    clip: float = 1.0
    seed: int = 0
    save_every: int = 25
    eval_every: int = 0  # 0: only at the end
    eval_prompts: int = 4
    eval_max_new: int = 48
    gamma: int = 4
    draft_vocab: int = 8192
    init_from: str | None = None  # warm start: an exported drafter of the same method and arch
    export_dtype: str = "float32"  # shipped params (bfloat16 halves the size; loaded as float32)
    method_args: dict = dataclasses.field(default_factory=dict)
    force: bool = False  # replace export_dir when it already holds a jaxspec checkpoint

    def __post_init__(self):
        check_train_config(self)


EXPORT_DTYPES = ("float32", "bfloat16", "float16")


def check_train_config(tc: TrainConfig) -> None:
    """Types (an int is never a string or a bool), ranges and finite values of every field,
    as one-line JaxspecErrors naming the key: a NaN learning rate would train to loss=nan."""
    import math
    import typing


    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(tc):
        object.__setattr__(tc, f.name, coerce(f.name, getattr(tc, f.name), hints[f.name]))

    def fail(key, why):
        raise JaxspecError(f"{key}={short(getattr(tc, key))} is invalid: {why}")

    if tc.method not in methods_lib.METHODS:
        fail("method", f"use one of {', '.join(sorted(methods_lib.METHODS))}")
    for key, lo in (("steps", 1), ("batch_size", 1), ("seq_len", 2), ("warmup", 0),
                    ("save_every", 0), ("eval_every", 0), ("eval_prompts", 0),
                    ("eval_max_new", 1), ("draft_vocab", 1), ("seed", 0)):
        if getattr(tc, key) < lo:
            fail(key, f"use an integer >= {lo}")
    if tc.batch_size > 1 << 16 or tc.seq_len > 1 << 20:
        fail("batch_size" if tc.batch_size > 1 << 16 else "seq_len", "use a value a device can hold")
    if not 1 <= tc.gamma <= 16:
        fail("gamma", "use an integer in 1..16")
    for key, lo, hi in (("lr", 0.0, 10.0), ("end_lr_frac", 0.0, 1.0), ("weight_decay", 0.0, 10.0),
                        ("clip", 0.0, 1e6)):
        v = getattr(tc, key)
        if not (math.isfinite(v) and lo <= v <= hi) or (key == "clip" and v == 0.0):
            fail(key, f"use a finite number in {'(' if key == 'clip' else '['}{lo:g}, {hi:g}]")
    if tc.export_dtype not in EXPORT_DTYPES:
        fail("export_dtype", f"use one of {', '.join(EXPORT_DTYPES)}")
    for key in ("model", "data_dir", "ckpt_dir"):
        if not getattr(tc, key).strip():
            fail(key, "use a non-empty path")


def check_inputs(tc: TrainConfig, *, need_data: bool, need_prompts: bool) -> None:
    """What a run reads and writes, checked before the model loads: the data shards exist, the
    GSM8K file the evaluation reads exists, and export_dir may be written."""
    from pathlib import Path

    if need_data:
        dirs = [d.strip() for d in tc.data_dir.split(",") if d.strip()]
        for d in dirs:
            if not any(Path(d).glob("shard_[0-9]*[0-9].npz")):
                raise JaxspecError(
                    f"data_dir {d} holds no distillation shards: build them with python -m "
                    f"jaxspec.train --config configs/train/data.yaml (or set data_dir=...)"
                )
    if need_prompts and not Path(tc.gsm8k_path).is_file():
        raise JaxspecError(
            f"gsm8k_path {tc.gsm8k_path} does not exist (the held-out evaluation reads it): set "
            f"gsm8k_path=FILE.jsonl, or eval_prompts=0 to train without evaluation"
        )
    if tc.export_dir:
        check_output_dir(tc.export_dir, force=tc.force, what="export_dir")


def make_optimizer(tc: TrainConfig):
    sched = optax.warmup_cosine_decay_schedule(
        0.0, tc.lr, max(tc.warmup, 1), max(tc.steps, tc.warmup + 1), tc.lr * tc.end_lr_frac
    )
    decay_mask = lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)
    return optax.chain(
        optax.clip_by_global_norm(tc.clip),
        optax.adamw(sched, weight_decay=tc.weight_decay, mask=decay_mask),
    )


class Batches:
    """Deterministic batches: step -> rows of a seed-and-epoch permutation (exact resume)."""

    def __init__(self, data: dict, batch_size: int, seq_len: int, seed: int, slots: tuple):
        self.data, self.b, self.t, self.seed = data, batch_size, seq_len, seed
        self.slots = np.asarray(slots, np.int32)
        self.rows = data["tokens"].shape[0]
        if self.rows < batch_size:
            raise JaxspecError(
                f"the data holds {self.rows} rows, fewer than batch_size={batch_size}: lower "
                f"batch_size or build more data"
            )
        self.per_epoch = self.rows // batch_size

    def __call__(self, step: int) -> dict:
        epoch, i = divmod(step, self.per_epoch)
        perm = np.random.default_rng([self.seed, epoch]).permutation(self.rows)
        idx = np.sort(perm[i * self.b : (i + 1) * self.b])
        d, t = self.data, self.t

        def crop(x, rows_axis=0):  # rows `idx`, positions (the next axis) cut/padded to t
            x = np.take(x, idx, axis=rows_axis)
            axis = rows_axis + 1
            x = x[(slice(None),) * axis + (slice(0, t),)]
            pad = [(0, 0)] * x.ndim
            pad[axis] = (0, t - x.shape[axis])
            return np.pad(x, pad)

        hidden = np.take(d["hidden"], self.slots, axis=0) if len(self.slots) else d["hidden"][:0]
        return {
            "tokens": crop(d["tokens"]),
            "lengths": np.minimum(d["lengths"][idx], t),
            "hidden": crop(hidden, rows_axis=1) if len(self.slots) else np.zeros((0, self.b, t, 1), np.float16),
            "topk_ids": crop(d["topk_ids"]),
            "topk_probs": crop(d["topk_probs"]),
        }


def _shard_batch(batch):
    if jax.device_count() == 1:
        return jax.tree.map(jnp.asarray, batch)
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.asarray(jax.devices()), ("data",))
    axis = {"hidden": 1}
    return {
        k: jax.device_put(v, NamedSharding(mesh, P(*([None] * axis.get(k, 0)), "data")))
        for k, v in batch.items()
    }


def target_of(model):
    """What a method's init / loss / drafter take for the target: the Llama family's config (as
    before), any other family's Target (Qwen3.5's hybrid layers, Qwen3-MoE, Gemma 4)."""
    target = model.target
    return target.cfg if type(target) is LlamaTarget else target


def make_method(tc: TrainConfig):
    return methods_lib.METHODS[tc.method](**tc.method_args)


def evaluate(target, drafter, dparams, prompts, gamma, max_new) -> dict:
    """Run the real speculative decoder (greedy, batch 1) on held-out prompts."""
    engine = Engine(target, drafter, dparams, num_speculative_tokens=gamma)
    res = engine.generate(prompts, max_new_tokens=max_new, batch_size=1)
    steps = sum(r.metrics["num_steps"] for r in res)
    per_pos = np.sum([np.asarray(r.metrics["accepted_per_position"]) * r.metrics["num_steps"] for r in res], 0)
    return {
        "mean_accepted_length": float(np.mean([r.metrics["mean_accepted_length"] for r in res])),
        "acceptance_rate": float(np.mean([r.metrics["acceptance_rate"] for r in res])),
        "accepted_per_position": [round(float(x), 3) for x in per_pos / max(steps, 1)],
    }


def held_out_prompts(tc: TrainConfig) -> list:
    if tc.eval_prompts == 0:
        return []

    _, held = prompt_sets.split_gsm8k(prompt_sets.read_gsm8k(tc.gsm8k_path))
    return [r["question"] for r in held[: tc.eval_prompts]]


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """What `train` returns, stopped early or not (one shape either way)."""
    params: Any  # the drafter's trained params
    state: dict  # {"params", "opt_state", "step"}: what a checkpoint holds
    history: list[dict]  # per-step metrics of this run
    frozen: Any  # the target's pieces the drafter reads (embedding, head rows)
    method: Any  # the methods.* object (init / loss / runtime / drafter)
    drafter: Any  # the runtime drafter for engine use
    eval: dict | None = None  # final held-out evaluation (None: stopped early or no prompts)
    stopped: bool = False  # left at `stop_at`, before the final save/eval/export


class _Setup(NamedTuple):
    target: Any
    data: dict
    method: Any
    d2t: np.ndarray
    frozen: Any
    state: dict
    start: int  # first step to run (> 0 when resumed)
    mngr: Any


def _prepare(tc: TrainConfig, target, data, log) -> _Setup:
    """Target, data, draft vocabulary, initial (or warm-started, or resumed) state."""
    if target is None:
        target = load_model(tc.model, layout="unrolled")  # gradients flow through its LM head
    if data is None:
        data = load_shards(tc.data_dir, window=tc.seq_len)
    method = make_method(tc)
    d2t = methods_lib.build_vocab(
        data["tokens"], data["lengths"], data["topk_ids"], tc.draft_vocab, target.target.vocab_size
    )
    params, frozen = method.init(target, d2t, jax.random.key(tc.seed))
    if tc.init_from:
        params = warm_start(params, tc, target)
    opt = make_optimizer(tc)
    state = {"params": params, "opt_state": opt.init(params), "step": jnp.zeros((), jnp.int32)}
    mngr = ckpt.manager(tc.ckpt_dir)
    start, restored = ckpt.restore_state(mngr, jax.tree.map(ocp_abstract, state))
    if restored is not None:
        state = restored
        log(f"resumed from {tc.ckpt_dir} at step {start}")
    return _Setup(target, data, method, d2t, frozen, state, start, mngr)


def _make_step(tc: TrainConfig, setup: _Setup):
    """The jitted optimiser step: (state, batch) -> (state, metrics)."""
    opt = make_optimizer(tc)
    method, frozen, tcfg = setup.method, setup.frozen, target_of(setup.target)

    def loss_fn(p, batch):
        return method.loss(p, frozen, batch, tcfg)

    @jax.jit
    def train_step(state, batch):
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"], batch)
        updates, opt_state = opt.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = metrics | {"loss": loss, "grad_norm": optax.tree.norm(grads)}
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

    return train_step


def train(
    tc: TrainConfig, target=None, data=None, eval_prompts=None, log=print, progress=True,
    stop_at: int | None = None,
) -> TrainResult:
    """Train (resuming from `ckpt_dir` if it holds a checkpoint), evaluate, export.
    `stop_at`: leave after that step without the final save/eval/export (simulates a kill)."""
    from tqdm import tqdm

    t_start = time.time()
    check_inputs(tc, need_data=data is None, need_prompts=eval_prompts is None and tc.eval_prompts > 0)
    setup = _prepare(tc, target, data, log)
    target, method, frozen, state = setup.target, setup.method, setup.frozen, setup.state
    train_step = _make_step(tc, setup)
    batches = Batches(setup.data, tc.batch_size, tc.seq_len, tc.seed, method.feature_slots)
    drafter = method.drafter(target_of(target))
    prompts = eval_prompts if eval_prompts is not None else held_out_prompts(tc)

    def evaluate_now(state):
        runtime = method.runtime(state["params"], frozen)
        return evaluate(target, drafter, runtime, prompts, tc.gamma, tc.eval_max_new)

    history, evals = [], []
    result = lambda state, **kw: TrainResult(  # noqa: E731
        params=state["params"], state=state, history=history, frozen=frozen, method=method,
        drafter=drafter, **kw)
    bar = tqdm(total=tc.steps, initial=setup.start, desc=f"train {tc.method}", disable=not progress)
    tokens_seen, t_loop = 0, time.perf_counter()
    for step in range(setup.start, tc.steps):
        if stop_at is not None and step >= stop_at:
            bar.close()
            return result(state, stopped=True)
        batch = batches(step)
        state, metrics = train_step(state, _shard_batch(batch))
        metrics = {k: float(v) for k, v in metrics.items()}
        if not np.isfinite(metrics["loss"]):
            bar.close()
            raise JaxspecError(
                f"step {step + 1}: the loss is {metrics['loss']} (non-finite): training stopped "
                f"and nothing was exported; lower lr (now {tc.lr:g}) or check the data in "
                f"{tc.data_dir}"
            )
        history.append({"step": step + 1, **metrics})
        tokens_seen += int(np.sum(batch["lengths"]))
        rate = tokens_seen / max(time.perf_counter() - t_loop, 1e-9)
        bar.set_postfix(
            loss=f"{metrics['loss']:.3f}", top1=f"{metrics['top1']:.3f}", tok_s=f"{rate:.0f}"
        )
        bar.update(1)
        if tc.save_every and (step + 1) % tc.save_every == 0 and step + 1 < tc.steps:
            ckpt.save_state(setup.mngr, step + 1, state)
        if tc.eval_every and (step + 1) % tc.eval_every == 0 and step + 1 < tc.steps and prompts:
            ev = evaluate_now(state)
            evals.append({"step": step + 1, **ev})
            log(f"step {step + 1}: eval {json.dumps(ev)}")
    bar.close()
    if setup.start < tc.steps:
        ckpt.save_state(setup.mngr, tc.steps, state)
    train_s = time.time() - t_start
    final = None
    if prompts:
        final = evaluate_now(state)
        evals.append({"step": tc.steps, **final})
        log(f"final eval (held-out GSM8K, gamma={tc.gamma}): {json.dumps(final)}")
    if tc.export_dir:
        _export(tc, setup, state, history, evals, train_s)
        log(f"exported {tc.export_dir}")
    return result(state, eval=final)


def _export(tc: TrainConfig, setup: _Setup, state, history, evals, train_s: float) -> None:
    """The trained params + draft vocabulary + training record, as a shippable checkpoint."""
    training = {
        "command": " ".join(["python -m jaxspec.train", *sys.argv[1:]]),  # no machine path
        "steps": tc.steps,
        "wall_s_this_run": round(train_s, 1),
        "rows": int(setup.data["tokens"].shape[0]),
        "tokens": int(setup.data["lengths"].sum()),
        "config": dataclasses.asdict(tc),
        "eval": evals,
        "last_metrics": history[-1] if history else None,
    }
    arch = setup.method.arch(target_of(setup.target)) | {"draft_vocab": int(len(setup.d2t))}
    cast = lambda x: x.astype(tc.export_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x  # noqa: E731
    learned = exported_params(setup.method, state["params"], setup.frozen)
    export = {**jax.tree.map(cast, learned), "d2t": jnp.asarray(setup.d2t)}
    target = setup.target
    ckpt.save_drafter(
        tc.export_dir, tc.method, export, arch, ckpt.fingerprint(target.cfg, target.params),
        training, force=tc.force,
    )


def exported_params(method, params, frozen):
    """The params an export holds: the trained ones, plus what a head kept frozen but ships with
    it (a DSpark head's frozen backbone: its `exported`)."""
    export = getattr(method, "exported", None)
    return params if export is None else export(params, frozen)


def warm_start(params, tc: TrainConfig, target):
    """`params` replaced by an exported drafter's (its draft vocabulary may differ: the head is
    the target's frozen rows, so only the learned leaves carry over)."""
    _, stored = ckpt.load_drafter(tc.init_from, tc.method, target.cfg, target.params)
    stored.pop("d2t")
    if isinstance(stored.get("layers"), list):
        stored["layers"] = tuple(stored["layers"])
    got, want = jax.tree.structure(stored), jax.tree.structure(params)
    shapes_differ = got != want or any(
        a.shape != b.shape for a, b in zip(jax.tree.leaves(stored), jax.tree.leaves(params))
    )
    if shapes_differ:
        raise JaxspecError(
            f"init_from {tc.init_from} does not match this drafter's architecture "
            f"(method_args differ); train from scratch or point init_from to a matching export"
        )
    return jax.tree.map(lambda x, p: jnp.asarray(x, p.dtype), stored, params)


def ocp_abstract(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)
