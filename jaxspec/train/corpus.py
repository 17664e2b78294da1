"""Real text for distillation prompts: German and English fortune files (Debian `fortunes-de`,
`fortunes`) and the FOLDOC / Jargon File dictionaries (`dict-foldoc`, `dict-jargon`), turned
into prompts of the request kinds Spec-Bench measures. The target answers them (data.py,
`prompts_file`); nothing here comes from spec_bench_dev.jsonl.

Pure functions over text; scripts/corpus_prompts.py fetches the packages and writes the file.
"""

from __future__ import annotations

import gzip
import re
from pathlib import Path

import numpy as np

from jaxspec.train import prompts as prompt_sets

_B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
_ATTRIBUTION = re.compile(r"^\s*--\s*(.+?)\s*$")


def split_fortunes(text: str) -> list[tuple[str, str]]:
    """A fortune file -> (body joined into one paragraph, author or '') per entry."""
    out = []
    for entry in re.split(r"^%[ \t]*$", text, flags=re.M):  # separator lines hold only "%"
        lines, author = [], ""
        for line in entry.strip().splitlines():
            m = _ATTRIBUTION.match(line)
            if m:
                author = re.split(r"[,(]", m.group(1))[0].strip()
            else:
                lines.append(line.strip())
        body = " ".join(x for x in lines if x)
        if body:
            out.append((re.sub(r"\s+", " ", body), author))
    return out


def _dict_number(code: str) -> int:  # dictd's base-64 offsets and lengths
    n = 0
    for ch in code:
        n = n * 64 + _B64.index(ch)
    return n


def read_dictd(index_path: Path, dict_path: Path) -> list[tuple[str, str]]:
    """A dictd database -> (headword, definition joined into one paragraph) per entry;
    `{links}` lose their braces, the 00-database-* header entries are dropped."""
    raw = dict_path.read_bytes()
    data_bytes = gzip.decompress(raw) if raw.startswith(b"\x1f\x8b") else raw  # offsets: uncompressed bytes
    out = []
    for line in index_path.read_text(encoding="utf-8", errors="replace").splitlines():
        parts = line.split("\t")
        if len(parts) != 3 or parts[0].startswith("00-database") or parts[0].startswith("00database"):
            continue
        start, size = _dict_number(parts[1]), _dict_number(parts[2])
        body = data_bytes[start : start + size].decode("utf-8", "replace").splitlines()[1:]
        text = re.sub(r"[{}]", "", " ".join(x.strip() for x in body))
        text = re.sub(r"\s+", " ", text).strip()
        if text:
            out.append((parts[0], text))
    return out


def wmt_style(sentence: str) -> str:
    """Space before sentence punctuation, as in WMT news test sets ("ist , da ... an .")."""
    return re.sub(r"(?<=\S)([,.!?;:])(?=\s|$)", r" \1", sentence).strip()


def _ok_text(s: str, lo: int, hi: int) -> bool:
    letters = sum(c.isalpha() for c in s)
    return lo <= len(s) <= hi and letters > 0.7 * len(s.replace(" ", ""))


EXPLAIN_FORMS = [
    "Explain the meaning of this quote: \"{q}\"", "Do you agree with this? Discuss: \"{q}\"",
    "Write a short story that illustrates this saying: \"{q}\"", "Rewrite this in simple words: \"{q}\"",
]
PERSON_QUESTIONS = ["who was {s}", "what is {s} famous for", "who is {s}", "when did {s} live"]


def corpus_prompts(german, english, entries, n: int, seed: int = 0) -> list[tuple[str, str]]:
    """`n` (category, prompt) pairs cycling through translation, summarization, rag, qa,
    mt_bench, translation, summarization, drawn with `seed`.
    german / english: (body, author) fortunes; entries: (headword, definition) pairs."""
    rng = np.random.default_rng(seed)
    de = [b for b, _ in german if _ok_text(b, 40, 400)]
    long_en = [b for b, _ in english if _ok_text(b, 400, 3000)]
    short_en = [b for b, _ in english if _ok_text(b, 60, 300)]
    defs = [(h, d) for h, d in entries if _ok_text(d, 300, 2500)]
    short_defs = [(h, d) for h, d in defs if len(d) <= 1200]
    articles = long_en + [d for _, d in defs if len(d) >= 500]
    authors = sorted({a for _, a in english + german if 4 <= len(a) <= 40 and " " in a})
    pick = lambda xs: xs[int(rng.integers(len(xs)))]  # noqa: E731
    out = []
    for i in range(n):
        kind = ("translation", "summarization", "rag", "qa", "mt_bench", "translation", "summarization")[i % 7]
        if kind == "translation":
            out.append((kind, f"Translate German to English: {wmt_style(pick(de))}"))
        elif kind == "summarization":
            out.append((kind, f"Summarize: {pick(articles)}"))
        elif kind == "rag":
            ctx = [pick(short_defs) for _ in range(3)]  # ~3.5k characters, as Spec-Bench's rag
            form = pick(prompt_sets.QUESTION_FORMS).format(s=ctx[1][0])
            out.append((kind, " ".join(d for _, d in ctx) + "\n" + form))
        elif kind == "qa":
            if rng.random() < 0.5:
                q = pick(PERSON_QUESTIONS).format(s=pick(authors))
            else:
                q = pick(prompt_sets.SHORT_QUESTIONS).format(s=pick(defs)[0])
            out.append((kind, q + "?"))
        else:
            if rng.random() < 0.5:
                out.append((kind, pick(EXPLAIN_FORMS).format(q=pick(short_en))))
            else:
                out.append((kind, pick(prompt_sets.MT_FORMS).format(s=pick(defs)[0])))
    return out


def load_corpora(root: Path):
    """(german fortunes, english fortunes, dictionary entries) from an unpacked package root."""
    fdir = root / "usr/share/games/fortunes"
    read = lambda p: p.read_text(encoding="utf-8", errors="replace")  # noqa: E731
    german = [e for p in sorted((fdir / "de").glob("*.u8")) for e in split_fortunes(read(p))]
    english = [
        e for p in sorted(fdir.iterdir())
        if p.is_file() and p.suffix == "" and p.name not in ("ascii-art",) for e in split_fortunes(read(p))
    ]
    ddir = root / "usr/share/dictd"
    entries = []
    for name in ("foldoc", "jargon"):
        if (ddir / f"{name}.index").exists():
            entries += read_dictd(ddir / f"{name}.index", ddir / f"{name}.dict.dz")
    return german, english, entries
