"""Read an optimised HLO module (`jit(f).lower(...).compile().as_text()`) for memory traffic that
a step should not pay: buffers the size of the KV cache that are copied or zero-filled, and
collectives. Device-independent: the same program compiled for TPU pays the same traffic.

A "cache-sized" buffer has at least the element count of one layer's cache `[B, K, S, H]` and the
cache's slot count S among its dims. Only buffers *defined* at
the top level of a computation count (fusion bodies are read through their root): parameters,
tuples, bitcasts and control flow define no new buffer, and in-place updates (`dynamic-update-slice`,
`scatter`, or a fusion rooted in one, which XLA writes into its operand's buffer) write only the
updated rows. Everything else that yields a cache-sized array is a copy (or a zero-fill when it
is a broadcast), i.e. a full pass over the cache the step did not need.
"""

from __future__ import annotations

import dataclasses
import math
import re

COLLECTIVES = (
    "all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
    "collective-broadcast", "ragged-all-to-all",
)
NO_BUFFER = ("parameter", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
             "constant", "after-all", "opt-barrier", "optimization-barrier")
IN_PLACE = ("dynamic-update-slice", "scatter")

_COMP = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(\([^=]*?\)|[\w]+\[[^\]]*\](?:\{[^}]*\})?)\s+([\w\-]+)\(")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_DIMS = re.compile(r"\w+\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class Instr:
    name: str
    dims: tuple[int, ...] | None  # None for tuples
    opcode: str
    root: bool
    calls: str | None
    line: str


@dataclasses.dataclass(frozen=True)
class CacheTraffic:
    copies: tuple[str, ...]  # names of top-level instructions that copy a cache-sized buffer
    zero_fills: tuple[str, ...]  # ... that fill one with a broadcast constant
    collectives: tuple[str, ...]

    def summary(self) -> dict[str, int]:
        return {"cache_copies": len(self.copies), "zero_fills": len(self.zero_fills),
                "collectives": len(self.collectives)}


def parse(text: str) -> dict[str, list[Instr]]:
    """Computation name -> its instructions (HLO text as printed by XLA)."""
    comps: dict[str, list[Instr]] = {}
    current = None
    for line in text.splitlines():
        if current is None or line.startswith(("ENTRY", "%")) and line.rstrip().endswith("{"):
            m = _COMP.match(line)
            if m and "=" not in line.split("(")[0]:
                current = m.group(2)
                comps[current] = []
                continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTR.match(line)
        if m and current is not None:
            shape = m.group(3)
            dm = None if shape.startswith("(") else _DIMS.match(shape)
            dims = tuple(int(d) for d in dm.group(1).split(",") if d) if dm else None
            calls = _CALLS.search(line)
            comps[current].append(
                Instr(m.group(2), dims, m.group(4), bool(m.group(1)), calls and calls.group(1), line)
            )
    return comps


def _root_opcode(comps, name: str) -> str:
    """Opcode a fusion really performs: its body's root, looking through bitcasts."""
    body = {i.name: i for i in comps.get(name, [])}
    root = next((i for i in comps.get(name, []) if i.root), None)
    while root is not None and root.opcode in ("bitcast", "reshape"):
        operand = re.search(r"\(%?([\w.\-]+)", root.line[root.line.index(root.opcode):])
        root = body.get(operand.group(1)) if operand else None
    if root is None:
        return "?"
    if root.opcode == "fusion" and root.calls:
        return _root_opcode(comps, root.calls)
    return root.opcode


def cache_traffic(text: str, layer_cache_shape: tuple[int, ...]) -> CacheTraffic:
    """Count copies / zero-fills of cache-sized buffers, and collectives, in an optimised module.

    layer_cache_shape: one layer's `[B, K, S, H]`; any buffer at least that large with S among
    its dims counts (a layer's slice, the whole stack, or a product broadcast over it).
    """
    comps = parse(text)
    fused = {i.calls for c in comps.values() for i in c if i.opcode == "fusion" and i.calls}
    per_layer = math.prod(layer_cache_shape)
    slots = layer_cache_shape[2]
    copies, zeros, collectives = [], [], []
    for name, instrs in comps.items():
        if name in fused:
            continue
        for ins in instrs:
            op = ins.opcode.removesuffix("-start").removesuffix("-done")
            if op in COLLECTIVES and not ins.opcode.endswith("-done"):
                collectives.append(ins.name)
            if ins.dims is None or math.prod(ins.dims) < per_layer or slots not in ins.dims:
                continue
            if ins.opcode in NO_BUFFER or ins.opcode.endswith("-done"):
                continue
            does = _root_opcode(comps, ins.calls) if ins.opcode == "fusion" and ins.calls else ins.opcode
            if does in IN_PLACE:
                continue
            (zeros if does == "broadcast" else copies).append(f"{name}/{ins.name}:{does}")
    return CacheTraffic(tuple(copies), tuple(zeros), tuple(collectives))
