"""`python -m autopar ...` is the `autopar` command (torchrun runs `-m autopar calibrate`)."""

import sys

from autopar.cli import main

sys.exit(main())
