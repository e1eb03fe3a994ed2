"""The serving core: everything a dgpipe model server does between a transport and the runtime (intake,
admission, deadlines, cancellation, stop words, metrics, response shaping, drain and shutdown), in plain
Python. A transport adapter (model_repo/dgpipe_model.py for Triton's Python backend) turns its requests into
an input getter, parameters and a reply channel, and the core's replies back into its own responses."""
