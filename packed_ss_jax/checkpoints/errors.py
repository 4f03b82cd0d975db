class CheckpointError(ValueError):
    """A checkpoint that is missing, unreadable or does not match its config."""
