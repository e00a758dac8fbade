"""Evaluation: COCO caption metrics, fast CIDEr-D (SCST reward), VQA accuracy, retrieval recall."""
