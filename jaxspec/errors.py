"""User-facing errors: one line that names the problem and the fix. The CLI prints them without a
traceback and exits non-zero; library users catch `JaxspecError` (a ValueError)."""


class JaxspecError(ValueError):
    """A mistake in the user's input (config, flags, files, checkpoints), with the fix in the text."""


def short(value) -> str:
    """A bounded repr for error messages: a huge or deeply nested value (a YAML of nested
    anchors, a long list) prints as a few items, never in full."""
    import reprlib

    r = reprlib.Repr()
    r.maxstring = r.maxother = 60
    r.maxlist = r.maxdict = r.maxtuple = r.maxset = 4
    r.maxlevel = 2
    return r.repr(value)
