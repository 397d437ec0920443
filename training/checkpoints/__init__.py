"""What a run saves and reads: kill-safe checkpoints written in the background, DeepSpeed's universal
format for another layout, the export, and Hugging Face's layout both ways (export, train.init_from)."""
