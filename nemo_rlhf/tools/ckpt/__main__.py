"""``python -m nemo_rlhf.tools.ckpt``: runs :func:`nemo_rlhf.tools.ckpt.cli.main` (no logic here)."""

import sys

from nemo_rlhf.tools.ckpt.cli import main

if __name__ == "__main__":
    sys.exit(main())
