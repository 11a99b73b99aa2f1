"""``python -m podscale.plan ...`` is ``podscale plan ...``."""
import sys

from .cli import main

sys.exit(main())
