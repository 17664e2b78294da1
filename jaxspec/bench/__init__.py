"""Benchmarks: `python -m jaxspec.bench` (Spec-Bench and the agent workload), adaptive
speculation (`jaxspec.bench.adaptive`), serving (`jaxspec.bench.serve`), and their
plans, rows, formula, peers, sweeps and plots."""
