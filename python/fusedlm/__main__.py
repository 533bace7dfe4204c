"""python -m fusedlm: the fusedlm command."""
import os
import sys

from fusedlm.cli import main

if __name__ == "__main__":
    status = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # A process of a torchrun run ends as multiprocessing's children do, without the
        # interpreter's shutdown: a gloo worker thread of torch's can still be releasing a
        # collective's tensors then, and one that needs the GIL during the shutdown aborts
        # the process (pytorch/pytorch#190489). Every file the command wrote is closed.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)
