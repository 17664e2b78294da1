"""vLLM as a peer of `python -m jaxspec.bench --peers vllm` (issue 45): the same token ids (our
chat template applied once, here), greedy, the same max_new_tokens and stop ids, one vLLM engine
per method, each in its own process in the vLLM venv (scripts/setup_vllm_peer.sh), driven prompt
by prompt between jaxspec's own methods so that machine load falls on both.

    peers = VLLMPeers(configs, eos_token_ids=[2], eagle3_dir=None)
    peers.start("vllm_plain", warmup_ids)    # start-up + warm-up, timed apart from the rows
    row = peers.generate("vllm_plain", ids, 64)
    peers.stop("vllm_plain")                 # one engine at a time (memory)

Phases (jaxspec.bench.spec_bench): vllm_plain runs inside the main loop, interleaved with all of
our methods prompt by prompt; each further vLLM method then gets its own phase, its engine alone,
interleaved prompt by prompt with a fresh run of our plain decoding ("baseline (paired with
NAME)"), so its figures can be read against ours under the same machine load.

Methods: vllm_plain; per jaxspec config, its vLLM twin with the same γ: ngram (prompt_lookup_min/
max = min_ngram/max_ngram), suffix (arctic-inference's suffix tree; max_spec_factor and
min_token_prob as ours), eagle3 (the config's head exported by `python -m jaxspec.export --format
eagle3`, passed as --vllm-eagle3 DIR). Everything else is listed as not applicable, with the
reason (jaxspec's own `eagle` head among them: it has no EAGLE-3 form).

The parsing (`parse_event`), the per-prompt rows (`result_row`) and the token comparison
(`compare_tokens`) are pure functions: tests run them on a recorded transcript
(tests/data/vllm_peer_transcript.jsonl), without vLLM.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from jaxspec.errors import JaxspecError

REPO_ROOT = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).with_name("vllm_runner.py")
SETUP_HINT = "run scripts/setup_vllm_peer.sh"


def venv_dir() -> Path:
    """The vLLM venv: $JAXSPEC_VLLM_VENV (as scripts/setup_vllm_peer.sh takes it), else .venv-vllm."""
    return Path(os.environ.get("JAXSPEC_VLLM_VENV") or REPO_ROOT / ".venv-vllm")


def venv_python() -> Path:
    return Path(os.environ.get("JAXSPEC_VLLM_PYTHON") or venv_dir() / "bin/python")


def model_dir() -> Path:
    default = venv_dir() / "models/smollm2-135m-instruct"
    return Path(os.environ.get("JAXSPEC_VLLM_MODEL_DIR") or default)


# ---- methods ------------------------------------------------------------------------------------
def speculative_configs(
    configs: dict[str, Any], eagle3_dir: str | None = None
) -> tuple[dict[str, dict | None], dict[str, str]]:
    """jaxspec configs (label -> Config) -> ({vLLM method name: speculative_config or None},
    {label: why there is no vLLM twin})."""
    methods: dict[str, dict | None] = {"vllm_plain": None}
    skipped: dict[str, str] = {}
    for label, cfg in configs.items():
        spec = cfg.speculative
        gamma = spec.num_speculative_tokens
        if spec.method == "none":
            continue
        if spec.method == "ngram" and not _tree(spec):
            o = spec.options
            methods[f"vllm_ngram[{label}]"] = {
                "method": "ngram",
                "num_speculative_tokens": gamma,
                "prompt_lookup_min": o.min_ngram,
                "prompt_lookup_max": o.max_ngram,
            }
        elif spec.method == "suffix" and not _tree(spec):
            o = spec.options
            methods[f"vllm_suffix[{label}]"] = {
                "method": "suffix",
                "num_speculative_tokens": gamma,
                "suffix_decoding_max_spec_factor": o.max_spec_factor,
                "suffix_decoding_min_token_prob": o.min_token_prob,
            }
        elif spec.method == "eagle3" and eagle3_dir:
            methods[f"vllm_eagle3[{label}]"] = {
                "method": "eagle3",
                "model": str(eagle3_dir),
                "num_speculative_tokens": gamma,
            }
        elif spec.method == "eagle3":
            skipped[label] = (
                "EAGLE-3 in vLLM needs the head in its layout: pass --vllm-eagle3 DIR written by "
                "python -m jaxspec.export --format eagle3"
            )
        elif spec.method == "eagle":
            skipped[label] = (
                "jaxspec's own EAGLE head (per-feature RMS fuse, in_proj residual) has no exact "
                "EAGLE-3 form, so vLLM cannot run it (export refuses it; train method eagle3)"
            )
        else:
            skipped[label] = (
                f"{spec.method}{' (tree or adaptive)' if _tree(spec) else ''}: no vLLM twin"
            )
    return methods, skipped


def _tree(spec) -> bool:
    """Trees and adaptive draft lengths are jaxspec's own: vLLM drafts one chain of γ."""
    return spec.tree.kind != "chain" or spec.adaptive.enabled


