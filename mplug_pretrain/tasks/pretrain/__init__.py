"""Pretraining: ITC + ITM + MLM + PrefixLM on image-text shards (`mplug pretrain`)."""
