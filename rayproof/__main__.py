import sys

from rayproof.cli import main

sys.exit(main())
