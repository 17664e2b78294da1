"""`python -m jaxspec.bench`: one run of the Spec-Bench or the agent workload, chosen by
`--workload`. Above both runners (the agent's extends Spec-Bench's), so neither imports the other
back."""

from __future__ import annotations

import sys

from jaxspec.bench.agent import AgentBench
from jaxspec.bench.options import check_extras, make_parser
from jaxspec.bench.spec_bench import EXIT_INTERRUPTED, Bench
from jaxspec.cli_support import EXIT_USAGE
from jaxspec.errors import JaxspecError

RUNNERS = {"agent": AgentBench}  # workload -> its runner; any other: Spec-Bench's


def main(argv: list[str] | None = None, *, target=None, hf_model=None) -> int:
    """The CLI. `target` (a LoadedModel) / `hf_model` (its transformers twin): reuse loaded ones."""
    argv = list(sys.argv[1:] if argv is None else argv)
    bench = None
    try:
        args = make_parser().parse_args(argv)
        check_extras(args)
        runner = RUNNERS.get(args.workload, Bench)
        bench = runner(args, argv, target=target, hf_model=hf_model)
        bench.prepare()
        bench.load()
        if not args.sweeps_only:
            bench.run_main()
            if bench.vllm:
                bench.run_vllm_phases()
        if args.gammas:
            bench.run_gamma_sweep()
        if args.batch_sizes:
            bench.run_batch_sweep()
        bench.results["status"] = "complete"
        bench.summarise()
        bench.write(plots=True)
    except JaxspecError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        if bench is not None and (bench.rows or "gamma_sweep" in bench.results):
            bench.results["status"] = "interrupted"
            bench.summarise()
            bench.write(plots=True)
            print(f"\ninterrupted: partial results in {bench.out}/results.json", file=sys.stderr)
        else:
            print("\ninterrupted before any result", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        if bench is not None:
            bench.close()  # the vLLM peer's engine processes
    print(f"results: {bench.out}/results.json, {bench.out}/summary.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    from jaxspec.cli_support import run as run_cli

    sys.exit(run_cli(main))
