"""``python -m gradmap``: the same as the ``gradmap`` command."""

import sys

from ._cli import main

sys.exit(main())
