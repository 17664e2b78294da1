"""Old path of `jaxspec.decode.adaptive.calibration`, kept for one release: the same module object."""

import sys
import warnings

from jaxspec.decode.adaptive import calibration

warnings.warn("jaxspec.decode.calibration moved to jaxspec.decode.adaptive.calibration: import it from there",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = calibration
