"""Tools that read what compiled and what it costs (the optimised-HLO queries they share are
`jaxspec.hlo`): the roofline (`python -m jaxspec.tools.roofline`), the n-gram acceptance
ceiling and the greedy-identity check."""
