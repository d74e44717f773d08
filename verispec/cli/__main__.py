"""`python -m verispec.cli ...`: the command line, as `python -m verispec` runs it."""

import sys

from . import main

sys.exit(main())
