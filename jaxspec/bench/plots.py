"""Pictures and the Markdown summary for `jaxspec.bench` results (a results.json dict).

write_plots(results, out_dir)    -> list of PNG names (matplotlib, Agg backend)
write_summary(results, path)     -> summary.md: settings, per-config/category tables, peers, sweeps
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jaxspec.bench import vllm_report


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plots(results: dict[str, Any], out: str | Path) -> list[str]:
    out = Path(out)
    written = []
    for name, fn in [
        ("category_speedup.png", plot_category_speedup),
        ("accepted_length_hist.png", plot_accepted_length_hist),
        ("per_position_acceptance.png", plot_per_position),
        ("gamma_sweep.png", plot_gamma_sweep),
        ("batch_sweep.png", plot_batch_sweep),
        ("vllm_side_by_side.png", plot_vllm),
    ]:
        fig = fn(results)
        if fig is None:
            continue
        fig.savefig(out / name, dpi=110, bbox_inches="tight")
        _plt().close(fig)
        written.append(name)
    return written


def plot_vllm(results):
    return vllm_report.plot_side_by_side(results)


def _spec_configs(results):
    return {l: e for l, e in results.get("configs", {}).items() if e["num_speculative_tokens"]}


def plot_category_speedup(results):
    configs = _spec_configs(results)
    if not configs:
        return None
    plt = _plt()
    cats = list(next(iter(configs.values()))["categories"]) + ["overall"]
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(cats)), 4))
    width = 0.8 / len(configs)
    for i, (label, e) in enumerate(configs.items()):
        vals = [(e["categories"].get(c) or {}).get("speedup") or 0 for c in cats[:-1]]
        vals.append(e["overall"]["speedup"] or 0)
        xs = [j + (i - (len(configs) - 1) / 2) * width for j in range(len(cats))]
        ax.bar(xs, vals, width, label=label)
    ax.axhline(1.0, color="k", lw=1, ls="--", label="plain (1x)")
    ax.set_xticks(range(len(cats)), cats, rotation=20)
    ax.set_ylabel("decode speedup over plain")
    ax.set_title("Per-category speedup (greedy, batch 1)")
    ax.legend(fontsize=8)
    return fig


def accepted_count_distribution(per_position: list[float]) -> list[float]:
    """P(exactly k drafts accepted in a step), k = 0..γ, from P(position i accepted).

    Acceptance is a prefix, so P(≥ k accepted) = per_position[k-1] and P(k) = P(≥k) − P(≥k+1).
    """
    at_least = [1.0, *per_position, 0.0]
    return [max(at_least[k] - at_least[k + 1], 0.0) for k in range(len(per_position) + 1)]


def plot_accepted_length_hist(results):
    configs = _spec_configs(results)
    if not configs:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.8 / len(configs)
    for i, (label, e) in enumerate(configs.items()):
        dist = accepted_count_distribution(e["overall"]["accepted_per_position"])
        xs = [k + 1 + (i - (len(configs) - 1) / 2) * width for k in range(len(dist))]
        ax.bar(xs, dist, width, label=f"{label} (mean {e['overall']['mean_accepted_length']:.2f})")
    ax.set_xlabel("tokens emitted per target forward (accepted drafts + 1)")
    ax.set_ylabel("fraction of steps")
    ax.set_title("Accepted length per step")
    ax.legend(fontsize=8)
    return fig


def plot_per_position(results):
    configs = _spec_configs(results)
    if not configs:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, e in configs.items():
        pp = e["overall"]["accepted_per_position"]
        ax.plot(range(1, len(pp) + 1), pp, marker="o", label=label)
    ax.set_xlabel("draft position")
    ax.set_ylabel("fraction of steps accepting it")
    ax.set_ylim(0, 1)
    ax.set_title("Per-position acceptance")
    ax.legend(fontsize=8)
    return fig


def plot_gamma_sweep(results):
    sweep = results.get("gamma_sweep")
    if not sweep or not sweep.get("points"):
        return None
    plt = _plt()
    f = sweep["formula"]
    pts = sweep["points"]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.plot(
        f["curve"]["gamma"],
        f["curve"]["speedup"],
        "-",
        label=f"formula, α={f['alpha']:.2f}, measured step cost "
        f"r(γ)={f['step_cost_fit']['r0']:.2f}+{f['step_cost_fit']['r1']:.2f}γ",
    )
    ax.plot(
        f["curve_free_verify"]["gamma"],
        f["curve_free_verify"]["speedup"],
        ":",
        color="gray",
        label="formula with a free verify (r=1)",
    )
    ax.plot(
        [p["gamma"] for p in pts],
        [p["speedup"] or 0 for p in pts],
        "o",
        color="C3",
        label="measured",
    )
    ax.plot(
        [p["gamma"] for p in pts],
        [p["predicted_speedup"] or 0 for p in pts],
        "x",
        color="C2",
        label="formula at each point's own α, r",
    )
    ax.axhline(1.0, color="k", lw=1, ls="--", label="plain (1x)")
    ax.axvline(f["optimal_gamma"], color="C0", lw=0.8, ls="-.")
    ax.set_xlabel("γ (draft tokens per step)")
    ax.set_ylabel("decode speedup over plain")
    ax.set_title(f"γ sweep: {sweep['config']} (optimal γ ≈ {f['optimal_gamma']})")
    ax.legend(fontsize=7)
    return fig


def plot_batch_sweep(results):
    sweep = results.get("batch_sweep")
    if not sweep or not sweep.get("points"):
        return None
    plt = _plt()
    pts = sweep["points"]
    bs = [p["batch_size"] for p in pts]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    a1.plot(bs, [p["plain_tokens_per_s"] for p in pts], "o-", label="plain")
    a1.plot(bs, [p["speculative_tokens_per_s"] for p in pts], "s-", label=sweep["config"])
    a1.set_xscale("log", base=2)
    a1.set_xlabel("batch size")
    a1.set_ylabel("throughput, generated tokens/s")
    if sweep.get("crossover_batch_size"):
        a1.axvline(
            sweep["crossover_batch_size"],
            color="gray",
            ls="--",
            lw=0.8,
            label=f"crossover (b={sweep['crossover_batch_size']})",
        )
    a1.legend(fontsize=8)
    a2.plot(bs, [p["plain_latency_s"] for p in pts], "o-", label="plain")
    a2.plot(bs, [p["speculative_latency_s"] for p in pts], "s-", label=sweep["config"])
    a2.set_xscale("log", base=2)
    a2.set_xlabel("batch size")
    a2.set_ylabel("latency per request, s")
    a2.legend(fontsize=8)
    fig.suptitle(
        f"Batch sweep, {sweep['max_new_tokens']} new tokens, {sweep['rounds']} batches per size"
    )
    return fig


# ---- Markdown --------------------------------------------------------------------------------
def _f(x, nd=2, suffix=""):
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "**NO**"
    return f"{x:.{nd}f}{suffix}"


def _done(results: dict[str, Any]) -> str:
    """Questions actually run (all methods), with the planned number when interrupted."""
    settings = results.get("settings", {})
    planned = settings.get("num_prompts")
    if settings.get("sweeps_only"):
        return f"0 (sweeps only; {planned} selected)"
    rows = (results.get("per_prompt") or {}).values()
    done = min((len(r) for r in rows), default=0)
    return str(planned) if done == planned else f"{done} (of {planned} planned; run interrupted)"


def _header_lines(results: dict[str, Any]) -> list[str]:
    """Title, status, machine and protocol."""
    s = results.get("settings", {})
    m = results.get("machine", {})
    return [
        "# jaxspec benchmark summary",
        "",
        f"Status: {results.get('status')}. Command: `{results.get('command')}`",
        "",
        (
            f"Machine: {m.get('cpu')} ({m.get('usable_cpus')} usable CPUs), jax {m.get('jax_version')}"
            f" on {m.get('backend')} ({', '.join(m.get('devices', []))}); load average at start "
            f"{m.get('load_average')}."
        ),
        "",
        (
            f"Protocol: greedy, batch 1, first turn of {_done(results)} Spec-Bench questions "
            f"(up to {s.get('n_per_category')} per category), "
            f"max_new_tokens={s.get('max_new_tokens')}, "
            "warm-up excluded, methods interleaved per prompt, baseline = plain decoding of the same "
            "loaded target. tok/s = decode only (prefill and first token excluded), e2e = including "
            "prefill; both are means of per-question figures. Speedup = ratio of those means."
        ),
        "",
    ]


def _config_lines(configs: dict[str, Any]) -> list[str]:
    """The overall and per-category tables of jaxspec's configs."""
    lines = []
    lines += [
        "## Overall",
        "",
        (
            "| config | method | γ | tok/s | plain tok/s | speedup | e2e tok/s | e2e speedup "
            "| mean accepted | acceptance | nodes/step | step cost | output = plain |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, e in configs.items():
        o = e["overall"]
        lines.append(
            f"| {label} | {e['method']} | {e['num_speculative_tokens']} | "
            f"{_f(o['tokens_per_s'], 1)} | {_f(o['baseline_tokens_per_s'], 1)} | "
            f"{_f(o['speedup'], 2, 'x')} | {_f(o['e2e_tokens_per_s'], 1)} | "
            f"{_f(o['e2e_speedup'], 2, 'x')} | {_f(o['mean_accepted_length'])} | "
            f"{_f(o['acceptance_rate'])} | {_f(o.get('nodes_per_step'), 1)} | "
            f"{_f(o['step_cost_ratio'])} | "
            f"{_f(o['outputs_match_baseline'])} ({_f(o['match_rate'])}) |"
        )
    lines += ["", "## Per category (decode tok/s, speedup, mean accepted length)", ""]
    cats = list(next(iter(configs.values()))["categories"])
    lines.append("| config | " + " | ".join(cats) + " |")
    lines.append("|---|" + "---|" * len(cats))
    for label, e in configs.items():
        cells = []
        for c in cats:
            o = e["categories"].get(c)
            cells.append(
                "–"
                if not o
                else f"{_f(o['tokens_per_s'], 1)} ({_f(o['speedup'], 2, 'x')}, "
                f"{_f(o['mean_accepted_length'])})"
            )
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("")
    return lines


def _hf_peer_lines(hf: dict[str, Any], configs: dict[str, Any]) -> list[str]:
    """The Hugging Face transformers peers: overall, the targets, per category."""
    lines = []
    info = hf["info"]
    lines += [
        "## Hugging Face transformers peers",
        "",
        (
            f"transformers {info['transformers_version']}, torch {info['torch_version']} "
            f"({info['torch_threads']} threads), float32, greedy, same GGUF weights, same "
            "chat-templated prompts and max_new_tokens. HF tok/s = new tokens / generate() wall "
            "time (includes prefill): compare with our e2e column."
        ),
        "",
        "| peer | tok/s | same tokens as our plain | "
        + " | ".join(f"{l} e2e / peer" for l in configs)
        + " |",
        "|---|---|---|" + "---|" * len(configs),
    ]
    for name, pm in hf["methods"].items():
        o = pm["overall"]
        ratios = " | ".join(
            _f((o["ours_over_this"].get(l) or {}).get("e2e_ratio"), 2, "x") for l in configs
        )
        lines.append(
            f"| {name} | {_f(o['tokens_per_s'], 1)} | "
            f"{_f(o['match_rate_vs_our_baseline'])} | {ratios} |"
        )
    for label, why in info.get("not_applicable", {}).items():
        lines.append(f"| assisted ({label}) | n/a: {why} | – | " + "– | " * len(configs))
    t = hf.get("targets", {})
    lines += [
        "",
        (
            f"Targets (e2e, like for like): our plain / HF plain = "
            f"{_f(t.get('our_plain_e2e_over_hf_plain'), 2, 'x')} (target ≥ 3x); our best / HF "
            f"plain = {_f(t.get('our_best_e2e_over_hf_plain'), 2, 'x')} (≥ 5x); our best / HF "
            f"best speculative ({t.get('hf_best_speculative')}) = "
            f"{_f(t.get('our_best_e2e_over_hf_best_speculative'), 2, 'x')} (≥ 4x). Decode-only "
            f"versions: {_f(t.get('our_plain_decode_over_hf_plain'), 2, 'x')}, "
            f"{_f(t.get('our_best_decode_over_hf_plain'), 2, 'x')}, "
            f"{_f(t.get('our_best_decode_over_hf_best_speculative'), 2, 'x')}."
        ),
        "",
    ]
    cats = list(next(iter(hf["methods"].values()))["categories"])
    lines += [
        "Per category, tok/s:",
        "",
        "| peer | " + " | ".join(cats) + " |",
        "|---|" + "---|" * len(cats),
    ]
    for name, pm in hf["methods"].items():
        lines.append(
            f"| {name} | "
            + " | ".join(
                _f((pm["categories"].get(c) or {}).get("tokens_per_s"), 1) for c in cats
            )
            + " |"
        )
    lines.append("")
    return lines


def _gamma_sweep_lines(g: dict[str, Any]) -> list[str]:
    """The γ sweep against the formula."""
    lines = []
    f = g.get("formula", {})
    lines += [
        f"## γ sweep ({g['config']}, {g['num_prompts']} prompts)",
        "",
        (
            f"Formula: speedup ≈ E(α, γ) / r(γ), E = (1 − α^(γ+1)) / (1 − α), α = "
            f"{_f(f.get('alpha'), 3)} (fitted from mean accepted length), measured step cost "
            f"r(γ) ≈ {_f(f.get('step_cost_fit', {}).get('r0'))} + "
            f"{_f(f.get('step_cost_fit', {}).get('r1'), 3)}·γ; optimal γ ≈ "
            f"{f.get('optimal_gamma')}."
        ),
        "",
        (
            "| γ | tok/s | plain tok/s | speedup | predicted | mean accepted | acceptance | α fit "
            "| step cost | output = plain |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in g["points"]:
        lines.append(
            f"| {p['gamma']} | {_f(p['tokens_per_s'], 1)} | {_f(p['baseline_tokens_per_s'], 1)}"
            f" | {_f(p['speedup'], 2, 'x')} | {_f(p['predicted_speedup'], 2, 'x')} | "
            f"{_f(p['mean_accepted_length'])} | {_f(p['acceptance_rate'])} | "
            f"{_f(p['alpha_from_accepted_length'])} | {_f(p['step_cost_ratio'])} | "
            f"{_f(p['outputs_match_baseline'])} |"
        )
    lines.append("")
    return lines


def _batch_sweep_lines(b: dict[str, Any]) -> list[str]:
    """The batch sweep: plain vs speculative per batch size."""
    lines = []
    lines += [
        (
            f"## Batch sweep (plain vs {b['config']}, {b['max_new_tokens']} new tokens, "
            f"{b.get('rounds')} batches per size)"
        ),
        "",
        (
            "| batch | plain tok/s | spec tok/s | speedup | plain latency s | spec latency s | "
            "outputs equal |"
        ),
        "|---|---|---|---|---|---|---|",
    ]
    for p in b["points"]:
        lines.append(
            f"| {p['batch_size']} | {_f(p['plain_tokens_per_s'], 1)} | "
            f"{_f(p['speculative_tokens_per_s'], 1)} | {_f(p['speedup'], 2, 'x')} | "
            f"{_f(p['plain_latency_s'])} | {_f(p['speculative_latency_s'])} | "
            f"{_f(p['outputs_match'])} |"
        )
    faster = b.get("speculative_faster_at") or []
    lines += [
        "",
        (
            f"Speculation faster at batch sizes: {faster or 'none'}; crossover (first "
            f"larger batch size where plain wins): {b.get('crossover_batch_size') or '–'}."
        ),
        "",
    ]
    return lines


def write_summary(results: dict[str, Any], path: str | Path) -> str:
    """The benchmark's markdown summary, written to `path` and returned."""
    configs = results.get("configs", {})
    hf = (results.get("peers") or {}).get("hf")
    g, b = results.get("gamma_sweep"), results.get("batch_sweep")
    lines = _header_lines(results)
    lines += _config_lines(configs) if configs else []
    lines += _hf_peer_lines(hf, configs) if hf and hf.get("methods") else []
    lines += vllm_report.summary_lines(results)
    lines += _gamma_sweep_lines(g) if g and g.get("points") else []
    lines += _batch_sweep_lines(b) if b and b.get("points") else []
    skipped = results.get("skipped_configs")
    if skipped:
        lines += ["## Skipped configs", ""] + [f"- {l}: {why}" for l, why in skipped.items()] + [""]
    text = "\n".join(lines)
    Path(path).write_text(text)
    return text
