"""Text decoder heads behind one contract (api.py): the mPLUG BERT decoder, ExpansionNet v2, ACF."""
