#!/usr/bin/env python
"""Convert a Nemotron-Labs-Diffusion Hugging Face directory to a packed_ss_jax checkpoint.

    python convert/convert_nemotron.py /models/Nemotron-Labs-Diffusion-8B /models/nld-8b-jax \
        --dtype bfloat16

Same as the installed `packed-ss-convert` command.
"""

import sys

from packed_ss_jax.cli import convert_main

if __name__ == "__main__":
    sys.exit(convert_main())
