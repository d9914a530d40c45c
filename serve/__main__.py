import sys

from tokenlake.serve.cli import main

sys.exit(main())
