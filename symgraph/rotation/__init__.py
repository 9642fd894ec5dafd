"""Rotations for quantization: rotate() in memory, its classes, learned rotations, a checkpoint rotated out of core."""
