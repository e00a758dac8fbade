"""Shard writers: `mplug make-shards` for each supported source (COCO, CSV, VQA, video, grounding, ...)."""
