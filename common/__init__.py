"""Shared machinery of the HW4 training scripts: model, data, distributed set-up, training, outputs."""
