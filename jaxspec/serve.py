"""python -m jaxspec.serve --config C [section.key=value ...] [--host 127.0.0.1 --port 8000]: an
OpenAI-compatible server (jaxspec/serving/http.py) over continuous batching, with the config's
model, drafter, sampling defaults and `serving` section (slots, max_context, steps_per_call,
max_queue, kv_pages, page_size, prefill_chunk, prefix_cache, batch_prefill, max_batched_tokens, policy, precompile,
request limits, drain_s). Arguments are parsed before jax or the model load is imported.

With `distributed.*` naming several processes (`jaxspec.distributed`), run the same command on
each: the mesh spans every process's devices, process 0 listens and schedules, the others follow
its rounds (`serving.lockstep`) and exit when it stops.

It listens at once (`/health` answers; `/ready` and requests get 503 while its programs load or
compile: `prepare_programs`), prints `jaxspec.serve: listening on http://H:P` and then `... ready`. SIGTERM or
SIGINT: new requests get 503, running ones get serving.drain_s to finish and are then ended with
finish_reason "abort", every page is freed, and the process exits 0 (a second SIGINT forces).
If the serving loop itself dies (a request's failure is confined to it; this is the rest),
/health and /ready answer 503, the cause goes to stderr, the streams in flight end with
finish_reason "error", and the process exits 3 so a supervisor restarts it."""

from __future__ import annotations

# Imported inside functions: jax, transformers and torch (and the jaxspec modules that load
# them) load only when a command runs, so its --help answers in a second (tests/test_help.py).

import os
import sys

from jaxspec.cli_support import EXIT_USAGE, ArgumentParser
from jaxspec.errors import JaxspecError


def make_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m jaxspec.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="YAML config (default: every default: SmolLM2, plain)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value",
                   help="config overrides, e.g. serving.slots=8 (as generate takes them)")
    p.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE",
                   help="dotted config override, e.g. serving.slots=8 (repeatable)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free one)")
    p.add_argument("--model-name", help="the model id clients send (default: the config's model)")
    p.add_argument("--quiet", action="store_true",
                   help="no progress lines (model load, compiles); the jaxspec.serve lines stay")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (default: $JAXSPEC_API_KEY; /health "
                        "and /ready stay open). Visible in ps: prefer the variable or the file")
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="read the key from this file's first line (default: "
                        "$JAXSPEC_API_KEY_FILE)")
    return p


def serving_engine(config):
    """(engine, Scheduler/Server options: the `serving` section whole and the seed) for a Config:
    the engine built with serving.max_context."""
    import dataclasses

    from jaxspec.build import build_engine

    s = config.serving
    # the batch a mesh's data axis must divide is the server's slots
    config = dataclasses.replace(config, generation=dataclasses.replace(
        config.generation, max_context=s.max_context, batch_size=s.slots))
    # the section passed down whole; one page-table width (`batch.table_widths`): every
    # program is held resident, so few of them
    options = {"config": s, "seed": config.sampling.seed, "tables": "one"}
    return build_engine(config), options


def build_server(config, model_name: str | None = None, gate=None):
    """(Server, FastAPI app) for a Config: the engine is built with serving.max_context."""
    from jaxspec.serving import Server
    from jaxspec.serving.gate import Gate, Limits
    from jaxspec.serving.http import make_app

    engine, options = serving_engine(config)
    server = Server(engine, **options, model_name=model_name or config.model.name)
    return server, make_app(server, gate or Gate(limits=Limits.of(config.serving)))


def follow(config) -> int:
    """A process other than 0 of a multi-process mesh: the same scheduler as process 0's, run
    round by round as process 0 broadcasts them (`serving.lockstep`), until it closes."""
    import jax

    from jaxspec.serving import lockstep
    from jaxspec.serving.scheduler import Scheduler

    engine, options = serving_engine(config)
    scheduler = Scheduler(engine, **options)
    say(f"process {jax.process_index()} of {jax.process_count()}: following process 0's rounds")
    rounds = lockstep.follow(scheduler)
    say(f"process {jax.process_index()}: process 0 closed after {rounds} rounds run here")
    return 0


LOOPBACK = ("127.0.0.1", "localhost", "::1")
EXIT_ENGINE_DIED = 3  # the serving loop stopped on an exception: a supervisor restarts it


def api_key(args) -> str | None:
    """The key from --api-key, --api-key-file, $JAXSPEC_API_KEY_FILE or $JAXSPEC_API_KEY (None:
    no key)."""
    path = args.api_key_file or os.environ.get("JAXSPEC_API_KEY_FILE")
    if args.api_key or not path:
        return args.api_key or os.environ.get("JAXSPEC_API_KEY") or None
    try:
        with open(path, encoding="utf-8") as f:
            key = f.readline().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise JaxspecError(f"cannot read the API key file {path}: {e}") from None
    if not key:
        raise JaxspecError(f"the API key file {path} is empty: write the key on its first line")
    return key


