"""What one compiled step costs on an accelerator, read from its optimised HLO, and the time
model that turns it into milliseconds.

- kernels: the launches one run of the program makes on a GPU: every instruction that is not a
  fusion body, tuple plumbing or control flow (fusions, custom calls, copies, collectives),
  while bodies times their trip count.
- host_syncs: host round trips on a GPU: XLA:GPU reads a `conditional`'s branch index and each
  trip's predicate of a `while` without a known trip count back to the host (a loop with a known
  trip count runs from the host without reading it). TPUs run control flow on the chip: 0.
- predicted_ms = bytes / (EFFICIENCY x bandwidth) + kernels x LAUNCH_US + host_syncs x SYNC_US,
  fitted (least squares) on the NVIDIA H200 cost curve in docs/device/h200-shapes.json (the
  stacked layout's decode programs at batch 1 / 8 / 32 of three shapes, compiled here for h200:
  `python scripts/fit_step_model.py`, which prints the fit and its per-point error). Refit when
  a device run adds points. On TPU the same bytes term is used with the TPU's launch cost taken as
  the GPU's (an upper bound: a TPU program is one launch), beside XLA's own `optimal_seconds`.
"""

from __future__ import annotations

import re

from jaxspec import hlo

# Fitted on the 9 H200 decode points (docs/device/h200-shapes.json; within 12% of each).
EFFICIENCY = 0.816  # achieved fraction of the vendor HBM bandwidth
LAUNCH_US = 0.65  # per kernel launch (back to back on a stream)
SYNC_US = 34.75  # per host round trip (predicate copy, stream sync, next launch)

_NOT_LAUNCHED = set(hlo.NO_BUFFER) | {"copy-done", "slice-done", "all-reduce-done",
                                      "all-gather-done", "collective-permute-done", "async-done",
                                      "async-update", "partition-id", "replica-id", "iota"}


def _entry(text: str) -> str | None:
    return next((m.group(1) for line in text.splitlines()
                 if (m := re.match(r"^ENTRY\s+%?([\w.\-]+)", line))), None)


def launches(text: str, *, unknown_trip: int = 1, computation: str | None = None) -> tuple[int, int]:
    """(kernels, host_syncs) of one run of `computation` (default the entry) on a GPU;
    unknown_trip: trips of a while loop whose count is data-dependent."""
    comps = hlo.parse(text)

    def walk(name: str) -> tuple[int, int]:
        kernels = syncs = 0
        for ins in comps.get(name, []):
            if ins.opcode == "while":
                trip = hlo._TRIP.search(ins.line)
                body = hlo._BODY.search(ins.line)
                cond = re.search(r"condition=%?([\w.\-]+)", ins.line)
                n = int(trip.group(1)) if trip else unknown_trip
                k, s = walk(body.group(1)) if body else (0, 0)
                ck, cs = walk(cond.group(1)) if cond else (0, 0)
                kernels += n * (k + ck) + (0 if trip else ck)
                syncs += n * (s + cs) + (0 if trip else n + 1)
            elif ins.opcode == "conditional":
                br = hlo._BRANCHES.search(ins.line)
                names = re.findall(r"%?([\w.\-]+)", br.group(1)) if br else []
                costs = [walk(b) for b in names] or [(0, 0)]
                kernels += max(c[0] for c in costs)
                syncs += 1 + max(c[1] for c in costs)
            elif ins.opcode == "call" and ins.calls:
                k, s = walk(ins.calls)
                kernels, syncs = kernels + k, syncs + s
            elif ins.opcode not in _NOT_LAUNCHED:
                kernels += 1
        return kernels, syncs

    name = computation or _entry(text)
    return walk(name) if name else (0, 0)


def loop_step(text: str) -> tuple[int, int]:
    """(kernels, host_syncs) of one step of a decode loop program: the body of the entry's
    outermost while loop (the generation loop), its own predicate read not counted."""
    comps = hlo.parse(text)
    loop = next((i for i in comps.get(_entry(text), []) if i.opcode == "while"), None)
    if loop is None:
        raise ValueError("no while loop at the top level of the program")
    return launches(text, computation=hlo._BODY.search(loop.line).group(1))


def kernel_list(text: str) -> list[str]:
    """The entry computation's launched kernels in launch order, one line each: name, what it
    computes (a fusion's root opcode), its output shape and the jax op it came from (metadata
    op_name, last two parts): the per-layer breakdown `--kernels` prints."""
    comps = hlo.parse(text)
    out = []
    for ins in comps.get(_entry(text), []):
        if ins.opcode in _NOT_LAUNCHED or ins.opcode in ("while", "conditional", "call"):
            continue
        root = hlo._root_opcode(comps, ins.calls) if ins.calls else ins.opcode
        op = re.search(r'op_name="([^"]*)"', ins.line)
        op = "/".join(op.group(1).split("/")[-2:]) if op else ""
        out.append(f"{ins.name} {root} {hlo.shape_of(ins.line)[:48]} {op}")
    return out


