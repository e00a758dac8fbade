"""Data: shard writers (``write_*``, ``shard_writer``), reader pipelines (``pipeline``), image transforms
(``transforms``, importable alone for inference), tokenizer, synthetic demo data (``demo_shards``).

Nothing is imported here so that ``mplug_pretrain.data.transforms`` stays free of webdataset.
"""
