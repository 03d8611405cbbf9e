"""The model-parallel family: objects that own their step, and the moves of their pp/tp parts."""
