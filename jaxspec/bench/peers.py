"""Peers for `jaxspec.bench`: Hugging Face transformers (PyTorch, CPU) on the same weights/prompts.

    peers = HFPeers(target, configs, threads=2)        # loads the GGUF with transformers
    rows = peers.run(prompt_ids, max_new_tokens=128)    # {"hf_plain": {...}, "hf_prompt_lookup": ...}

Methods: plain greedy `generate`; prompt lookup (`prompt_lookup_num_tokens=γ`); for a layer_skip
config, transformers' own self-speculation with the same draft (`assistant_early_exit=N`: the first N
layers + final norm + LM head, γ constant); assisted generation (`assistant_model=`) when a config's
drafter is a separate HF-loadable model (`draft_model` with `speculative.draft_model.model` set and no
trained checkpoint). ngram (its peer is prompt lookup), eagle, medusa and trained draft checkpoints
have no transformers equivalent on the same weights: listed as not applicable.

HF tokens/s = new tokens / `generate` wall time, so it includes prefill: compare it with our
end-to-end tokens/s, not our decode-only figure.
"""

from __future__ import annotations

# Imported inside functions: jax, transformers and torch (and the jaxspec modules that load
# them) load only when a command runs, so its --help answers in a second (tests/test_help.py).

import os
import time
from pathlib import Path
from typing import Any


def load_hf(source_path: str, torch):
    """transformers' own float32 load of a GGUF file or HF safetensors dir, eval mode."""
    from transformers import AutoModelForCausalLM

    from jaxspec.loading.tokenizer import quiet

    path = Path(source_path)
    with quiet():
        if path.is_file():
            model = AutoModelForCausalLM.from_pretrained(
                path.parent, gguf_file=path.name, dtype=torch.float32
            )
        else:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


def assisted_source(spec) -> tuple[str | None, str]:
    """(HF-loadable path of the drafter, why not) for a SpeculativeConfig."""
    if spec.method != "draft_model":
        return None, f"{spec.method}: no separate HF-loadable draft model (not applicable)"
    opts = spec.options  # DraftModelOptions
    if opts.checkpoint or not opts.model:
        return (
            None,
            "draft_model with a jaxspec-trained checkpoint: not HF-loadable (not applicable)",
        )
    from jaxspec.loading import resolve

    try:
        return str(resolve(opts.model).path), ""
    except Exception as e:  # noqa: BLE001 - any failure just means "no assisted peer"
        return None, f"draft model {opts.model!r} not resolvable: {e}"


class HFPeers:
    def __init__(
        self,
        target,  # jaxspec.loading.LoadedModel
        configs: dict[str, Any],  # label -> jaxspec.config.Config
        *,
        threads: int | str,  # "auto": the faster of 1 thread and all cores (see pick_threads)
        prompt_lookup_tokens: int,
        model=None,  # an already loaded transformers twin of `target`
    ):
        import torch
        import transformers

        self.torch = torch
        self.model = model if model is not None else load_hf(target.source_path, torch)
        self.thread_timings: dict[int, float] = {}
        torch.set_num_threads(1 if threads == "auto" else threads)
        self.threads = threads
        self.eos = list(target.eos_token_ids)
        pad = getattr(target.tokenizer, "pad_token_id", None)
        self.pad = pad if pad is not None else self.eos[0]
        self.prompt_lookup_tokens = prompt_lookup_tokens
        self.methods: dict[str, dict[str, Any]] = {
            "hf_plain": {"kwargs": {}},
            "hf_prompt_lookup": {"kwargs": {"prompt_lookup_num_tokens": prompt_lookup_tokens}},
        }
        self.not_applicable: dict[str, str] = {}
        for label, cfg in configs.items():
            spec = cfg.speculative
            if spec.method == "none":
                continue
            if spec.method == "layer_skip":  # the same self-draft: first N layers + norm + head
                self.methods[f"hf_early_exit[{label}]"] = {
                    "kwargs": {
                        "assistant_early_exit": spec.options.layers,
                        "num_assistant_tokens": spec.num_speculative_tokens,
                        "num_assistant_tokens_schedule": "constant",
                    },
                }
                continue
            src, why = assisted_source(cfg.speculative)
            if src is None:
                self.not_applicable[label] = why
                continue
            assistant = load_hf(src, torch)
            self.methods[f"hf_assisted[{label}]"] = {
                "kwargs": {
                    "assistant_model": assistant,
                    "num_assistant_tokens": cfg.speculative.num_speculative_tokens,
                    "num_assistant_tokens_schedule": "constant",
                },
            }
        self.info = {
            "torch_version": torch.__version__,
            "transformers_version": transformers.__version__,
            "torch_threads": threads,
            "thread_timings_s": self.thread_timings,
            "prompt_lookup_num_tokens": prompt_lookup_tokens,
            "methods": list(self.methods),
            "not_applicable": self.not_applicable,
            "timing": "new tokens / generate() wall time: includes prefill",
        }

    def generate(self, name: str, prompt_ids: list[int], max_new_tokens: int) -> dict[str, Any]:
        torch = self.torch
        x = torch.tensor([prompt_ids], dtype=torch.long)
        kwargs = {
            "max_new_tokens": max_new_tokens,
            "do_sample": False,
            "temperature": None,
            "top_p": None,
            "top_k": None,
            "eos_token_id": self.eos,
            "pad_token_id": self.pad,
            "attention_mask": torch.ones_like(x),
        }
        kwargs.update(self.methods[name]["kwargs"])
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = self.model.generate(x, **kwargs)
            wall = time.perf_counter() - t0
        gen = out[0, x.shape[1] :].tolist()
        return {
            "token_ids": gen,
            "num_generated_tokens": len(gen),
            "wall_s": wall,
            "tokens_per_s": len(gen) / wall if wall > 0 else 0.0,
        }

    def warm_up(self, prompt_ids: list[int]) -> None:
        for name in list(self.methods):
            try:
                self.generate(name, prompt_ids, 4)
            except Exception as e:
                if name == "hf_plain":
                    raise
                del self.methods[name]
                self.not_applicable[name] = f"failed in transformers: {' '.join(str(e).split())}"
        self.info["methods"] = list(self.methods)
        if self.threads == "auto":
            self.pick_threads(prompt_ids)

    def pick_threads(self, prompt_ids: list[int], tokens: int = 8) -> int:
        """Time plain generate with 1 thread and with every core; keep the faster. On a shared
        2-core machine two spin-waiting OpenMP threads have run 7-20x slower than one."""
        torch = self.torch
        for n in sorted({1, os.cpu_count() or 1}):
            torch.set_num_threads(n)
            self.thread_timings[n] = self.generate("hf_plain", prompt_ids, tokens)["wall_s"]
        best = min(self.thread_timings, key=self.thread_timings.get)
        torch.set_num_threads(best)
        self.threads = best
        self.info["torch_threads"] = best
        return best
