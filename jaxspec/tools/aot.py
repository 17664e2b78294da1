"""Compile for an accelerator this host does not have: compile-only devices of a named target
(H100 / H200 through XLA:GPU's deviceless compile, TPU v5e / v5p / v6e through libtpu's
topologies), abstract inputs placed on them, and the compiled program of a jitted function.

The compilers come from wheels matching the installed jax: `jax-cuda12-plugin` and
`jax-cuda12-pjrt` (installed `--no-deps`: no CUDA libraries are needed to compile) and `libtpu`.
They are looked up where the `aot` extra installs them (importable) or in a separate folder
(`$JAXSPEC_AOT_PATH`, default `<venv>/aot`, where scripts/setup.sh puts them) that is added to
the import path only here, after jax has started its own backends: a CPU-only jax never sees
them (no plugin warnings, no slower start). GPU target descriptions (the `GpuTargetConfig` text
protos: SMs, memory size and bandwidth, compute capability) ship in `gpu_targets/`.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
import sys
from pathlib import Path

from jaxspec.errors import JaxspecError

GPU_TARGETS = Path(__file__).with_name("gpu_targets")
# libtpu looks for a TPU VM's metadata server unless told it only compiles; the CUDA plugin
# checks the CUDA libraries' versions unless told not to (none are needed to compile). libtpu's
# one-process lockfile guards a real chip: compile-only processes may load it side by side.
COMPILE_ONLY_ENV = {
    "TPU_SKIP_MDS_QUERY": "1", "TPU_ACCELERATOR_TYPE": "v5litepod-4",
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
    "TPU_WORKER_HOSTNAMES": "localhost", "TPU_WORKER_ID": "0",
    "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1",
}


@dataclasses.dataclass(frozen=True)
class AccelTarget:
    name: str
    platform: str  # "cuda" | "tpu": what the program is lowered for
    bandwidth: float  # HBM bytes/s per chip (the vendor's figure)
    memory: float  # HBM bytes per chip
    topology: str = ""  # TPU: the topology family ("v5e"); chips are added by chip count


def _gpu(name: str) -> AccelTarget:
    text = (GPU_TARGETS / f"{name}.txtpb").read_text()
    read = lambda field: float(re.search(rf"{field}: (\d+)", text).group(1))  # noqa: E731
    return AccelTarget(name, "cuda", read("memory_bandwidth"), read("device_memory_size"))


GIB = 1 << 30
TARGETS = {
    "h100": lambda: _gpu("h100"),
    "h200": lambda: _gpu("h200"),
    "v5e": lambda: AccelTarget("v5e", "tpu", 819e9, 16 * GIB, "v5e"),
    "v5p": lambda: AccelTarget("v5p", "tpu", 2765e9, 95 * GIB, "v5p"),
    "v6e": lambda: AccelTarget("v6e", "tpu", 1640e9, 32 * GIB, "v6e"),
}
# The smallest libtpu topology of each family holding n chips (libtpu's hosts are 2x2 chips;
# fewer chips use the first devices of a 2x2 topology).
_TPU_TOPOLOGIES = {
    "v5e": ((4, "2x2"), (8, "2x4"), (16, "4x4"), (32, "4x8"), (64, "8x8")),
    "v6e": ((4, "2x2"), (8, "2x4"), (16, "4x4"), (32, "4x8"), (64, "8x8")),
    "v5p": ((4, "2x2x1"), (8, "2x2x2"), (16, "2x2x4"), (32, "2x4x4"), (64, "4x4x4")),
}


def target(name: str) -> AccelTarget:
    if name not in TARGETS:
        raise JaxspecError(f"unknown --target {name!r}: use one of {', '.join(TARGETS)}")
    return TARGETS[name]()


def target_of_device(kind: str) -> str | None:
    """The TARGETS name of a real device's `device_kind` ("NVIDIA H200", "TPU v5 lite"), or None."""
    kind = kind.lower()
    for needle, name in (("h200", "h200"), ("h100", "h100"), ("v5 lite", "v5e"), ("v5e", "v5e"),
                         ("v6", "v6e"), ("v5p", "v5p"), ("tpu v5", "v5p")):
        if needle in kind:
            return name
    return None


