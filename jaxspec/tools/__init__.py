"""Tools that read what compiled and what it costs: optimised-HLO queries (hlo), the
roofline (`python -m jaxspec.tools.roofline`), the n-gram acceptance ceiling and the
greedy-identity check."""
