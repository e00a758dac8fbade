"""mplug_pretrain: mPLUG-style vision-language pretraining and fine-tuning."""
from mplug_pretrain.compat import ensure_torchvision_importable

ensure_torchvision_importable()

__version__ = "0.1.0"
