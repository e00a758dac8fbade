"""``python -m mplug_pretrain`` = ``mplug`` (torchrun and the Slurm scripts launch ranks this way)."""
from mplug_pretrain.cli.app import entry

entry()
