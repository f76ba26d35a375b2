"""`python -m labkit ...`: see labkit/cli/main.py."""

import sys

from labkit.cli.main import main

sys.exit(main())
