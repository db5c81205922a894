"""`python -m app`: the same as the `kvscope` command."""

import sys

from app.main import main

sys.exit(main())
