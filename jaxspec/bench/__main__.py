"""`python -m jaxspec.bench`: the Spec-Bench / agent-workload runner."""

from jaxspec.bench.spec_bench import main

if __name__ == "__main__":
    main()
