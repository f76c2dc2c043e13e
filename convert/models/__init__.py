"""One converter per architecture, targets and drafters alike (as csrc/models/ has one
model file each): its hyperparameters, keys and tensors, registered in ../registry.py."""
