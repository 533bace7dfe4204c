"""python -m fusedlm: the fusedlm command."""
import sys

from fusedlm.cli import main

if __name__ == "__main__":
    sys.exit(main())
