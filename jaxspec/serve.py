"""python -m jaxspec.serve --config C [--host 127.0.0.1 --port 8000]: an OpenAI-compatible
server (jaxspec/serving/http.py) over continuous batching, with the config's model, drafter,
sampling defaults and `serving` section (slots, max_context, steps_per_call, max_queue,
kv_pages, page_size, prefill_chunk, prefix_cache, policy, precompile). Arguments are parsed before jax
or the model load is imported."""

from __future__ import annotations

import os
import sys

from jaxspec.cli_support import EXIT_USAGE, ArgumentParser
from jaxspec.errors import JaxspecError


def make_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m jaxspec.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="YAML config (default: every default: SmolLM2, plain)")
    p.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE",
                   help="dotted config override, e.g. serving.slots=8 (repeatable)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free one)")
    p.add_argument("--model-name", help="the model id clients send (default: the config's model)")
    return p


def build_server(config, model_name: str | None = None):
    """(Server, FastAPI app) for a Config: the engine is built with serving.max_context."""
    import dataclasses

    from jaxspec.build import build_engine
    from jaxspec.serving import Server
    from jaxspec.serving.http import make_app

    s = config.serving
    config = dataclasses.replace(
        config, generation=dataclasses.replace(config.generation, max_context=s.max_context))
    engine = build_engine(config)
    server = Server(engine, slots=s.slots, max_context=s.max_context,
                    steps_per_call=s.steps_per_call, max_queue=s.max_queue,
                    kv_pages=s.kv_pages or None, page_size=s.page_size, seed=config.sampling.seed,
                    prefill_chunk=s.prefill_chunk or None, prefix_cache=s.prefix_cache,
                    policy=s.policy, model_name=model_name or config.model.name)
    return server, make_app(server)


def run(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    if not 0 <= args.port < 65536:
        raise JaxspecError(f"--port {args.port} is out of range: use 0..65535")
    try:
        import uvicorn
    except ImportError:
        raise JaxspecError(
            "the server needs the serve extra: pip install 'jaxspec[serve]'"
        ) from None
    from jaxspec.cli_support import enable_compilation_cache
    from jaxspec.config import load_config

    config = load_config(args.config, args.override)
    enable_compilation_cache()
    server, app = build_server(config, args.model_name)
    try:
        if config.serving.precompile:  # else a call of a new width compiles while requests wait
            import time

            t0 = time.perf_counter()
            print("jaxspec.serve: compiling the decode programs (serving.precompile=false skips)",
                  file=sys.stderr, flush=True)
            n = server.scheduler.compile_programs()
            print(f"jaxspec.serve: {n} programs ready in {time.perf_counter() - t0:.1f} s",
                  file=sys.stderr, flush=True)
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        server.close()
    return 0


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
