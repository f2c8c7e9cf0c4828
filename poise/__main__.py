"""``python -m poise`` is the ``poise`` command."""

import sys

from poise.cli import main

sys.exit(main())
