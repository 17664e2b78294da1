"""The server's resident memory and what it holds: the weights, the KV page pool, the compiled
programs (what the warm-up added) and the rest (the runtime, the tokenizer, Python), read from
/proc/self/status (Linux; elsewhere the report says it cannot tell)."""

from __future__ import annotations

import jax

GB = 1 << 30


def resident_bytes() -> int | None:
    """This process's resident set (VmRSS), None where /proc is not there."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def release_free_heap() -> bool:
    """Hand the C heap's free pages back to the system (glibc's malloc_trim): compiling and
    loading programs leaves hundreds of MB freed but still resident. False where not glibc."""
    import gc

    gc.collect()
    try:
        import ctypes

        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


def _nbytes(tree) -> int:
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(tree)
               if hasattr(x, "dtype"))


def parts(scheduler, before_programs: int | None) -> dict[str, int | None]:
    """Bytes: weights (target and drafter), the KV pool (allocated at the first request),
    the compiled programs (resident growth over the warm-up), resident now, and the rest."""
    engine = scheduler.engine
    weights = _nbytes(engine.model.params) + _nbytes(engine.drafter_params)
    pool = scheduler.admission._pool_shape(1)
    kv = _nbytes((pool.k, pool.v)) if pool is not None else scheduler.slots * _nbytes(
        engine.cache_shape(scheduler.spec.target, 1, scheduler.capacity))
    now = resident_bytes()
    programs = None if now is None or before_programs is None else max(now - before_programs, 0)
    rest = None if now is None else max(now - weights - (programs or 0), 0)
    return {"weights": weights, "kv_pool": kv, "programs": programs, "resident": now,
            "rest": rest}


def report(scheduler, before_programs: int | None) -> str:
    """One line: resident memory and its parts (the KV pool is allocated at the first request,
    so it is counted apart, as what resident memory will grow by)."""
    p = parts(scheduler, before_programs)
    if p["resident"] is None:
        return (f"memory: weights {p['weights'] / GB:.2f} GB, KV pool {p['kv_pool'] / GB:.2f} GB "
                "(resident memory unknown on this system)")
    return (f"resident memory {p['resident'] / GB:.2f} GB: weights {p['weights'] / GB:.2f} GB, "
            f"compiled programs {p['programs'] / GB:.2f} GB, rest {p['rest'] / GB:.2f} GB; the "
            f"KV pool adds {p['kv_pool'] / GB:.2f} GB at the first request")
