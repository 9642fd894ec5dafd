"""The ``symgraph`` console script. Importing the package loads torch and transformers (seconds);
a Ctrl-C during that must end with one line and exit 130, not a traceback."""
import sys


def main():
    try:
        from symgraph.cli.main import main as run
    except KeyboardInterrupt:
        sys.stderr.write("symgraph: interrupted (Ctrl-C) while starting; nothing was written\n")
        sys.exit(130)
    sys.exit(run())
