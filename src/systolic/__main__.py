import sys

from systolic.cli import main

sys.exit(main())
