"""``python -m dspine.cli ...``: the same as the ``dspine`` command."""
import sys

from dspine.cli.main import main

sys.exit(main())
