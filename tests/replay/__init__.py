"""The reference miniature: the model, replay, fidelity, training."""
