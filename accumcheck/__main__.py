"""``python -m accumcheck``: the command line, as ``accumcheck`` runs it."""

import sys

from .cli import main

sys.exit(main())
