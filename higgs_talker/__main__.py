"""``python -m higgs_talker``: the ``higgs-talker`` command."""

import sys

from .cli import main

sys.exit(main())
