"""Training a small self-speculative model (AR mode + masked-diffusion drafting mode).

    python -m packed_ss_jax.training --out DIR --steps N --seed S

See `objective.py` for the loss and the block-diffusion mask, `corpus.py` for the
data, `tokenizer.py` for the tokenizer and `export.py` for the checkpoint layout.
"""
