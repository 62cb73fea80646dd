import sys

from sparksteward.cli import main

sys.exit(main())
