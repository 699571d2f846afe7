"""``python -m gateway.client``: the terminal chat (see :mod:`gateway.client.cli`)."""

import sys

from gateway.client.cli import main

sys.exit(main())
