"""Real-text distillation prompts: fortune and dictd parsing, WMT-style German, the prompt mix,
and prompts files read with clear errors."""

from __future__ import annotations

import gzip
import json

import pytest

from jaxspec.errors import JaxspecError
from jaxspec.train import corpus
from jaxspec.train.data import read_prompts_file

FORTUNES = """Der Zug kommt heute später, sagt der Schaffner.
Alle warten geduldig.
%
Wer zuletzt lacht, lacht am besten.
\t\t-- Sprichwort (alt)
%
%
"""


def test_split_fortunes_joins_lines_and_takes_the_author():
    assert corpus.split_fortunes(FORTUNES) == [
        ("Der Zug kommt heute später, sagt der Schaffner. Alle warten geduldig.", ""),
        ("Wer zuletzt lacht, lacht am besten.", "Sprichwort"),
    ]


def _b64(n: int) -> str:  # dictd's number encoding, written independently of the reader
    digits = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    out = ""
    while True:
        out = digits[n % 64] + out
        n //= 64
        if n == 0:
            return out


@pytest.mark.parametrize("compressed", [True, False])
def test_read_dictd_finds_each_entry_by_its_offsets(tmp_path, compressed):
    entries = [
        ("00-database-info", "header\n  about this file\n"),
        ("lisp", "lisp\n\n   <language> A {functional} language\n   from 1958 (\u00e9t\u00e9).\n"),
        ("awk", "awk\n\n   A pattern scanning\n   language.\n"),
    ]
    data, index = b"", []
    for head, text in entries:
        raw = text.encode("utf-8")
        index.append(f"{head}\t{_b64(len(data))}\t{_b64(len(raw))}")
        data += raw
    (tmp_path / "x.index").write_text("\n".join(index) + "\n")
    (tmp_path / "x.dict.dz").write_bytes(gzip.compress(data) if compressed else data)
    got = corpus.read_dictd(tmp_path / "x.index", tmp_path / "x.dict.dz")
    assert got == [
        ("lisp", "<language> A functional language from 1958 (\u00e9t\u00e9)."),
        ("awk", "A pattern scanning language."),
    ]


def test_wmt_style_spaces_sentence_punctuation_only():
    assert corpus.wmt_style("Er kam, sah und siegte. Um 3.5 Uhr?") == "Er kam , sah und siegte . Um 3.5 Uhr ?"


def test_corpus_prompts_cover_the_kinds_and_follow_the_seed():
    german = [(f"Das ist der deutsche Satz Nummer {'eins' * (i % 5 + 1)} hier", "") for i in range(20)]
    english = [("word " * 100 + f"end {i}", "Ada Lovelace") for i in range(5)]
    english += [(f"A short saying about things, number {i}, that people tell each other.", "Mark Twain") for i in range(5)]
    entries = [(f"term{i}", f"term{i} is a thing " * 30) for i in range(10)]
    rows = corpus.corpus_prompts(german, english, entries, 70, seed=3)
    kinds = [k for k, _ in rows]
    assert {k: kinds.count(k) for k in set(kinds)} == {
        "translation": 20, "summarization": 20, "rag": 10, "qa": 10, "mt_bench": 10,
    }
    for kind, prompt in rows:
        if kind == "translation":
            assert prompt.startswith("Translate German to English: Das ist der deutsche Satz")
        elif kind == "summarization":
            assert prompt.startswith("Summarize: ") and len(prompt) > 400
        elif kind == "rag":
            assert prompt.count("is a thing") == 90 and "\n" in prompt
    assert rows == corpus.corpus_prompts(german, english, entries, 70, seed=3)
    assert rows != corpus.corpus_prompts(german, english, entries, 70, seed=4)


def test_prompts_file_reads_rows_and_rejects_bad_ones(tmp_path):
    good = tmp_path / "p.jsonl"
    good.write_text(json.dumps({"prompt": "a"}) + "\n\n" + json.dumps({"prompt": "b", "category": "qa"}) + "\n")
    assert read_prompts_file(str(good)) == ["a", "b"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "a"}) + "\n" + json.dumps({"text": "b"}) + "\n")
    with pytest.raises(JaxspecError, match=r"bad.jsonl line 2: each row needs a string field"):
        read_prompts_file(str(bad))
    with pytest.raises(JaxspecError, match=r"does not exist: write it with `python scripts/corpus_prompts.py`"):
        read_prompts_file(str(tmp_path / "missing.jsonl"))
