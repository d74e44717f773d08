"""`python -m verispec ...`: the command line (verispec.cli), as the `verispec` script runs it."""

from .cli import main

raise SystemExit(main())
