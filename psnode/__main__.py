"""``python -m psnode scheduler|server``: run one bundled node of the job the environment describes."""

import sys

from psnode.main import main

sys.exit(main())
