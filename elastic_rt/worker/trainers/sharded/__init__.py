"""The sharded family: a TrainState under FSDP2/HSDP and the restores of its pieces."""
