"""Trained drafters: distillation data (`data`), methods and losses (`methods`), the optax/orbax
trainer (`train`), shipped checkpoints (`checkpoint`, `load`). CLI: python -m jaxspec.train."""
