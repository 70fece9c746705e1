"""``python -m workbench`` (what ``accelerate launch -m workbench run CONFIG`` starts on each rank)."""

import sys

from workbench.cli import main

sys.exit(main())
