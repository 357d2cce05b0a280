"""Python face of the C++ kernels. Each kernel has a plain-torch reference beside it (`*_reference`),
used by the tests and as the fallback when the extension cannot be built."""
from .adam import *  # noqa: F401,F403
from .copy import *  # noqa: F401,F403
from .threads import *  # noqa: F401,F403
