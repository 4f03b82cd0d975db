"""Reading released checkpoints and storing converted params."""
