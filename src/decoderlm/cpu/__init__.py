"""CPU speed paths, each applied from a call site outside the model and each switchable off."""
