"""``python -m ckptsdk``: the same command line as the ``ckptsdk`` script (see ckptsdk/cli/)."""

import sys

from ckptsdk.cli import main

sys.exit(main())
