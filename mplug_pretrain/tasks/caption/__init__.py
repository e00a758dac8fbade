"""Captioning: fine-tuning (cross-entropy, then SCST on CIDEr-D), the frozen-feature cache, evaluation and
`mplug caption`."""
