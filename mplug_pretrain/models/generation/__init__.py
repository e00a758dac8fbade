"""Decoding: beam search, sampling, sequence scoring, answer ranking, decoding settings, packed CPU weights."""
