import sys

from tokenlake.cli.main import main

sys.exit(main())
