"""rawpaged's HTTP server: ``python server.py [options]`` is ``rawpaged serve [options]``
(``rawpaged.entrypoints``; README.md, "Server")."""

import sys

from rawpaged.entrypoints.cli import serve_main

if __name__ == "__main__":
    sys.exit(serve_main(prog="python server.py"))
