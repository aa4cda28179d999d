"""Local training: pure loss terms, the optimizer kernels, train_local, precision."""
