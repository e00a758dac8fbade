"""Tasks: one folder per task (pretraining, caption, vqa, retrieval, grounding, classify, video), each holding its
training, its evaluation, its data format and its task-only model pieces; the steps tasks share sit beside them."""