def say(line: str) -> None:
    try:
        print(f"jaxspec.serve: {line}", file=sys.stderr, flush=True)
    except OSError:  # stderr closed (the parent went away): keep serving / stopping
        pass


def serve_until_stopped(uvicorn, app, host: str, port: int, warm_up=None,
                        died=None) -> None:
    """Run uvicorn on a socket bound here (port 0: any free one, so the port is known), and print
    the URL on stderr once it accepts connections: `jaxspec.serve: listening on http://H:P`.
    `warm_up()` then runs on a thread (the app's gate answers 503 until it returns). The first
    SIGTERM/SIGINT drains the app's gate on a thread, then stops uvicorn; so does `died` (a
    threading.Event: the serving loop stopped) once set, after the streams it ended are sent."""
    import socket
    import threading
    import time

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise JaxspecError(f"cannot listen on {host}:{port} ({e.strerror}): pick another --port "
                           "(0: any free one)") from None
    bound = sock.getsockname()[1]
    gate = app.state.gate
    failure: list[BaseException] = []
    warming = threading.Event()  # the warm-up is running

    class Draining(uvicorn.Server):
        def handle_exit(self, sig, frame):  # not re-raised after the run: the exit is ours
            if gate.draining:  # a second signal: stop now
                self.force_exit = self.should_exit = True
                return
            gate.draining = True
            threading.Thread(target=stop, name="jaxspec-drain", daemon=True).start()

    def stop():
        try:
            aborted = gate.drain()
            say(f"stopped admitting; {aborted} running request(s) ended with 'abort'")
        finally:
            server.should_exit = True

    server = Draining(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))

    def announce():  # bounded: gives up when the server stops before it starts
        while not server.started and not server.should_exit:
            time.sleep(0.05)
        if not server.started:
            return
        shown = f"[{host}]" if family == socket.AF_INET6 else host
        say(f"listening on http://{shown}:{bound}")
        if warm_up is not None:
            warming.set()
            try:
                warm_up()
            except BaseException as e:  # noqa: BLE001 -- reported by run(), the server stops
                failure.append(e)
                server.should_exit = True
                return
            finally:
                warming.clear()
        gate.ready = True
        say("ready")

    def watch():
        died.wait()
        gate.ready = False
        say("stopping: the serving loop died (its cause is above); exit status "
            f"{EXIT_ENGINE_DIED}")
        time.sleep(0.5)  # the handlers send what the loop ended with
        server.should_exit = True

    threading.Thread(target=announce, name="jaxspec-warm-up", daemon=True).start()
    if died is not None:
        threading.Thread(target=watch, name="jaxspec-watch", daemon=True).start()
    server.run(sockets=[sock])
    if failure:
        raise failure[0]
    if warming.is_set():
        exit_during_warm_up(EXIT_ENGINE_DIED if died is not None and died.is_set() else 0)


def exit_during_warm_up(code: int) -> None:
    """Stopped (SIGTERM, or the serving loop died) while the warm-up compiles: exit now. Nothing was served (requests
    got 503), and a compile cannot be interrupted: waiting could take a minute, and a compile
    returning into an interpreter being torn down aborts the process ("terminate called ...",
    SIGABRT) where a supervisor expects a clean stop. The stores are whole (each entry is
    written to a temporary file, then renamed)."""
    say("stopped during the warm-up, before 'ready'; its unfinished compile is dropped")
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def admitted_lengths(scheduler, limits) -> range:
    """Every prompt length the server admits: a prompt leaves room for one token and a last
    verify window in serving.max_context, and is within serving.max_prompt_tokens."""
    most = scheduler.capacity - scheduler.spec.depth - 2
    if limits.max_prompt_tokens:
        most = min(most, limits.max_prompt_tokens)
    return range(1, max(most, 0) + 1)


def server_programs(scheduler, limits) -> list[dict]:
    """Every program the server calls: each decode call shape and the prefill of every
    prompt bucket it admits (whole prompts, tails over shared pages, chunks), each for an
    all-greedy batch and for a batch with a sampled row (`SamplingParams.mode` is static:
    "greedy" carries no sampling code, "any" decides per row; prefills are "any" only:
    `admission.prefill_sampling`), and the chunk program echo with
    logprobs scores prompts with (engine/prompt_scores.py)."""
    programs = [*scheduler.decode_programs(),
                *scheduler.prefill_programs(admitted_lengths(scheduler, limits))]
    scores = {"name": "prompt_scores", "rows": 1, "program": scheduler.engine.score_program()}
    return [*programs, *filter(None, map(_sampled_twin, programs)), scores]


def _sampled_twin(program: dict) -> dict | None:
    """`program` with its sampling values' mode "any" (None: it takes none)."""
    import dataclasses

    from jaxspec.decode.sampling import SamplingParams  # imported here: jax (the --help rule)

    fn, args, kwargs = program["program"]
    at = next((i for i, a in enumerate(args) if isinstance(a, SamplingParams)), None)
    if at is None or args[at].mode == "any":  # none, or one program for both (prefills)
        return None
    args = (*args[:at], dataclasses.replace(args[at], mode="any"), *args[at + 1 :])
    return program | {"program": (fn, args, kwargs), "sampling": "any"}


