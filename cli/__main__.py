import sys

from ds4f.cli import main

sys.exit(main())
