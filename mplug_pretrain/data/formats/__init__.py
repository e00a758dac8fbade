"""Sample formats: how a raw tar sample is decoded and batched, image and video decoding, the shard manifest."""
