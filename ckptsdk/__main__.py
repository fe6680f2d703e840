"""``python -m ckptsdk``: the same command line as the ``ckptsdk`` script (see ckptsdk/cli/)."""

import sys

from .cli import main

sys.exit(main())
