"""python -m npllama: the same command line as the `npllama` script."""

import sys

from .cli import main

sys.exit(main())
