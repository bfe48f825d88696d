"""Old name of ``nemo-rlhf-ckpt``'s entry point, kept for console scripts installed before
the split into :mod:`nemo_rlhf.tools.ckpt` (their wrapper imports ``ckpt_cli:main``; a
reinstall points them at :mod:`nemo_rlhf.tools.ckpt.cli`) and for old
``python -m nemo_rlhf.tools.ckpt_cli`` command lines. No logic here."""

import sys

from nemo_rlhf.tools.ckpt.cli import main

if __name__ == "__main__":
    sys.exit(main())
