import sys

from kvtier.server.flags import main

sys.exit(main(sys.argv[1:]))
