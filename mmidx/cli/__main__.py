"""``python -m mmidx.cli``: the ``mmidx`` command."""

import sys

from mmidx.cli import main

sys.exit(main())
