import sys

from kvtier.cli import main

sys.exit(main(["server", *sys.argv[1:]]))