def prepare_programs(scheduler, config, limits) -> None:
    """The warm-up after `listening`: every program the server calls (`server_programs`),
    loaded whole from the serving-program store (no tracing: `serving.executables`) or
    compiled and stored, saying which, how many are left and how long that should take; the
    engine then calls them through the store. Ends with the resident memory report."""
    import time

    from jaxspec import progress
    from jaxspec.paths import cache_root
    from jaxspec.serving import executables, memory
    from jaxspec.xla_cache import directory as xla_directory

    t0, before = time.perf_counter(), memory.resident_bytes()
    with progress.step("listing the server's programs (decode call shapes, prompt buckets)"):
        programs = server_programs(scheduler, limits)
    store = None if xla_directory() is None else cache_root() / "serving-programs"
    table = executables.Table(store, executables.fingerprint(config))
    n = len(programs)
    say(f"/health answers; requests get 503 until 'ready': {n} programs to load or compile "
        "first (serving.precompile=false skips)")
    started = progress.start(f"server programs ({n})")
    counts = {"loaded": 0, "compiled": 0}
    compile_s = 0.0
    for i, program in enumerate(programs):
        t = time.perf_counter()
        how = table.prepare(program["program"])
        counts[how] += 1
        compile_s += time.perf_counter() - t if how == "compiled" else 0.0
        started.update(_left(program, i + 1, n, how, compile_s / max(counts["compiled"], 1)))
    scheduler.engine.serving_programs = table
    started(f"{counts['loaded']} loaded, {counts['compiled']} compiled")
    say(f"{counts['loaded']} programs loaded and {counts['compiled']} compiled in "
        f"{time.perf_counter() - t0:.1f} s")
    memory.release_free_heap()
    say(memory.report(scheduler, before))


def _left(program: dict, k: int, n: int, how: str, per_compile_s: float) -> str:
    """The warm-up's progress line: which program, and an upper estimate of the time left."""
    shape = ", ".join(f"{key} {program[key]}" for key in ("rows", "table_pages", "prompt_bucket",
                                                           "sampling") if program.get(key))
    left = f"; at most ~{per_compile_s * (n - k):.0f} s left" if how == "compiled" else ""
    return f"program {k} of {n} ({program['name']}, {shape}) {how}{left}"


def run(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    if args.quiet:
        from jaxspec import progress as quiet_progress

        quiet_progress.set_quiet()
    if not 0 <= args.port < 65536:
        raise JaxspecError(f"--port {args.port} is out of range: use 0..65535")
    try:
        import uvicorn
    except ImportError:
        raise JaxspecError(
            "the server needs the serve extra: bash scripts/setup.sh main in a checkout, or "
            "pip install -e '.[serve]' there (jaxspec-decoding is not on PyPI)"
        ) from None
    from jaxspec import progress
    from jaxspec.cli_support import enable_compilation_cache
    from jaxspec.config import load_config
    from jaxspec.serving.gate import Gate, Limits

    config = load_config(args.config, [*args.overrides, *args.override])
    from jaxspec import distributed

    # several processes (distributed.*): one mesh over all their devices; process 0 serves HTTP
    if distributed.start(config.distributed) and not distributed.is_primary():
        enable_compilation_cache()
        return follow(config)
    key = api_key(args)
    if args.host not in LOOPBACK and key is None:
        say(f"warning: listening on {args.host} without an API key: anyone who reaches the port "
            "can generate (set --api-key or JAXSPEC_API_KEY)")
    enable_compilation_cache()
    then = "its programs, then 'ready'" if config.serving.precompile else "'ready'"
    say(f"loading {config.model.name} and building the engine; then listening, then {then}")
    gate = Gate(api_key=key, limits=Limits.of(config.serving), ready=False)
    with progress.step(f"building the engine and the scheduler ({config.serving.slots} slots)"):
        server, app = build_server(config, args.model_name, gate)
    from jaxspec.serving import memory

    memory.release_free_heap()  # the load's host copies, freed but resident (~0.7 GB for SmolLM2)
    warm_up = None
    if config.serving.precompile:  # else a call of a new width compiles while requests wait
        warm_up = lambda: prepare_programs(server.scheduler, config, Limits.of(config.serving))
    else:
        say("serving.precompile=false: each decode width compiles (or loads from the cache) on "
            "its first request")
    try:
        serve_until_stopped(uvicorn, app, args.host, args.port, warm_up, server.died)
        h = server.health()
        say(f"stopped: {h['free_pages']} of {h['kv_pages']} KV pages free, "
            f"{h['active']} rows running, {h['queued']} queued")
    finally:
        server.close()
    return 0 if server.failure is None else EXIT_ENGINE_DIED


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        return run(argv)
    except JaxspecError as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
