"""Target models: the protocol (`base.py`), one module per family on the shared blocks, and the
family registry (`registry.py`, `families.py`) the loaders read.
"""