# ---- the protocol (pure) ------------------------------------------------------------------------
def parse_event(line: str, where: str = "vLLM runner") -> dict[str, Any]:
    """One protocol line -> its dict, checked; an error event or a malformed line raises one
    JaxspecError line naming the runner."""
    try:
        ev = json.loads(line)
    except ValueError:
        raise JaxspecError(f"{where} wrote a non-JSON line: {line.strip()[:120]!r}") from None
    if not isinstance(ev, dict) or ev.get("event") not in ("ready", "result", "error"):
        raise JaxspecError(f"{where} wrote an unknown event: {line.strip()[:120]!r}")
    if ev["event"] == "error":
        raise JaxspecError(f"{where} failed: {ev.get('error')} ({SETUP_HINT} --check)")
    if ev["event"] == "result":
        ids = ev.get("token_ids")
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise JaxspecError(f"{where}: result {ev.get('id')!r} has no token_ids list")
        for key in ("ttft_s", "decode_s", "wall_s", "num_steps"):
            if not isinstance(ev.get(key), (int, float)) or ev[key] < 0:
                raise JaxspecError(f"{where}: result {ev.get('id')!r} has no valid {key}")
    return ev


def result_row(ev: dict[str, Any]) -> dict[str, Any]:
    """A result event -> the per-prompt row (the figures of jaxspec.bench.rows.record):
    tokens_per_s is decode only (tokens after the first / decode time), e2e_tokens_per_s counts
    prefill, mean_accepted_length = tokens after the first / target forwards after prefill."""
    n = len(ev["token_ids"])
    decode_s, steps = ev["decode_s"], ev["num_steps"]
    total = ev["ttft_s"] + decode_s
    return {
        "token_ids": list(ev["token_ids"]),
        "num_generated_tokens": n,
        "ttft_s": ev["ttft_s"],
        "decode_s": decode_s,
        "wall_s": ev["wall_s"],
        "num_steps": steps,
        "tokens_per_s": (n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0,
        "e2e_tokens_per_s": n / total if total > 0 else 0.0,
        "mean_accepted_length": (n - 1) / steps if steps else 1.0,
    }


def compare_tokens(peer: list[dict], ours: list[dict]) -> dict[str, Any]:
    """Token-for-token comparison with our greedy rows of the same prompts: every mismatch is
    listed (question, first differing position, both tokens there, both lengths)."""
    mismatches = []
    for p, o in zip(peer, ours):
        a, b = o["token_ids"], p["token_ids"]
        if a == b:
            continue
        i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        mismatches.append(
            {
                "question_id": o.get("question_id"),
                "first_difference_at": i,
                "ours": a[i] if i < len(a) else None,
                "vllm": b[i] if i < len(b) else None,
                "our_length": len(a),
                "vllm_length": len(b),
            }
        )
    n = min(len(peer), len(ours))
    return {
        "num_compared": n,
        "identical": n - len(mismatches),
        "match_rate": (n - len(mismatches)) / n if n else None,
        "mismatches": mismatches,
    }


def paired_label(name: str) -> str:
    """The rows of our plain decoding run in vLLM method `name`'s phase."""
    return f"baseline (paired with {name})"


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else 0.0


def summarise_vllm(
    rows: dict[str, list[dict]], peer_names: list[str], summary: dict[str, Any]
) -> dict[str, Any]:
    """Per vLLM method: decode and end-to-end tokens/s, TTFT, mean accepted length, the token
    comparison with our baseline; and the side-by-side ratios (ours over vLLM's) the issue asks:
    our plain vs vLLM plain, our best method vs vLLM's best."""
    base = rows["baseline"]
    methods = {}
    for name in peer_names:
        peer = rows.get(name, [])
        paired = rows.get(paired_label(name)) or base[: len(peer)]
        steps = sum(r["num_steps"] for r in peer)
        emitted = sum(max(r["num_generated_tokens"] - 1, 0) for r in peer)
        tps = _mean(r["tokens_per_s"] for r in peer)
        ours = _mean(r["tokens_per_s"] for r in paired)
        methods[name] = {
            "num_prompts": len(peer),
            "tokens_per_s": tps,
            "e2e_tokens_per_s": _mean(r["e2e_tokens_per_s"] for r in peer),
            "ttft_s": _mean(r["ttft_s"] for r in peer),
            "mean_accepted_length": emitted / steps if steps else 1.0,
            "vs_our_baseline": compare_tokens(peer, base),
            # our plain decoding in the same phase (same machine load), prompt by prompt
            "our_plain_tokens_per_s_same_phase": ours,
            "our_plain_over_this_same_phase": ours / tps if ours and tps else None,
        }
    out: dict[str, Any] = {"methods": methods}
    if not methods.get("vllm_plain", {}).get("num_prompts"):
        return out
    spec = [m for m in methods if m != "vllm_plain" and methods[m]["num_prompts"]]
    best = max(spec, key=lambda m: methods[m]["tokens_per_s"], default="vllm_plain")
    ours_plain = _mean(r["tokens_per_s"] for r in base)
    ours_plain_e2e = _mean(r["e2e_tokens_per_s"] for r in base)
    ours_best = summary.get("overall", {})

    def ratio(a, b):
        return a / b if a and b else None

    vp, vb = methods["vllm_plain"], methods[best]
    out["targets"] = {
        "vllm_best_speculative": best,
        "our_best": ours_best.get("config"),
        "our_plain_decode_over_vllm_plain": ratio(ours_plain, vp["tokens_per_s"]),
        "our_plain_e2e_over_vllm_plain": ratio(ours_plain_e2e, vp["e2e_tokens_per_s"]),
        "our_best_decode_over_vllm_best": ratio(ours_best.get("tokens_per_s"), vb["tokens_per_s"]),
        "our_best_e2e_over_vllm_best": ratio(
            ours_best.get("e2e_tokens_per_s"), vb["e2e_tokens_per_s"]
        ),
        "our_plain_ttft_s": _mean(r["ttft_s"] for r in base),
        "vllm_plain_ttft_s": vp["ttft_s"],
    }
    return out


# ---- the processes ------------------------------------------------------------------------------
class Runner:
    """One vLLM engine process (jaxspec/bench/vllm_runner.py in the vLLM venv)."""

    def __init__(
        self, name: str, spec: dict[str, Any], log_path: Path | None, transcript=None
    ):
        py = venv_python()
        if not py.is_file():
            raise JaxspecError(f"no vLLM venv at {py.parent.parent}: {SETUP_HINT}")
        self.name = name
        self.transcript = transcript  # a text file: every protocol line, with the method name
        self.log = open(log_path, "a") if log_path else subprocess.DEVNULL  # noqa: SIM115
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)  # the vLLM venv must not see jaxspec's packages
        self.proc = subprocess.Popen(
            [str(py), str(RUNNER), json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
            start_new_session=True,  # its engine processes share this group: close() ends them
        )

    def read(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            raise JaxspecError(
                f"vLLM runner {self.name} exited ({code}) without a reply: see its log "
                f"({SETUP_HINT} --check)"
            )
        if self.transcript is not None:
            self.transcript.write(json.dumps({"method": self.name, "line": line.rstrip("\n")}))
            self.transcript.write("\n")
            self.transcript.flush()
        return parse_event(line, f"vLLM runner {self.name}")

    def request(self, obj: dict[str, Any]) -> dict[str, Any]:
        if self.transcript is not None:
            self.transcript.write(json.dumps({"method": self.name, "request": obj}) + "\n")
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        """EOF ends the runner; vLLM's engine processes are in its session: whatever is left
        of that group after a minute is killed (by its group id, the runner's pid)."""
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # engine core / worker left behind
        except (ProcessLookupError, PermissionError):
            pass
        if self.log is not subprocess.DEVNULL:
            self.log.close()


class VLLMPeers:
    def __init__(
        self,
        configs: dict[str, Any],
        *,
        eos_token_ids: list[int],
        eagle3_dir: str | None = None,
        model: str | None = None,
        log_dir: Path | None = None,
        enforce_eager: bool = False,
    ):
        self.model = str(model or model_dir())
        if not (Path(self.model) / "config.json").is_file():
            raise JaxspecError(f"no vLLM model dir at {self.model}: {SETUP_HINT}")
        self.specs, self.not_applicable = speculative_configs(configs, eagle3_dir)
        self.methods = list(self.specs)
        self.eos = list(eos_token_ids)
        self.log_dir = log_dir
        if log_dir:
            log_dir.mkdir(parents=True, exist_ok=True)
        self.enforce_eager = enforce_eager
        self.runners: dict[str, Runner] = {}
        self.transcript = (
            open(log_dir / "transcript.jsonl", "a") if log_dir else None  # noqa: SIM115
        )
        self.info: dict[str, Any] = {
            "model_dir": self.model,
            "methods": {n: s for n, s in self.specs.items()},
            "not_applicable": self.not_applicable,
            "startup": {},
            "timing": "stepped vLLM engine: ttft = prefill to first token; decode tok/s = "
            "tokens after the first / time from first to last; start-up and warm-up apart",
        }

    def start(self, name: str, warmup_ids: list[int]) -> None:
        """Start method `name`'s engine and wait for it (start-up and warm-up timed apart).
        One engine at a time: each holds the float32 weights, KV space and compiled graphs
        (~2 GB here), and this machine is shared."""
        print(f"vllm peer: starting {name} (vLLM start-up: minutes)", file=sys.stderr, flush=True)
        self.runners[name] = runner = Runner(
            name,
            {
                "model": self.model,
                "dtype": "float32",
                "speculative_config": self.specs[name],
                "enforce_eager": self.enforce_eager,
                "warmup_prompt_token_ids": [int(t) for t in warmup_ids],
            },
            self.log_dir / f"{_file_name(name)}.log" if self.log_dir else None,
            self.transcript,
        )
        ev = runner.read()
        if ev["event"] != "ready":
            raise JaxspecError(f"vLLM runner {name}: expected ready, got {ev['event']}")
        self.info["startup"][name] = {k: v for k, v in ev.items() if k != "event"}

    def stop(self, name: str) -> None:
        runner = self.runners.pop(name, None)
        if runner is not None:
            runner.close()

    def start_in_background(self, name: str, warmup_ids: list[int]) -> None:
        """`start` in a thread, so that vLLM's start-up overlaps jaxspec's own warm-up (both
        outside the measured window; each reported as measured, under that overlap).
        `wait_ready` joins it."""
        import threading

        def run():
            try:
                self.start(name, warmup_ids)
            except BaseException as e:  # noqa: BLE001 - re-raised by wait_ready
                self._start_error = e

        self._start_error = None
        self._starter = threading.Thread(target=run, daemon=True)
        self._starter.start()

    def wait_ready(self) -> None:
        self._starter.join()
        if self._start_error is not None:
            raise self._start_error

    def generate(self, name: str, prompt_ids: list[int], max_new_tokens: int) -> dict[str, Any]:
        ev = self.runners[name].request(
            {
                "id": name,
                "prompt_token_ids": [int(t) for t in prompt_ids],
                "max_new_tokens": max_new_tokens,
                "stop_token_ids": self.eos,
            }
        )
        if ev["event"] != "result":
            raise JaxspecError(f"vLLM runner {name}: expected a result, got {ev['event']}")
        return result_row(ev)

    def note_reference(self, question_id, token_ids: list[int]) -> None:
        """Our greedy tokens of a prompt, written to the transcript next to vLLM's (a recorded
        run is then a self-contained test file)."""
        if self.transcript is not None:
            ids = [int(t) for t in token_ids]
            ref = {"reference": "baseline", "question_id": question_id, "token_ids": ids}
            self.transcript.write(json.dumps(ref) + "\n")
            self.transcript.flush()

    def close(self) -> None:
        for name in list(self.runners):
            self.stop(name)
        if self.transcript is not None:
            self.transcript.close()


def _file_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name)
