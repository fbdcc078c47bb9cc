"""``python -m dspine.data ...``: the same as ``dspine data build ...``."""
import sys

from .cli import main

sys.exit(main())
