"""Old path of `jaxspec.decode.adaptive.loop`, kept for one release: the same module object."""

import sys
import warnings

from jaxspec.decode.adaptive import loop

warnings.warn("jaxspec.decode.adaptive_loop moved to jaxspec.decode.adaptive.loop: import it from there",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = loop
