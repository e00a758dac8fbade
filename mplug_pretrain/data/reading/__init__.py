"""Reading shards: WebDataset pipelines, the loader the trainer iterates, epoch accounting, skip counts."""
