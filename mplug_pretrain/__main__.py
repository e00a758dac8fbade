"""``python -m mplug_pretrain`` = ``mplug`` (torchrun and the Slurm scripts launch ranks this way)."""
import sys

from mplug_pretrain.cli.app import main

sys.exit(main())
