import sys

from corpusd.cli import main

sys.exit(main())
