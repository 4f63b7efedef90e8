import sys

from vramwatch.cli import main

sys.exit(main())
