import sys

from sage_qual.cli import main

sys.exit(main())
