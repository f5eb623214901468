"""``python -m llmc_fsm``: the ``llmc-fsm`` command line.

Also the entry point for several processes::

    torchrun --nproc-per-node 2 -m llmc_fsm oneshot --dataset wiki.test.raw --output out

Under ``torchrun`` the CLI initializes the process group itself (see
:func:`llmc_fsm.toolkit.distributed.process_group_from_env` and ``docs/distributed.md``).
"""

from __future__ import annotations

import sys

from llmc_fsm.cli import main

if __name__ == "__main__":
    sys.exit(main())
