"""User-facing errors: one line that names the problem and the fix. The CLI prints them without a
traceback and exits non-zero; library users catch `JaxspecError` (a ValueError)."""


class JaxspecError(ValueError):
    """A mistake in the user's input (config, flags, files, checkpoints), with the fix in the text."""
