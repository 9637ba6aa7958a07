import sys

from statestream.cli import main

sys.exit(main())
