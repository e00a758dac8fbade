"""Model library: importable without any training code."""
