"""Old path of `jaxspec.decode.adaptive.host`, kept for one release: the same module object."""

import sys
import warnings

from jaxspec.decode.adaptive import host

warnings.warn("jaxspec.engine.adaptive_host moved to jaxspec.decode.adaptive.host: import it from there",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = host
