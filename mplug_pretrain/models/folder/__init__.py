"""Model folders: config.json, preprocessing files, the model card, the Hugging Face Hub."""
