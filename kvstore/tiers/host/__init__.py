"""The host tier: values in process memory, in buffers of a recycling pool."""
