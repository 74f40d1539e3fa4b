"""``python -m rldispatch COMMAND ...``: the form torchrun launches (``torchrun ... -m rldispatch train ...``)."""
import sys

from rldispatch.cli import main

sys.exit(main())
