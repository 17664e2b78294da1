"""Results and metrics of a finished batch, host side: the decode state's fields fetched to numpy
(gathered from every process when sharded), each row's generated ids, text and metrics.

    fetched = fetch(state, mesh_plan)
    report = Report(model, spec, method, adaptive=True)
    results = report.results(prompts, batch_ids, fetched, ttft, decode_s, attention)
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import jax

from jaxspec.decode import adaptive, logprob_record
from jaxspec import sharding
from jaxspec.models import base
from jaxspec.decode.sampling import check_tokens


@dataclasses.dataclass
class GenerationResult:
    prompt: str
    text: str
    token_ids: list[int]  # generated tokens only
    num_prompt_tokens: int
    num_generated_tokens: int
    time_to_first_token_s: float
    decode_tokens_per_s: float
    metrics: dict[str, Any]
    # per generated token {"logprob", "top": [(id, logprob), ...]} (the engine's `logprobs` set)
    logprobs: list[dict] | None = None

    def to_json(self) -> dict[str, Any]:
        """The result as JSON; `logprobs` only where the engine records them
        (generation.logprobs)."""
        out = dataclasses.asdict(self)
        if self.logprobs is None:
            del out["logprobs"]
        return out


def fetch(state, plan=None) -> types.SimpleNamespace:
    """The fields results read, as numpy (`plan`: a sharding.MeshPlan, gathered from every
    process). `adaptive` is None when the batch ran without a controller."""
    names = ("tokens", "lengths", "row_steps", "num_draft", "num_accepted", "accepted_per_position")
    fields = {n: getattr(state, n) for n in names}
    if getattr(state, "adaptive", None) is not None:  # the adaptive controller's statistics
        fields["adaptive"] = state.adaptive
    if getattr(state, "logprobs", None) is not None:  # logprob_record.Record
        fields["logprobs"] = state.logprobs
    g = getattr(state, "grammar", None)
    if g is not None:  # constrained rows: where each ended, the drafts the mask removed
        fields["grammar"] = {"state": g.state, "accepting": g.accepting, "num_masked": g.num_masked,
                              "num_proposed": g.num_proposed}
    calib = getattr(getattr(state, "drafter_state", None), "calibration", None)
    if calib is not None:  # a DSpark chain's confidence head against verification
        fields["drafter_calibration"] = calib
    fetched = jax.device_get(fields) if plan is None else sharding.fetch(fields)
    return types.SimpleNamespace(**({"adaptive": None, "logprobs": None, "grammar": None,
                                     "drafter_calibration": None}
                                    | fetched))


@dataclasses.dataclass(frozen=True)
class Report:
    model: Any  # LoadedModel (tokenizer, eos ids, layout note) or models.base.Model
    spec: Any  # the engine's speculate.LoopSpec
    method: str  # "plain" or the drafter's name
    adaptive: bool = False  # adaptive metrics in every row's metrics

    def decode_text(self, token_ids: list[int]) -> str:
        """Generated ids -> text (EOS dropped, special tokens skipped; "" without a tokenizer)."""
        if self.model.tokenizer is None:  # raw token-id use (tests, research code)
            return ""
        kept = [t for t in token_ids if t not in self.model.eos_token_ids]
        return self.model.tokenizer.decode(kept, skip_special_tokens=True)

    def results(self, prompts, batch_ids, state, ttft, decode_s, attention) -> list[GenerationResult]:
        """One GenerationResult per real row of a fetched state."""
        out = []
        for i, (prompt, ids) in enumerate(zip(prompts, batch_ids)):
            gen = state.tokens[i, len(ids) : state.lengths[i]].tolist()
            check_tokens(gen)
            n = len(gen)
            out.append(
                GenerationResult(
                    prompt=prompt if isinstance(prompt, str) else "",
                    text=self.decode_text(gen),
                    token_ids=gen,
                    num_prompt_tokens=len(ids),
                    num_generated_tokens=n,
                    time_to_first_token_s=ttft,
                    decode_tokens_per_s=(n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0,
                    metrics=self.row_metrics(state, i, n, attention),
                    logprobs=None if getattr(state, "logprobs", None) is None
                    else logprob_record.row_entries(state.logprobs, i, len(ids),
                                                    int(state.lengths[i])),
                )
            )
        return out

    def row_metrics(self, state, row: int, num_generated: int, attention=None) -> dict[str, Any]:
        """One row's metrics from a fetched state; `attention`: the compiled programs' kernels."""
        attention = attention or {}
        g, depth = self.spec.num_speculative_tokens, self.spec.depth
        steps = int(state.row_steps[row]) - 1  # decode forwards (prefill excluded)
        drafted = int(state.num_draft[row])
        accepted = int(state.num_accepted[row])
        per_pos = state.accepted_per_position[row, :depth].tolist() if depth else []
        per_pos += [0] * (depth - len(per_pos))  # a switched-off batch ran the plain program
        out = self.adaptive_metrics(state, row, steps) if self.adaptive else {}
        out |= self.constraint_metrics(state, row, drafted, num_generated)
        calib = getattr(state, "drafter_calibration", None)
        if calib is not None:  # predicted vs observed acceptance per position, lengths chosen
            out |= calib.row_metrics(row)
        return out | {
            "method": self.method,
            # the Hub commit the target was downloaded at ("" for local files)
            "model_revision": getattr(self.model, "revision", ""),
            "layout": base.layout(self.model.target, self.model.params),
            "layout_note": getattr(self.model, "layout_note", ""),
            # read from the compiled programs (jaxspec.hlo.compiled_attention): xla / pallas_tpu /
            # pallas_gpu / cpu kernels; decode (and verify) and prefill
            "attention": attention.get("decode", ""),
            "attention_prefill": attention.get("prefill", ""),
            "num_speculative_tokens": g,
            "tree_nodes": self.spec.num_nodes,  # window entries verified after the root
            "nodes_per_step": drafted / steps if steps else 0.0,
            "num_steps": steps,
            "num_draft_tokens": drafted,
            "num_accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_accepted_length": (num_generated - 1) / steps if steps else 1.0,
            "accepted_per_position": [c / steps if steps else 0.0 for c in per_pos],
        }

    def constraint_metrics(self, state, row: int, drafted: int, num_generated: int) -> dict[str, Any]:
        """A constrained row: whether its structure is complete (the automaton accepts), its
        finish reason ("length" when max_new_tokens cut an unfinished structure), and the
        drafted tokens the constraint disallowed (constrain/draft.py: redrawn from the masked q,
        or dropped) out of the nodes proposed. {} for a free row."""
        g = getattr(state, "grammar", None)
        if g is None or int(g["state"][row]) == -1:
            return {}
        s = int(g["state"][row])
        complete = bool(s >= 0 and g["accepting"][s])
        last = int(state.tokens[row, state.lengths[row] - 1]) if num_generated else -1
        masked, proposed = int(g["num_masked"][row]), int(g["num_proposed"][row])
        return {
            "constraint_complete": complete,
            "finish_reason": "stop" if complete and last in self.model.eos_token_ids else "length",
            "num_masked_draft_tokens": masked,
            "num_proposed_draft_tokens": proposed,  # before the mask (num_draft_tokens: after)
            "masked_draft_fraction": masked / proposed if proposed else 0.0,
        }

    def adaptive_metrics(self, state, row: int, steps: int) -> dict[str, Any]:
        g = self.spec.adaptive.gamma  # a chain's length, a tree's depth
        if state.adaptive is None:  # switched off: every step plain
            hist, plain, why = [steps] + [0] * g, steps, None
        else:
            hist, plain = state.adaptive.length_hist[row], state.adaptive.plain_steps[row]
            why = state.adaptive.reason_hist[row]
        handoff = -1 if state.adaptive is None else int(state.adaptive.handoff_at)
        return {"adaptive_switched_off": state.adaptive is None,
                "adaptive_handoff_step": handoff} | adaptive.summarize(hist, plain, steps, why)
