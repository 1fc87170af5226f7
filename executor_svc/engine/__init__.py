"""The executor's engine: the request table and the step (admit, run the model, sample, verify,
postprocess)."""
