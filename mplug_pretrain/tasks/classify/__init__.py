"""Classification tasks on the fused [CLS]: SNLI-VE and NLVR2."""
