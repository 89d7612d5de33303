"""`python -m tokenload` is the same as the `tokenload` console script."""

import sys

from tokenload.cli import main

sys.exit(main())
