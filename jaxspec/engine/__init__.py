"""The engine, split by job: `runner.Engine` (compile, run and time the loop; the public entry
point), `prepare` (tokenise, bucket, validate requests), `programs` (the compiled-program cache
and what each program compiled to), `results` (tokens, text and metrics per row) and
`adaptive_host` (a former path of jaxspec.decode.adaptive.host, kept for one release)."""
