import sys

from hasten.cli.main import main

sys.exit(main())