def large_copies(text: str, limit: int = 1 << 20) -> list[str]:
    """Copies (`copy`, a dynamic slice, or a fusion rooted in either) whose output exceeds `limit`
    bytes: a buffer the step writes whole, e.g. a weight sliced out of a layer stack or a
    transposed cache."""
    comps = hlo.parse(text)
    copying = ("copy", "dynamic-slice")
    return [i.name for c in comps.values() for i in c
            if (i.opcode in copying or i.opcode == "fusion" and i.calls
                and hlo._root_opcode(comps, i.calls) in copying)
            and hlo._shape_bytes(hlo.shape_of(i.line)) > limit]


_LOW_PRECISION = re.compile(r"= (bf16|f16)\[")


def low_precision_dots(text: str) -> list[str]:
    """Dot products the compiled program computes below float32: a `dot` with a bf16/f16 result,
    or the multiply / reduce XLA rewrote a small dot into (metadata op_name ".../dot_general")
    in bf16/f16, which rounds each product (or partial sum) before accumulating. A one-token
    projection and a window's must both be empty here to round alike (greedy identity)."""
    out = []
    for comp in hlo.parse(text).values():
        for ins in comp:
            rewritten = ins.opcode in ("multiply", "reduce") and '/dot_general"' in ins.line
            if (ins.opcode == "dot" or rewritten) and _LOW_PRECISION.search(ins.line):
                out.append(ins.name)
    return out


def kernels_computing(text: str, opcodes: tuple[str, ...]) -> int:
    """Launched kernels of the entry computation (and while bodies, once) whose fused computation
    holds one of `opcodes`: e.g. ("sine", "cosine") counts the RoPE tables' kernels, once a step
    where every layer reuses them, a few per layer where each layer recomputes them."""
    comps = hlo.parse(text)

    def holds(name: str) -> bool:
        return any(i.opcode in opcodes or (i.calls and holds(i.calls)) for i in comps.get(name, []))

    bodies = {i.calls for c in comps.values() for i in c if i.opcode == "fusion" and i.calls}
    return sum(1 for name, c in comps.items() if name not in bodies for i in c
               if i.opcode == "fusion" and i.calls and holds(i.calls))


def vocabulary_scans(text: str, vocab_sizes) -> list[str]:
    """Launched kernels that draw a token by scanning the vocabulary: a prefix sum (`cumsum`
    lowers to reduce-window) over a vocabulary-sized operand, or a vocabulary-sized boolean
    written out (a one-hot or a mask materialised). A greedy step needs neither: its argmax is
    two reductions (decode/sampling.py `greedy_tokens`). vocab_sizes: the target's and any draft
    vocabulary's sizes."""
    comps = hlo.parse(text)
    vocab = set(vocab_sizes)
    bodies = {i.calls for c in comps.values() for i in c if i.calls}

    def scans(name: str) -> bool:
        ins = comps.get(name, [])
        return (any(i.opcode == "reduce-window" for i in ins)
                and any(vocab & set(i.dims or ()) for i in ins)) or any(
                    i.calls and scans(i.calls) for i in ins if i.opcode == "fusion")

    out = []
    for name, comp in comps.items():
        if name in bodies:
            continue  # a fusion's body (read through its fusion instruction)
        for i in comp:
            wide_mask = i.line.split("=", 1)[1].lstrip().startswith("pred[") and vocab & set(
                i.dims or ())
            if (i.opcode == "fusion" and i.calls and (scans(i.calls) or wide_mask)) or (
                    i.opcode == "reduce-window" and vocab & set(i.dims or ())):
                out.append(i.name)
    return out


def collectives(text: str) -> int:
    """Collective ops in the optimised module (each async pair once)."""
    return sum(1 for ins in (i for c in hlo.parse(text).values() for i in c)
               if ins.opcode.removesuffix("-start") in hlo.COLLECTIVES
               and not ins.opcode.endswith("-done"))


def predicted_ms(bytes_moved: float, bandwidth: float, kernels: int, host_syncs: int) -> float:
    return (1e3 * bytes_moved / (EFFICIENCY * bandwidth) + 1e-3 * kernels * LAUNCH_US
            + 1e-3 * host_syncs * SYNC_US)


def floor_ms(min_bytes: float, bandwidth: float) -> float:
    return 1e3 * min_bytes / bandwidth
