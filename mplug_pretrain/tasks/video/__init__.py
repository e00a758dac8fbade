"""Zero-shot video tasks of an image model: text-video retrieval, video QA, video captioning."""
