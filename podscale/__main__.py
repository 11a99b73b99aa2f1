import sys

from podscale.cli import main

sys.exit(main())
