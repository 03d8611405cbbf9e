"""The worker side of in-process training: batches, gradient averaging, the step, failures."""
