"""`python -m k31c` = the `k31c` command."""
import sys

from .cli import main

sys.exit(main())
