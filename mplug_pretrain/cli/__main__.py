"""``python -m mplug_pretrain.cli`` = ``mplug``."""
import sys

from mplug_pretrain.cli.app import main

sys.exit(main())
