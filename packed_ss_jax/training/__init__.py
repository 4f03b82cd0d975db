"""Training a small self-speculative model from scratch, for either model family.

    python -m packed_ss_jax.training --out DIR [--family nemotron|setdlm] --seed S

Nemotron-Labs-Diffusion (AR mode + masked-diffusion drafting mode): see `objective.py`
for the loss and the block-diffusion mask. SetDLM (any-order, Qwen3 backbone): see
`setdlm_objective.py` for the two-stream construction. `corpus.py` holds the data,
`tokenizer.py` the tokenizer, `train.py` the loop and `export.py` the checkpoint layouts.
"""
