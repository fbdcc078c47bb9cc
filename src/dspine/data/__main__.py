"""``python -m dspine.data ...``: the same as ``dspine data build ...``."""
import sys

from dspine.data.cli import main

sys.exit(main())
