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


def _parse_instr(line: str):
    """`  [ROOT] %name = SHAPE opcode(...)...` -> (name, shape, opcode, root) or None."""
    m = re.match(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*", line)
    if not m:
        return None
    rest = line[m.end():]
    if rest.startswith("("):  # tuple shape: up to the matching parenthesis
        depth = 0
        for end, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                break
        shape, rest = rest[: end + 1], rest[end + 1:]
    else:
        shape, _, rest = rest.partition(" ")
    op = re.match(r"\s*([\w\-]+)\(", rest)
    return (m.group(2), shape, op.group(1), bool(m.group(1))) if op else None


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
        parsed = _parse_instr(line) if current is not None else None
        if parsed:
            name, shape, opcode, root = parsed
            dm = None if shape.startswith("(") else _DIMS.match(shape)
            dims = tuple(int(d) for d in dm.group(1).split(",") if d) if dm else None
            calls = _CALLS.search(line)
            comps[current].append(Instr(name, dims, opcode, root, calls and calls.group(1), line))
    return comps


def _root_opcode(comps, name: str) -> str:
    """Opcode a fusion really performs: its body's root, looking through bitcasts."""
    body = {i.name: i for i in comps.get(name, [])}
    root = next((i for i in comps.get(name, []) if i.root), None)
    while root is not None and root.opcode in ("bitcast", "reshape"):
        operands = _operands(root.line, root.opcode)  # (a name may contain the opcode)
        root = body.get(operands[0]) if operands else None
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


# ---- bytes a device moves (XLA's cost analysis counts an in-place update's whole operand, a fused
# ---- dynamic slice's whole stack, and a while body once)

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
          "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
# An array with its layout: TPU layouts name an on-chip memory space (`S(1)`: VMEM), which a
# program reads without moving HBM bytes; the async copies into it (copy-start, slice-start)
# are the HBM reads.
_ARRAY_IN = re.compile(r"(\w+)\[([\d,]*)\](\{[^}]*\})?")
_ON_CHIP = re.compile(r"S\([1-4]\)")
ASYNC_INTO_CHIP = ("copy-start", "slice-start")
ASYNC_DONE = ("copy-done", "slice-done")
_TRIP = re.compile(r'known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_BODY = re.compile(r"body=%?([\w.\-]+)")
SLICING = ("dynamic-slice", "slice", "gather")


def _shape_bytes(shape: str, *, on_chip: bool = False) -> int:
    """Bytes of the HBM arrays in `shape` (on_chip: of the on-chip ones instead)."""
    return sum(_BYTES.get(t, 0) * math.prod(int(d) for d in dims.split(",") if d)
               for t, dims, layout in _ARRAY_IN.findall(shape)
               if bool(_ON_CHIP.search(layout or "")) == on_chip)


def _operands(line: str, opcode: str) -> list[str]:
    args = line[line.index(opcode + "(") + len(opcode) + 1:]
    depth, end = 1, 0
    for end, ch in enumerate(args):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            break
    return re.findall(r"%([\w.\-]+)", args[:end])


def shape_of(line: str) -> str:
    """The result shape text of one HLO instruction line (`f32[1,2]{1,0}`, a tuple's `(...)`), or ""."""
    parsed = _parse_instr(line)
    return parsed[1] if parsed else ""


def _fusion_bytes(comps, name: str, operand_bytes: list[int], out_bytes: int) -> int:
    """Bytes a fusion moves: each parameter whole, or only the slices read of it when every use is
    a (dynamic) slice (or a nested fusion whose root is one: a slice fused into a dot's
    operand), or nothing when it is the buffer an in-place root updates; the output whole, or
    only the updated rows for an in-place root."""
    instrs = comps.get(name, [])
    by_name = {i.name: i for i in instrs}
    users: dict[str, list[Instr]] = {}
    for ins in instrs:
        for op in _operands(ins.line, ins.opcode) if ins.opcode != "parameter" else []:
            users.setdefault(op, []).append(ins)

    def real_users(n):  # look through bitcasts
        out = []
        for u in users.get(n, []):
            out += real_users(u.name) if u.opcode == "bitcast" else [u]
        return out

    root = next((i for i in instrs if i.root), None)
    while root is not None and root.opcode == "bitcast":
        root = by_name.get(_operands(root.line, "bitcast")[0])
    in_place_buffer = None
    total = out_bytes
    if root is not None and root.opcode in IN_PLACE:
        ops = _operands(root.line, root.opcode)
        in_place_buffer = ops[0]
        upd = by_name.get(ops[2] if root.opcode == "scatter" else ops[1])
        total = 2 * _shape_bytes(shape_of(upd.line)) if upd else out_bytes
    params = [i for i in instrs if i.opcode == "parameter"]
    for p in params:
        idx = int(re.search(r"parameter\((\d+)\)", p.line).group(1))
        whole = operand_bytes[idx] if idx < len(operand_bytes) else 0
        chain = p.name
        while True:  # the in-place buffer may be reached through bitcasts
            us = users.get(chain, [])
            if len(us) == 1 and us[0].opcode == "bitcast":
                chain = us[0].name
                continue
            break
        if chain == in_place_buffer or p.name == in_place_buffer:
            continue
        us = real_users(p.name)
        sliced = lambda u: u.opcode in SLICING or (  # noqa: E731  (or a nested slicing fusion)
            u.opcode == "fusion" and u.calls and _root_opcode(comps, u.calls) in SLICING)
        if us and all(sliced(u) and _operands(u.line, u.opcode)[0] in (p.name, *[
                b.name for b in instrs if b.opcode == "bitcast"]) for u in us):
            total += min(whole, sum(_shape_bytes(shape_of(u.line)) for u in us))
        else:
            total += whole
    return total


def expected_trips_scope(trips: float) -> str:
    """A name scope (`jax.named_scope`) for a data-dependent loop expected to run `trips` times
    on average: `device_bytes` counts the loop at that figure, not at its `unknown_trip`."""
    return f"expected_trips_{trips:.4f}"


_STATED_TRIPS = re.compile(r'op_name="[^"]*expected_trips_([0-9.]+)[^"]*/while"')


def device_bytes(text: str, *, slices_fused_into_dots: bool = False, unknown_trip: int = 1) -> int:
    """Bytes an accelerator moves for one run of the module: like XLA's cost analysis, but in-place
    updates count their rows, fused slices their slice, and while bodies their known trip count.

    slices_fused_into_dots: count a top-level (dynamic) slice whose only users are dots as free
    (the dot reads the slice from the stack itself), as compilers that fuse a slice into a dot's
    operand do; XLA:CPU copies it out first (the stacked layout's per-layer weights).
    unknown_trip: how many times a while loop without a known trip count runs (data-dependent,
    e.g. the attention's loop over valid cache blocks), unless the loop states its expected
    count in its name scope (`expected_trips_scope`: the MoE loop over woken experts)."""
    comps = parse(text)
    entry = next((m.group(2) for line in text.splitlines() if (m := _COMP.match(line)) and m.group(1)),
                 None)

    def comp_bytes(name: str) -> int:
        instrs = comps.get(name, [])
        shapes = {i.name: shape_of(i.line) for i in instrs}
        users: dict[str, set[str]] = {}
        for i in instrs:
            for o in _operands(i.line, i.opcode) if i.opcode != "parameter" else []:
                users.setdefault(o, set()).add(i.opcode)
        total = 0
        for ins in instrs:
            op = ins.opcode
            if slices_fused_into_dots and users.get(ins.name) == {"dot"} and (
                op in SLICING or op == "fusion" and ins.calls
                and _root_opcode(comps, ins.calls) in SLICING
            ):
                continue
            if op in NO_BUFFER and op not in ("while", "conditional", "call"):
                continue
            if op == "while":
                trip = _TRIP.search(ins.line)
                body = _BODY.search(ins.line)
                stated = _STATED_TRIPS.search(ins.line)
                n = int(trip.group(1)) if trip else float(stated.group(1)) if stated else unknown_trip
                total += n * (comp_bytes(body.group(1)) if body else 0)
                continue
            if op == "conditional":
                br = _BRANCHES.search(ins.line)
                names = re.findall(r"%?([\w.\-]+)", br.group(1)) if br else []
                total += max((comp_bytes(n) for n in names), default=0)
                continue
            if op == "call" and ins.calls:
                total += comp_bytes(ins.calls)
                continue
            operands = [_shape_bytes(shapes.get(o, "")) for o in _operands(ins.line, op)]
            out = _shape_bytes(shape_of(ins.line))
            into_chip = _shape_bytes(shape_of(ins.line), on_chip=True)
            if op in ASYNC_INTO_CHIP and into_chip:  # TPU prefetch: one HBM read
                total += into_chip
            elif op in ASYNC_DONE and into_chip:  # the prefetched copy lands on chip
                continue
            elif op == "fusion" and ins.calls:
                total += _fusion_bytes(comps, ins.calls, operands, out)
            elif op in IN_PLACE:
                upd = operands[2] if op == "scatter" else operands[1]
                total += 2 * upd + sum(operands[3 if op == "scatter" else 2:])
            elif op in SLICING:
                total += 2 * out
            else:
                total += sum(operands) + out
        return total

    return round(comp_bytes(entry)) if entry else 0


# custom-call targets of the attention implementations, as they appear in a lowered (StableHLO)
# or compiled (HLO) program: Pallas on TPU lowers to Mosaic's "tpu_custom_call", Pallas on GPU
# (Triton) to "__gpu$xla.gpu.triton" (Mosaic GPU: "mosaic_gpu..."), the CPU kernels to their FFI
# names
ATTENTION_TARGETS = {
    "tpu_custom_call": "pallas_tpu",
    "__gpu$xla.gpu.triton": "pallas_gpu",
    "mosaic_gpu": "pallas_gpu",
    "mosaic_gpu_v2": "pallas_gpu",
    "jaxspec_prefix_attention": "cpu kernels",
}
_TARGET = re.compile(
    r'custom_call @"?([\w$.\-]+)"?\(|custom_call_target="([^"]+)"|call_target_name = "([^"]+)"')


def custom_calls(text: str) -> dict[str, int]:
    """{custom-call target: count} in a lowered (StableHLO, `lowered.as_text()` or an export's
    `mlir_module()`) or compiled (`compiled.as_text()`) program."""
    counts: dict[str, int] = {}
    for m in _TARGET.finditer(text):
        target = next(g for g in m.groups() if g)
        counts[target] = counts.get(target, 0) + 1
    return counts


def _attention_calls(text: str) -> dict[str, int]:
    """custom_calls of the attention kernels: Triton calls named "jaxspec_gemv" are the fused
    layout's projections on a GPU (models/gemv_gpu.py), not attention."""
    return custom_calls("\n".join(ln for ln in text.splitlines() if "jaxspec_gemv" not in ln))


def compiled_attention(text: str) -> str:
    """The attention implementation a program holds, read from its custom calls: "pallas_tpu",
    "pallas_gpu", "cpu kernels", or "xla" when it calls none of them (the XLA path). A program
    with several (e.g. kernels for some layers only) names them joined by "+"."""
    found = {ATTENTION_TARGETS[t] for t in _attention_calls(text) if t in ATTENTION_TARGETS}
    return "+".join(sorted(found)) or "xla"


def attention_kernel_calls(text: str) -> int:
    """How many attention-kernel custom calls a program holds (each layer's in an unrolled
    program; a scan's body once)."""
    return sum(n for t, n in _attention_calls(text).items() if t in ATTENTION_TARGETS)


_TENSOR = re.compile(r"tensor<([\dx]+)x(?:bf16|f16|f32)>")  # float operands: q, k, v, caches


def attention_kernel_operands(text: str) -> list[list[int]]:
    """Element counts of the float tensor operands of each attention-kernel custom call in a lowered
    (StableHLO) program, read from the call's type signature: what one call of the kernel
    takes (under shard_map, a device's shard; e.g. a cache's [B, K, S, H] or a stack's)."""
    out = []
    for line in text.splitlines():
        if "custom_call" not in line:
            continue
        m = _TARGET.search(line)
        if not m or next(g for g in m.groups() if g) not in ATTENTION_TARGETS:
            continue
        sig = line.rsplit(" : (", 1)[-1].split(") -> ")[0]
        out.append([math.prod(int(d) for d in dims.split("x")) for dims in _TENSOR.findall(sig)])
    return out
