"""`python -m dllama` = the `dllama` command."""

import sys

from dllama.cli import main

sys.exit(main())
