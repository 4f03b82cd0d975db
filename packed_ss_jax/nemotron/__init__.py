"""Nemotron-Labs-Diffusion: its call layouts, loop state, schedules and decode program."""
