"""Allow ``python -m fedddl``."""

import sys

from fedddl.cli import main

sys.exit(main())
