"""The repository stage and serving: the Triton model repository, the server, and its clients."""
