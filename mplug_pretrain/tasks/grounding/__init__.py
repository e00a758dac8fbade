"""Visual grounding: box generation as coordinate tokens, fine-tuning and evaluation (Acc@0.5)."""
