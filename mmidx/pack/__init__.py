"""Packed batches: a pack of samples to one batch in BAGEL's layout, its pixels, buffers and masks."""
