"""Image-text retrieval: fine-tuning (ITC + ITM) and evaluation (recall@K, ITM re-ranking)."""
