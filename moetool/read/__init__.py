"""Reading checkpoints: files, headers, experts, shard outputs (imports neither convert nor verify)."""
