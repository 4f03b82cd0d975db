"""SetDLM decoding: two-stream layouts, the release's native decoder and the
Linear/Quadratic/Packed self-speculative schedules with LTR or confidence order."""
