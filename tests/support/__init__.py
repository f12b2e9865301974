"""Helpers the test suites share: the invariance harness, tiny Hugging Face and FP8
folders, the bit-exact fixture and the FP8 block-dot reference."""
