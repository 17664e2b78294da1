"""CPU kernels for decode and verify windows, called from jit through XLA's FFI.

Why: XLA:CPU runs the one-token decode matmul as a bandwidth-bound matrix-vector product, but any
verify window of M >= 2 rows as a packed GEMM that copies the weights first, so a verify over
γ+1 positions cost ~1.5x a plain step on SmolLM2 — and speculation paid only beyond 1.5 accepted
tokens per step. `panel_matmul.cc` streams each weight once for all M rows instead (see there).
Its attention over the cache goes through a generic small-dot path over the whole capacity
(~11 ms of a step for a 5-token window at 1024 slots); `prefix_attention.cc` reads only the valid
prefix, once per kv head for the whole window.

    if kernels.available():
        w = kernels.pack(w_out_in)            # PackedWeight: f32[O/64, I, 64] + out_features
        y = kernels.panel_matmul(x, w)        # x: f32[..., I] -> f32[..., O]
        o = kernels.prefix_attention(q, k_cache, v_cache, k_new, v_new, cache_lengths, scale)

The kernels are compiled once per machine with the host compiler (`g++ -O3 -march=native`) into
`$JAXSPEC_CACHE_DIR/kernels` (default `~/.cache/jaxspec/kernels`) and registered with
`jax.ffi`. With no compiler, a non-CPU backend or `JAXSPEC_CPU_KERNELS=0`, `available()` is False
and models keep the plain XLA layout. Inference only: the kernels have no gradient.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.paths import cache_root

PANEL = 64  # output rows per panel; must match kPanel in panel_matmul.cc
PROMPT_GEMM_ROWS = 64  # a prompt's projections over this many rows or more: XLA's GEMM
_SOURCES = tuple(Path(__file__).with_name(n) for n in ("panel_matmul.cc", "prefix_attention.cc"))
_HEADERS = (Path(__file__).with_name("parallel.h"),)
_TARGETS = {"jaxspec_panel_matmul": "JaxspecPanelMatmul", "jaxspec_prefix_attention": "JaxspecPrefixAttention"}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """A linear weight `[O, I]` stored as panels `[ceil(O/64), I, 64]` (zero-padded rows)."""

    panels: jax.Array  # f32[P, I, 64]
    out_features: int = dataclasses.field(metadata=dict(static=True))
    # a prompt's weight (`for_prompts`): many rows run as XLA's GEMM on the panels
    prompt: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, int]:  # the logical [O, I] shape
        return (self.out_features, self.panels.shape[1])

    @property
    def dtype(self):
        return self.panels.dtype


def pack(w) -> PackedWeight:
    """f32[O, I] (torch layout) -> PackedWeight. Runs once at load time, on the host."""
    w = np.asarray(w, np.float32)
    out_features, in_features = w.shape
    num_panels = -(-out_features // PANEL)
    padded = np.zeros((num_panels * PANEL, in_features), np.float32)
    padded[:out_features] = w
    panels = padded.reshape(num_panels, PANEL, in_features).transpose(0, 2, 1)
    return PackedWeight(jnp.asarray(np.ascontiguousarray(panels)), out_features)


def unpack(w: PackedWeight) -> jax.Array:
    """PackedWeight -> f32[O, I]: the inverse of `pack` (for tests and for sharding code)."""
    p, i, _ = w.panels.shape
    return jnp.transpose(w.panels, (0, 2, 1)).reshape(p * PANEL, i)[: w.out_features]


def for_prompts(params):
    """`params` with every PackedWeight marked as a prompt's (`PackedWeight.prompt`): what a
    prefill runs on. Decode and verify keep the kernel (one FMA chain per output whatever the
    window, so their projections agree bit for bit); a prompt's many rows are compute-bound,
    where the kernel's 4-row register block reaches about a third of XLA's GEMM."""
    mark = lambda w: dataclasses.replace(w, prompt=True) if isinstance(w, PackedWeight) else w  # noqa: E731
    return jax.tree.map(mark, params, is_leaf=lambda w: isinstance(w, PackedWeight))


def panel_matmul(x: jax.Array, w: PackedWeight) -> jax.Array:
    """x: f32[..., I] @ w: PackedWeight[O, I] -> f32[..., O]. Needs `available()`, except for a
    prompt's weight (`for_prompts`) over at least PROMPT_GEMM_ROWS rows: XLA's GEMM on the
    panels (no copy of the weight back to [O, I])."""
    p, _, _ = w.panels.shape
    if w.prompt and np.prod(x.shape[:-1]) >= PROMPT_GEMM_ROWS:
        out = jnp.einsum("...i,pij->...pj", x.astype(jnp.float32), w.panels)
        out = out.reshape(x.shape[:-1] + (p * PANEL,))
        return out if p * PANEL == w.out_features else out[..., : w.out_features]
    _register()
    out = jax.ffi.ffi_call(
        "jaxspec_panel_matmul",
        jax.ShapeDtypeStruct(x.shape[:-1] + (p * PANEL,), jnp.float32),
        vmap_method="sequential",
    )(x.astype(jnp.float32), w.panels)
    return out if p * PANEL == w.out_features else out[..., : w.out_features]


def prefix_attention(
    q, k_cache, v_cache, k_window, v_window, lengths, scale: float, window_mask=None
) -> jax.Array:
    """q: f32[B, T, N, H]; k/v_cache: f32[B, K, S, H]; k/v_window: f32[B, T, K, H] (the window's
    own keys and values); lengths: int32[B]; window_mask: bool[B, T, T] or None (causal)
    -> f32[B, T, N, H].

    Query t of row b attends cache slots s < lengths[b], then the window positions j with
    window_mask[b, t, j], in ascending j (None: j = 0..t, the cache's causal-prefix mask,
    whether or not the window is already written into the cache). A draft tree passes each
    node's ancestors-and-self (`jaxspec.decode.tree.Window.mask`). Needs `available()`.
    """
    _register()
    b, t = q.shape[:2]
    if window_mask is None:
        window_mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    f32 = lambda a: a.astype(jnp.float32)
    return jax.ffi.ffi_call(
        "jaxspec_prefix_attention", jax.ShapeDtypeStruct(q.shape, jnp.float32), vmap_method="sequential"
    )(
        f32(q), f32(k_cache), f32(v_cache), f32(k_window), f32(v_window),
        lengths.astype(jnp.int32), window_mask.astype(jnp.uint8), scale=np.float32(scale),
    )


def available() -> bool:
    """True when the CPU kernel is built and registered (builds it on first call)."""
    if os.environ.get("JAXSPEC_CPU_KERNELS", "1").lower() in ("0", "false", "no", "off"):
        return False
    if jax.default_backend() != "cpu":
        return False
    return _try_register()


def unavailable_reason() -> str | None:
    """Why `available()` is False, in a few words; None where the kernels run."""
    if os.environ.get("JAXSPEC_CPU_KERNELS", "1").lower() in ("0", "false", "no", "off"):
        return "JAXSPEC_CPU_KERNELS=0 turned them off"
    if jax.default_backend() != "cpu":
        return f"the backend is {jax.default_backend()}, not cpu"
    return None if _try_register() else _build_errors[-1]


_build_errors: list[str] = []


@functools.cache
def _try_register() -> bool:  # one build attempt per process, success or not
    try:
        _register()
    except (OSError, subprocess.SubprocessError) as e:
        _build_errors.append(" ".join(str(e).split())[:300])
        warnings.warn(f"jaxspec CPU kernel unavailable ({e}); using XLA matmuls", stacklevel=3)
        return False
    return True


@functools.cache
def _register() -> None:
    library = ctypes.cdll.LoadLibrary(str(build_library()))
    for target, symbol in _TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")


def build_library() -> Path:
    """The kernels compiled for this host: the shared library's path (cached by source, jax version,
    CPU and compiler; a failed build is remembered and raised again as OSError)."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise OSError("no C++ compiler found (install g++ or set CXX)")
    source = b"".join(p.read_bytes() for p in _SOURCES + _HEADERS)
    key = hashlib.sha256(
        source + jax.__version__.encode() + _cpu_model().encode() + compiler.encode()
    ).hexdigest()[:16]
    lib = cache_root() / "kernels" / f"jaxspec_kernels-{key}.so"
    if lib.exists():
        return lib
    # A failed build is remembered (same sources, compiler and CPU): a bad CXX fails once, not
    # on every run. Delete the .failed file (or change CXX) to try again.
    failed = lib.with_suffix(".failed")
    if failed.is_file():
        raise OSError(f"{failed.read_text()[:400]} (remembered: delete {failed} to retry)")
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        partial = Path(tmp) / lib.name
        cmd = [compiler, "-O3", "-march=native", "-std=c++17", "-shared", "-fPIC",
               f"-I{jax.ffi.include_dir()}", *map(str, _SOURCES), "-o", str(partial)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                raise OSError(f"compiling the CPU kernels failed: {done.stderr.strip()[-500:]}")
        except (OSError, subprocess.SubprocessError) as e:
            if not isinstance(e, subprocess.TimeoutExpired):  # a slow machine may succeed later
                failed.write_text(f"compiling the CPU kernels with {compiler} failed: {e}"[:1000])
            raise
        os.replace(partial, lib)  # atomic: concurrent builders never load a half-written file
    return lib


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""