def wheels(jax_version: str) -> dict[str, str]:
    """The compiler wheels for this jax: {platform: pip requirement(s)}."""
    return {"cuda": f"jax-cuda12-plugin=={jax_version} jax-cuda12-pjrt=={jax_version}",
            "tpu": "libtpu==0.0.42.1" if jax_version == "0.10.2" else f"'jax[tpu]=={jax_version}'"}


def aot_path() -> Path:
    return Path(os.environ.get("JAXSPEC_AOT_PATH") or Path(sys.prefix) / "aot")


def _missing(platform: str) -> JaxspecError:
    import jax

    return JaxspecError(
        f"compiling for {platform} here needs its compiler wheels: pip install --no-deps "
        f"--target {aot_path()} {wheels(jax.__version__)[platform]} (or pip install "
        f"'jaxspec-decoding[aot]'; scripts/setup.sh does the first)")


def _import_from_aot(module: str):
    """Import `module` as installed, else from the aot folder (added to sys.path only now)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        pass
    folder = str(aot_path())
    if os.path.isdir(folder) and folder not in sys.path:
        sys.path.append(folder)
        importlib.invalidate_caches()
    return importlib.import_module(module)


def _cuda_devices(t: AccelTarget, chips: int):
    import jax  # noqa: F401  (its own backends start first, without the plugin)
    from jax.experimental import topologies

    from jaxspec import jax_compat  # imports jax: not at this module's head

    jax.devices()  # this host's backends start before the plugin is registered
    if "cuda" not in jax_compat.topology_factories():  # not installed where jax discovers plugins
        try:
            plugin = _import_from_aot("jax_plugins.xla_cuda12")
        except ImportError:
            raise _missing("cuda") from None
        plugin.initialize()
    spec = (GPU_TARGETS / f"{t.name}.txtpb").read_text()
    return topologies.get_topology_desc(t.name, "cuda", target_config=spec,
                                        topology=f"1x1x{chips}").devices


def _tpu_devices(t: AccelTarget, chips: int):
    from jax.experimental import topologies

    if "TPU_LIBRARY_PATH" not in os.environ:
        try:
            libtpu = _import_from_aot("libtpu")
        except ImportError:
            raise _missing("tpu") from None
        os.environ["TPU_LIBRARY_PATH"] = str(Path(libtpu.__file__).with_name("libtpu.so"))
    shape = next((s for n, s in _TPU_TOPOLOGIES[t.topology] if n >= chips), None)
    if shape is None:
        raise JaxspecError(f"--mesh of {chips} chips: {t.name} topologies here hold up to 64")
    return topologies.get_topology_desc(platform="tpu",
                                        topology_name=f"{t.topology}:{shape}").devices[:chips]


def devices(t: AccelTarget, chips: int = 1) -> list:
    """`chips` compile-only devices of target `t` (nothing is run on them)."""
    for k, v in COMPILE_ONLY_ENV.items():
        os.environ.setdefault(k, v)
    return list(_cuda_devices(t, chips) if t.platform == "cuda" else _tpu_devices(t, chips))


def on(tree, sharding):
    """A pytree of arrays / ShapeDtypeStructs as ShapeDtypeStructs placed by `sharding` (one
    sharding, or a matching pytree of them)."""
    import jax

    if isinstance(sharding, jax.sharding.Sharding):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                            tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        tree, sharding)


def compile_for(t: AccelTarget, jitted, *args, **kwargs):
    """`jitted` (a jax.jit function) compiled for `t` from abstract args placed on its devices."""
    import jax

    from jaxspec import jax_compat  # imports jax: not at this module's head

    lowered = jitted.trace(*args, **kwargs).lower(lowering_platforms=(t.platform,))
    with jax_compat.compilation_cache_disabled():  # a compile-only client cannot load entries
        try:
            return lowered.compile()
        except jax.errors.JaxRuntimeError as e:  # libtpu refuses a program over the chip's HBM
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            first = str(e).split("\n")[0].removeprefix("RESOURCE_EXHAUSTED: ")
            raise JaxspecError(f"the program does not fit a {t.name} chip ({first}): use a larger "
                               "--mesh (more model shards), a smaller --batch or --capacity, or "
                               "--layers N to read the first N layers") from None
