"""Pretraining heads and losses: ITC (itc.py), ITM (itm.py), MLM (mlm.py), PrefixLM (prefix_lm.py), LM head."""
