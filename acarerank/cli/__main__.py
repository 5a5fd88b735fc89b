"""``python -m acarerank.cli ...``: the ``acarerank`` console script without installing it."""
import sys

from . import main

sys.exit(main())
