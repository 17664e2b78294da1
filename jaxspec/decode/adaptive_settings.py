"""Old path of `jaxspec.decode.adaptive.settings`, kept for one release: the same module object."""

import sys
import warnings

from jaxspec.decode.adaptive import settings

warnings.warn("jaxspec.decode.adaptive_settings moved to jaxspec.decode.adaptive.settings: import it from there",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = settings
