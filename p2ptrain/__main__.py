"""`python -m p2ptrain` = the `p2ptrain` command."""
import sys

from p2ptrain.cli import main

sys.exit(main())
