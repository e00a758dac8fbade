"""Visual question answering: generative fine-tuning and evaluation (VQA v2 accuracy)."""
